"""Prompts decoded to their ends by the engine, for the clients that wait for the answers:
`minigpt.generate`, evaluation's generations and post-training's rollouts.

`decode_all` makes an engine for the model (its slots: the batch, its positions: the longest
prompt and its new tokens, rounded up to a multiple of 16 so that calls of similar sizes share
programs, or the context where a story goes past it), submits one request per prompt and
runs it on the calling thread. The compiled programs are kept for the process
(`minigpt.decoding.programs`), so a second call of the same shapes compiles nothing. A request
may stream its tokens (`on_tokens`) and its text (`streams`: one `TextStream` each, whose stop
strings end it at the token that completes one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from minigpt.decoding.engine import Engine
from minigpt.decoding.request import End, Event, Request, Tokens
from minigpt.decoding.sampler import seed_key
from minigpt.decoding.text import TextStream
from minigpt.models import DecoderLM

SMALLEST = 32  # the shortest prompt bucket the engine prefills
LENGTH_STEP = 16  # slots' lengths are multiples of this


@dataclasses.dataclass(frozen=True)
class Settings:
    """How one request draws: temperature (0: greedy), top_k (0: all), top_p (1: all), min_p
    (0: none) and its key (threefry's two words; `sampler.key_data` of a JAX key)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    key: tuple[int, int] = (0, 0)

    @staticmethod
    def seeded(seed: int, **settings) -> Settings:
        return Settings(key=tuple(int(w) for w in seed_key(seed)), **settings)


def slot_length(longest: int, max_new: int, context: int) -> int:
    """A slot's positions for prompts of at most `longest` tokens and `max_new` more, a
    multiple of 16 at most the context: every decode step attends over all of them, so they
    are close to what is needed (stories-cpu's 128 new tokens ran at 0.85x in 256 positions
    against 160), and calls of similar sizes share programs."""
    return min(context, -(-(longest + max_new) // LENGTH_STEP) * LENGTH_STEP)


def _through_stop(stream: TextStream, ids: list[int]) -> list[int]:
    """The ids of a run up to the one after which `stream` found a stop string (all of them
    where it found none), fed to it one by one."""
    for n, token in enumerate(ids, 1):
        stream.add([token])
        if stream.stopped:
            return ids[:n]
    return ids


def decode_all(model: DecoderLM, prompts: Sequence[Sequence[int]], *, max_new: int,
               settings: Settings | Sequence[Settings] = Settings(),
               stop_ids: Sequence[int] = (), slots: int | None = None, slide: int = 0,
               streams: Sequence[TextStream] | None = None,
               on_tokens: Callable[[int, list[int]], None] | None = None,
               on_done: Callable[[int], None] | None = None,
               keep_stop: bool = False) -> list[list[int]]:
    """Each prompt's new tokens (the stop id left out; through the token that completes a stop
    string, where its stream has some), decoded by one engine: at most `max_new`, stopping at
    `stop_ids`, every prompt with its own `settings` (one record for all, or one each).
    `slots`: rows decoded at once (default: one per prompt); `slide` > 0 lets a request go
    past the context from its last `slide` tokens (`Request.slide`), else every prompt and
    its new tokens must fit in the context. `on_tokens(i, ids)` sees prompt i's tokens as
    they come, `on_done(i)` its end. With `keep_stop`, a run that ended at a stop id keeps it
    (a rollout's completion counts its end token)."""
    if not prompts:
        return []
    context = model.config.context_len
    every = [settings] * len(prompts) if isinstance(settings, Settings) else list(settings)
    longest = max(len(p) for p in prompts)
    if longest + max_new <= context:
        length = slot_length(longest, max_new, context)
    elif slide:
        length = context
    else:
        raise ValueError(f"prompts of up to {longest} tokens and {max_new} new ones do not "
                         f"fit in the context of {context}")
    results: list[list[int]] = [[] for _ in prompts]
    engine = Engine(model, slots=slots or len(prompts), length=length, log=lambda line: None,
                    smallest_bucket=min(SMALLEST, length))

    def sink(i: int, event: Event, request: Request) -> None:
        if not isinstance(event, Tokens):  # its end (run on this thread: no Failed events)
            if keep_stop and isinstance(event, End) and request.stopped_at is not None:
                results[i].append(request.stopped_at)
            if on_done is not None and not request.cancelled:
                on_done(i)
            return
        ids = event.ids if streams is None else _through_stop(streams[i], event.ids)
        results[i] += ids
        if on_tokens is not None and ids:
            on_tokens(i, ids)
        if streams is not None and streams[i].stopped:
            engine.cancel(request)
            if on_done is not None:
                on_done(i)

    requests = []
    for i, (prompt, s) in enumerate(zip(prompts, every)):
        request = Request(list(prompt), max_new, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, min_p=s.min_p, key=np.asarray(s.key, np.uint32),
                          stop_ids=frozenset(stop_ids), slide=slide)
        request.sink = lambda event, i=i, request=request: sink(i, event, request)
        requests.append(request)
    engine.run(requests)
    return results
