"""One API call on the engine: its choices (one per prompt and sample), the events that build
them, and what it owes the engine when it ends.

A `Choice` is one engine request seen from the web app: the text so far (through
`text.TextStream`, which cuts stop strings), the log-probabilities to report, why it finished,
and what is new since the last chunk was sent (`take`). A `Call` submits its choices' requests
and gives back, batch by batch, the choices that changed, as the engine's events arrive on the
event loop. However a call ends (done, a stop string met, the client gone, an error), it
cancels what is still running, so a slot is never held for nobody.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable

from minigpt.decoding import End, Engine, Event, PromptScores, Request, TextStream, Tokens
from minigpt.decoding.text import token_text


@dataclasses.dataclass
class Entry:
    """One token's log-probability record: its text, id, log-probability (None for a prompt's
    first token), the alternatives [(text, id, logprob)] and where its text starts."""

    text: str
    id: int
    logprob: float | None
    top: list[tuple[str, int, float]] | None
    offset: int


class Choice:
    """One sequence of a call: `index` in the response, its engine `request`, its text so far
    (`prefix` first: an echoed prompt), its log-probability entries when asked for."""

    def __init__(self, index: int, request: Request, stream: TextStream, tokenizer, *,
                 prefix: str = "", logprobs: bool = False):
        self.index, self.request, self.stream, self.tokenizer = index, request, stream, tokenizer
        self.prefix, self.logprobs = prefix, logprobs
        self.text, self.entries = "", []
        self.sent_text, self.sent_entries = 0, 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.prompt_entries: list[Entry] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def tokens(self) -> int:
        return self.request.generated

    def apply(self, event: Event) -> None:
        if self.done:
            return
        if isinstance(event, PromptScores):
            self._prompt(event)
        elif isinstance(event, Tokens):
            self._tokens(event)
        elif isinstance(event, End):
            self.text += self.stream.finish()
            self.finish_reason = "stop" if self.stream.stopped else event.reason
        else:
            self.error = event.message

    def _tokens(self, event: Tokens) -> None:
        if self.logprobs:  # token by token: each entry says where its text starts
            for i, token in enumerate(event.ids):
                self.entries.append(Entry(
                    token_text(self.tokenizer, token), token, event.logprobs[i],
                    self._alternatives(event.top_ids[i], event.top_logprobs[i])
                    if event.top_ids else [], len(self.prefix) + len(self.stream.text)))
                self.text += self.stream.add([token])
                if self.stream.stopped:
                    break
        else:
            self.text += self.stream.add(event.ids)
        if self.stream.stopped:
            self.finish_reason = "stop"

    def _alternatives(self, ids, logprobs) -> list[tuple[str, int, float]]:
        return [(token_text(self.tokenizer, i), i, lp) for i, lp in zip(ids, logprobs)]

    def _prompt(self, event: PromptScores) -> None:
        """The echoed prompt's entries: token i's log-probability given the ones before it,
        with the alternatives at its place; the first has none."""
        offset, prompt = 0, self.request.prompt
        for i, token in enumerate(prompt):
            text = token_text(self.tokenizer, token)
            self.prompt_entries.append(Entry(
                text, token, None if i == 0 else event.logprobs[i - 1],
                None if i == 0 else self._alternatives(event.top_ids[i - 1],
                                                       event.top_logprobs[i - 1]), offset))
            offset += len(text)
        self.entries[:0] = self.prompt_entries

    def take(self) -> tuple[str, list[Entry]]:
        """The text and entries not yet sent, marked sent."""
        text, entries = self.text[self.sent_text:], self.entries[self.sent_entries:]
        self.sent_text, self.sent_entries = len(self.text), len(self.entries)
        return text, entries


class Call:
    """The choices of one API call, run on `engine`. Iterate `updates()` once: it submits the
    requests and yields the choices each batch of events changed, until all are done."""

    def __init__(self, engine: Engine, choices: list[Choice]):
        self.engine, self.choices = engine, choices
        self.queue: asyncio.Queue = asyncio.Queue()
        for choice in choices:
            choice.request.sink = functools.partial(self._arrive, choice)

    def _arrive(self, choice: Choice, event: Event) -> None:
        self.queue.put_nowait((choice, event))

    async def updates(self, gone: Callable[[], Awaitable[bool]] | None = None
                      ) -> AsyncIterator[list[Choice]]:
        """Batches of changed choices. `gone`, where given, is asked every half second while
        nothing arrives whether the client left (a call that does not stream has no other way
        to learn it); if so, the call ends."""
        self.engine.submit(*(c.request for c in self.choices))
        try:
            while not all(c.done for c in self.choices):
                batch = [await self._next(gone)]
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                changed = {}
                for choice, event in batch:
                    choice.apply(event)
                    changed[choice.index] = choice
                    if choice.done and not choice.request.finished:  # a stop string: let go now
                        self.engine.cancel(choice.request)
                yield list(changed.values())
        finally:
            running = [c.request for c in self.choices if not c.request.finished]
            if running:
                self.engine.cancel(*running)

    async def _next(self, gone):
        if gone is None:
            return await self.queue.get()
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except TimeoutError:
                if await gone():
                    raise asyncio.CancelledError from None

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)
