"""One sequence to decode, as the engine sees it, and the events it sends back.

A `Request` is what a client hands the engine (`Engine.submit`, or `Engine.run` for a client
that waits for its answers): the prompt's token ids, how many new tokens at most, how to draw
them, which ids stop it and what to report. The engine fills in how far it got and sends what
comes out to the request's `sink` as typed events, a batch of them per call through
`Engine.post` (directly, or handed over to a web app's event loop):

- `Tokens`: new ids, their log-probabilities and, when asked, their alternatives;
- `PromptScores`: the prompt's own log-probabilities (an echoed completion's);
- `End`: why it ended ("stop": a stop id, or a stop string its client found; "length");
- `Failed`: the engine could not decode it (the message says why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from minigpt.decoding.sampler import seed_key


@dataclasses.dataclass(frozen=True)
class Tokens:
    """New tokens [n], each with its log-probability, and (where a request asks for `top`)
    the likeliest alternatives at its place [n][top] and theirs."""

    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Each prompt token's log-probability given those before it [P - 1], and the likeliest
    tokens at each position [P][top] with theirs."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclasses.dataclass(frozen=True)
class End:
    reason: str  # "stop" | "length"


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


Event = Tokens | PromptScores | End | Failed


def _nobody(event: Event) -> None:
    """A request's sink until its client takes it over."""


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to decode: a prompt of token ids, at most `max_new` new tokens (0: score
    the prompt alone), how to draw them (temperature 0: greedy; top_k 0 and top_p 1: every
    token; min_p 0: none; `seed`, or the raw `key` of `sampler.key_data`), the ids it stops at
    (left out of its tokens), whether to report each token's log-probability (`logprobs`) and
    how many alternatives (`top`, at most `sampler.TOP`), and whether to report the prompt's
    own log-probabilities. With `slide` > 0 it may go past its slot's positions: when they
    fill, it goes on from its last `slide` tokens, prefilled afresh (a story longer than the
    context)."""

    prompt: list[int]
    max_new: int
    sink: Callable[[Event], None] = _nobody
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    key: np.ndarray | None = None
    stop_ids: frozenset[int] = frozenset()
    logprobs: bool = False
    top: int = 0
    prompt_logprobs: bool = False
    slide: int = 0
    # What the engine keeps track of.
    cancelled: bool = False
    finished: bool = False
    generated: int = 0  # tokens sent to the sink
    dispatched: int = 0  # tokens the device was asked for so far (it runs a call ahead)
    window: list[int] = dataclasses.field(default_factory=list)  # what its slot was filled with
    in_window: int = 0  # tokens received since
    history: list[int] = dataclasses.field(default_factory=list)  # with `slide`: all it drew
    epoch: int = 0  # windows started: results of calls from before the latest are dropped
    stopped_at: int | None = None  # the stop id that ended it

    def __post_init__(self):
        if self.key is None:
            self.key = seed_key(self.seed)
        self.prompt = list(self.prompt)
        self.window = list(self.prompt)

    def accept(self, tokens: list[int], length: int) -> tuple[int, str | None]:
        """How many of a run of new tokens it keeps, and how it ends: up to a stop id
        ("stop", the id left out), its max_new ("length") or its slot's `length` positions
        ("full": it goes on in a new window where it may `slide`, else "length")."""
        room = length - len(self.window) - self.in_window
        keep = min(len(tokens), self.max_new - self.generated, room)
        stop = next((i for i, t in enumerate(tokens[:keep]) if t in self.stop_ids), None)
        end = "stop" if stop is not None else (
            "length" if self.generated + keep >= self.max_new else None)
        if end is None and keep == room:
            end = "full" if self.slide else "length"
        if stop is not None:
            self.stopped_at = tokens[stop]
        keep = keep if stop is None else stop
        self.history += tokens[:keep] if self.slide else []
        self.generated += keep
        self.in_window += keep
        return keep, end

    def next_window(self) -> None:
        """Its slot's positions are full: it goes on from its last `slide` tokens, prefilled
        afresh (its draws go on numbered as they were)."""
        self.window = (self.prompt + self.history)[-self.slide:]
        self.in_window, self.epoch = 0, self.epoch + 1
        self.dispatched = self.generated

    @property
    def wants(self) -> int:
        """What the request asks to know of its tokens, as `sampler.choose` takes it."""
        return 2 if self.top else int(self.logprobs)
