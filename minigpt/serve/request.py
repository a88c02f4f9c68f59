"""One sequence to decode, as the engine sees it, and how its events reach it.

A `Request` is what the web app hands the engine (`Engine.submit`): the prompt's token ids, how
many new tokens at most, how to draw them, where to stop and what to report. The engine fills
in how far it got (`dispatched`, `generated`, `finished`) and sends what comes out to the
request's `sink` as events, a batch of them per call through `Engine.post`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to decode: a prompt of token ids, at most `max_new` new tokens (0: score
    the prompt alone), sampling settings (temperature 0: greedy), the token ids it stops at
    (left out of the output), whether to report each token's log-probability (`logprobs`) and
    how many alternatives (`top`, at most `draw.TOP`), and whether to report the prompt's own
    log-probabilities. `sink` receives its events, on whichever thread `Engine.post` calls
    it:

        ("prompt", logprobs [P - 1], top ids [P][top], top logprobs [P][top])
        ("tokens", ids [n], logprobs [n], top ids [n][top] or None, top logprobs [n][top])
        ("end", "stop" | "length")
        ("error", message)
    """

    prompt: list[int]
    max_new: int
    sink: Callable[[tuple], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    logprobs: bool = False
    top: int = 0
    prompt_logprobs: bool = False
    cancelled: bool = False
    finished: bool = False
    generated: int = 0
    dispatched: int = 0  # tokens the device was asked for so far (it runs a call ahead)

    @property
    def wants(self) -> int:
        """What the request asks to know of its tokens, as `draw.choose` takes it."""
        return 2 if self.top else int(self.logprobs)


def post_directly(events: list[tuple[Request, tuple]]) -> None:
    """Hand each event to its request's sink on the calling thread (the engine's)."""
    for request, event in events:
        request.sink(event)
