"""Continuous batching: a fixed set of decode slots that requests join and leave step by step.

One thread owns the device work. Requests arrive through a queue (`submit`); at every step the
engine first lets go of the slots whose requests finished or were cancelled, then prefills
waiting requests into free slots (each one prompt, compiled per length bucket), then runs one
decode step for all slots (compiled once), whatever mix of requests they hold. A slot's rows of
the key/value cache are its own and attention never looks past a row's position, so a request's
tokens do not depend on what else runs beside it: greedy decoding gives the tokens
`minigpt.generate.generate_tokens` gives for the prompt alone.

The host reads a step's tokens while the device runs the next one (JAX dispatches
asynchronously and a step needs nothing from the host): each dispatched program is a record of
which request held which slot when it was dispatched, processed in order one step behind. What
comes out (tokens, log-probabilities, ends) goes to each request's `sink` in one `post` per
step, which the web app turns into one hand-over to its event loop.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.models import DecoderLM
from minigpt.serve.steps import Programs, seed_key


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to decode: a prompt of token ids, at most `max_new` new tokens (0: score
    the prompt alone), sampling settings (temperature 0: greedy), the token ids it stops at
    (left out of the output), whether to report each token's log-probability (`logprobs`) and
    how many alternatives (`top`, at most `draw.TOP`), and whether to report the prompt's own
    log-probabilities. `sink` receives its events, on
    whichever thread `Engine.post` calls it:

        ("prompt", logprobs [P - 1], top ids [P][top], top logprobs [P][top])
        ("token", id, logprob, top ids [top], top logprobs [top])
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

    @property
    def wants(self) -> int:
        """What the request asks to know of its tokens, as `draw.choose` takes it."""
        return 2 if self.top else int(self.logprobs)


def _post_directly(events: list[tuple[Request, tuple]]) -> None:
    for request, event in events:
        request.sink(event)


class Engine:
    """Decode slots for a model, run by one thread (`start`, `stop`). `submit` and `cancel`
    are safe to call from any thread. `context` is entered by the engine's thread around all
    device work (the run's preset and mesh); `length` is each slot's number of positions
    (prompt and new tokens together, at most the model's context)."""

    def __init__(self, model: DecoderLM, *, slots: int = 16, length: int | None = None,
                 context: Callable[[], Any] = contextlib.nullcontext,
                 log: Callable[[str], None] = print,
                 post: Callable[[list[tuple[Request, tuple]]], None] = _post_directly,
                 smallest_bucket: int = 32):
        self.length = length or model.config.context_len
        self.model, self.slots, self.context = model, slots, context
        self.log, self.post = log, post
        self.programs = Programs(model, slots, self.length, smallest=smallest_bucket)
        self.owners: list[Request | None] = [None] * slots
        self.steps = self.tokens = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._records: collections.deque = collections.deque()
        self._outbox: list[tuple[Request, tuple]] = []
        self._ready, self._stopping = threading.Event(), False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="minigpt-serve-engine",
                                        daemon=True)

    # --- the web app's side --------------------------------------------------------------

    def start(self) -> None:
        """Start the engine's thread and wait until its programs are compiled."""
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def submit(self, *requests: Request) -> None:
        for request in requests:
            self._inbox.put(request)

    def cancel(self, *requests: Request) -> None:
        """Give up requests (a client went away, a stop string was met): each leaves its slot
        before the next step."""
        for request in requests:
            request.cancelled = True
        self._inbox.put(None)  # wakes the engine if it waits for work

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=60)

    def health(self) -> dict[str, Any]:
        return {"slots": self.slots, "slots_in_use": sum(o is not None for o in self.owners),
                "queue_length": len(self._waiting) + self._inbox.qsize(),
                "max_len": self.length, "steps": self.steps, "tokens_generated": self.tokens,
                "compiled": ["decode step", *self.programs.compiled]}

    # --- the engine's thread --------------------------------------------------------------

    def _main(self) -> None:
        try:
            with self.context():
                self._fresh_state()
                self._warm_up()
                self._ready.set()
                while not self._stopping:
                    try:
                        self._iteration()
                    except Exception as error:  # a bug or the device's failure: stay up
                        self.log("error: the engine failed a step; the requests it held are "
                                 "ended with an error:\n" + traceback.format_exc())
                        self._fail(f"the server failed decoding this request ({error})")
                        self._fresh_state()
                self._fail("the server is shutting down", waiting=True)
        except BaseException as error:
            self._failure = error
            self._ready.set()

    def _fresh_state(self) -> None:
        self._cache, self._slots = self.programs.empty()
        self.owners = [None] * self.slots
        self._records.clear()

    def _warm_up(self) -> None:
        """Compile the decode step and the smallest prefill before the first request."""
        began = time.perf_counter()
        self._cache, self._slots, drawn = self.programs.step(self._cache, self._slots,
                                                             np.zeros(self.slots, bool), 0)
        np.asarray(drawn[0])
        self.log(f"compiled the decode step for {self.slots} slots of {self.length} positions "
                 f"in {time.perf_counter() - began:.1f} s; prefill compiles once per prompt "
                 f"length bucket ({', '.join(map(str, self.programs.buckets))}), when first met")
        self._prefill(0, Request([0], 0, sink=lambda event: None), quiet=True)
        self._records.clear()
        self.owners[0] = None

    def _iteration(self) -> None:
        busy = self._records or self._waiting or any(o is not None for o in self.owners)
        self._receive(block=not busy)
        self._release_cancelled()
        self._admit()
        # A request that only scores its prompt (max_new 0) needs no step.
        active = np.asarray([o is not None and o.max_new > 0 for o in self.owners])
        if active.any():
            want = max(o.wants for o, on in zip(self.owners, active) if on)
            self._cache, self._slots, drawn = self.programs.step(self._cache, self._slots,
                                                                 active, want)
            self._records.append(("step", drawn, list(self.owners)))
            self.steps += 1
            self._collect(keep=1)  # the step just dispatched runs while the host reads
        else:
            self._collect(keep=0)
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.post(events)

    def _receive(self, *, block: bool) -> None:
        items = [self._inbox.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._inbox.get_nowait())
        self._waiting.extend(r for r in items if r is not None)

    def _release_cancelled(self) -> None:
        for slot, owner in enumerate(self.owners):
            if owner is not None and owner.cancelled:
                owner.finished, self.owners[slot] = True, None

    def _admit(self) -> None:
        for slot in range(self.slots):
            while self._waiting and self._waiting[0].cancelled:
                self._waiting.popleft()
            if not self._waiting:
                return
            if self.owners[slot] is None:
                self._prefill(slot, self._waiting.popleft())

    def _prefill(self, slot: int, request: Request, *, quiet: bool = False) -> None:
        known, began = len(self.programs.compiled), time.perf_counter()
        self._cache, self._slots, drawn, prompt = self.programs.prefill(
            self._cache, self._slots, slot, request.prompt, temperature=request.temperature,
            top_p=request.top_p, key=seed_key(request.seed), want=request.wants,
            prompt_logprobs=request.prompt_logprobs)
        self.owners[slot] = request
        self._records.append(("prefill", (drawn, prompt), slot, request))
        if len(self.programs.compiled) > known and not quiet:
            self.log(f"compiled {self.programs.compiled[-1]} in "
                     f"{time.perf_counter() - began:.1f} s ({len(self.programs.compiled)} "
                     f"prefill programs so far, at most {2 * len(self.programs.buckets)})")

    def _collect(self, *, keep: int) -> None:
        """Read the results of all dispatched programs but the newest `keep`, in order."""
        while len(self._records) > keep:
            record = self._records.popleft()
            if record[0] == "step":
                self._read_step(record[1], record[2])
            else:
                self._read_prefill(*record[1], record[2], record[3])

    def _read_prefill(self, drawn, prompt, slot: int, request: Request) -> None:
        if request.finished or request.cancelled:
            return
        if prompt is not None:
            n, top = len(request.prompt), request.top
            given, ids, logprobs = (np.asarray(a) for a in prompt)
            self._emit(request, ("prompt", given[:n - 1].tolist(), ids[:n, :top].tolist(),
                                 logprobs[:n, :top].tolist()))
        if request.max_new == 0:
            self._finish(request, slot, "length")
        else:
            self._take(request, slot, *(np.asarray(a)[0] for a in drawn))

    def _read_step(self, drawn, owners: list[Request | None]) -> None:
        live = [(s, r) for s, r in enumerate(owners)
                if r is not None and not (r.finished or r.cancelled)]
        if not live:
            return
        tokens, logprobs = np.asarray(drawn[0]), np.asarray(drawn[1])
        wanted = any(r.top for _, r in live)
        ids, top = (np.asarray(drawn[2]), np.asarray(drawn[3])) if wanted else (None, None)
        for slot, request in live:
            self._take(request, slot, tokens[slot], logprobs[slot],
                       None if ids is None else ids[slot], None if top is None else top[slot])

    def _take(self, request: Request, slot: int, token, logprob, ids, top) -> None:
        token = int(token)
        if token in request.stop_ids:
            self._finish(request, slot, "stop")
            return
        k = request.top
        self._emit(request, ("token", token, float(logprob),
                             ids[:k].tolist() if k else [], top[:k].tolist() if k else []))
        request.generated += 1
        self.tokens += 1
        if request.generated >= request.max_new:
            self._finish(request, slot, "length")

    def _finish(self, request: Request, slot: int, reason: str) -> None:
        request.finished = True
        if self.owners[slot] is request:
            self.owners[slot] = None
        self._emit(request, ("end", reason))

    def _emit(self, request: Request, event: tuple) -> None:
        self._outbox.append((request, event))

    def _fail(self, message: str, *, waiting: bool = False) -> None:
        """End the requests in the slots (and, with `waiting`, those waiting) with an error;
        requests that wait are otherwise served once the slots are fresh."""
        failed = [r for r in self.owners if r is not None]
        if waiting:
            self._receive(block=False)
            failed += list(self._waiting)
            self._waiting.clear()
        for request in dict.fromkeys(failed):
            if not request.finished:
                request.finished = True
                self._emit(request, ("error", message))
        self.owners = [None] * self.slots
        if self._outbox:
            events, self._outbox = self._outbox, []
            self.post(events)

