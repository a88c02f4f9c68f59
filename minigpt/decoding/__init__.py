"""The one decoding engine behind every door: `minigpt.generate`, `minigpt.serve`,
`minigpt.eval` and post-training's rollouts.

`engine` (the slots requests join and leave call by call, on the caller's thread or one of its
own) runs `programs` (the compiled prefills and decode steps, the key/value cache, and how they
compute: dtypes, FP8, per-layer weights on a CPU) with `sampler` (each row's next token:
temperature, top-k, top-p, min-p, a key per request); `request` is one sequence and the events
it gets back, `text` the one detokenizer (tokens to text as they come, stop strings), and
`offline` decodes a batch of prompts to their ends for the clients that wait.
"""

from minigpt.decoding.engine import Engine
from minigpt.decoding.offline import Settings, decode_all
from minigpt.decoding.request import End, Event, Failed, PromptScores, Request, Tokens
from minigpt.decoding.sampler import GREEDY_BELOW, TOP, key_data, seed_key
from minigpt.decoding.text import TextStream

__all__ = ["GREEDY_BELOW", "TOP", "End", "Engine", "Event", "Failed",
           "PromptScores", "Request", "Settings", "TextStream", "Tokens", "decode_all",
           "key_data", "seed_key"]
