"""Continuous batching: a fixed set of decode slots that requests join and leave step by step.

One thread owns the device work. Requests arrive through a queue (`submit`); at every call the
engine first lets go of the slots whose requests finished or were cancelled, then prefills
waiting requests into free slots (together: compiled per count and length bucket), then runs
decode steps for all slots (one program, compiled once), whatever mix of requests they hold: as
many steps a call as fit in about TARGET_CALL_SECONDS, and no more than the nearest request
still needs, so that a model whose step takes milliseconds does not pay the host's work per
call at every step, and one whose step takes longer runs a step a call (while requests arrive
and slots are free, a call is one step, so that a burst of them joins together). A slot's rows of
the key/value cache are its own and attention never looks past a row's position, so a request's
tokens do not depend on what else runs beside it: greedy decoding gives the tokens
`minigpt.generate.generate_tokens` gives for the prompt alone.

The host reads a call's tokens while the device runs the next one (JAX dispatches
asynchronously and a step needs nothing from the host): each dispatched program is a record of
which request held which slot when it was dispatched, processed in order one call behind. What
comes out (tokens, log-probabilities, ends) goes to each request's `sink` in one `post` per
call, which the web app turns into one hand-over to its event loop.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.models import DecoderLM
from minigpt.serve.request import Request, post_directly
from minigpt.serve.steps import Programs, seed_key

# A call of decode steps aims at this long: the host's work per call (dispatching, reading the
# tokens, handing them to the web app) takes a millisecond or two on a CPU, which a model whose
# step takes 4 ms would otherwise pay at every step (the `stories-cpu` model served 16 clients
# at about half of `minigpt.generate`'s tokens/s one step a call, 2026-11-27); a new request or
# a hang-up waits at most about this long for the call to end, and a stream gets its tokens in
# bursts this far apart. A model whose step takes longer runs one a call.
TARGET_CALL_SECONDS = 0.1


class Engine:
    """Decode slots for a model, run by one thread (`start`, `stop`). `submit` and `cancel`
    are safe to call from any thread. `context` is entered by the engine's thread around all
    device work (the run's preset and mesh); `length` is each slot's number of positions
    (prompt and new tokens together, at most the model's context); `how` the layers run
    (`steps.HOWS`; None: `steps.default_how`)."""

    def __init__(self, model: DecoderLM, *, slots: int = 16, length: int | None = None,
                 context: Callable[[], Any] = contextlib.nullcontext,
                 log: Callable[[str], None] = print,
                 post: Callable[[list[tuple[Request, tuple]]], None] = post_directly,
                 smallest_bucket: int = 32, how: str | None = None):
        self.length = length or model.config.context_len
        self.model, self.slots, self.context = model, slots, context
        self.log, self.post = log, post
        self.programs = Programs(model, slots, self.length, smallest=smallest_bucket, how=how,
                                 context=context, log=log)
        self.owners: list[Request | None] = [None] * slots
        self.steps = self.tokens = 0
        # The last calls' time a step (what a call takes, over its steps): a call's host work
        # and a prefill run beside it only add to a step's time, so the fastest of these is
        # the step's own (none: not known yet).
        self._step_times: collections.deque[float] = collections.deque(maxlen=8)
        self._last_ready = 0.0
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
        before the next call."""
        for request in requests:
            request.cancelled = True
        self._inbox.put(None)  # wakes the engine if it waits for work

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=60)
        self.programs.close(wait=False)

    def health(self) -> dict[str, Any]:
        return {"slots": self.slots, "slots_in_use": sum(o is not None for o in self.owners),
                "queue_length": len(self._waiting) + self._inbox.qsize(),
                "max_len": self.length, "steps": self.steps, "tokens_generated": self.tokens,
                "step_ms": round(self.step_seconds * 1e3, 3),
                "compiled": ["decode step", *self.programs.compiled],
                "compiling": self.programs.compiling}

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
                        self.log("error: the engine failed a call; the requests it held are "
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
        """Compile the decode step and the smallest prefills, of one prompt and of a prompt
        for every slot (which serves any burst of short prompts while its own prefill
        compiles), before the first request."""
        began = time.perf_counter()
        self._cache, self._slots, drawn = self.programs.step(self._cache, self._slots,
                                                             np.zeros(self.slots, bool), 0)
        np.asarray(drawn[0])
        how = {"per layer": "each layer on weights of its own", "scanned": "layers scanned",
               "unrolled": "layers unrolled"}[self.programs.how]
        self.log(f"compiled the decode step ({how}) for {self.slots} slots of {self.length} "
                 f"positions in {time.perf_counter() - began:.1f} s; prefill compiles once per "
                 f"prompt count ({', '.join(map(str, self.programs.batches))}) and length "
                 f"({', '.join(map(str, self.programs.buckets))}), when first met (in the "
                 f"background while a larger one serves)")
        for count in sorted({1, self.slots}):
            self._prefill([(slot, Request([0], 0, sink=lambda event: None))
                           for slot in range(count)])
        self._step_times.clear()  # the warm-up's time is mostly compiling
        self._records.clear()
        self.owners = [None] * self.slots

    def _iteration(self) -> None:
        busy = self._records or self._waiting or any(o is not None for o in self.owners)
        self._receive(block=not busy)
        self._release_cancelled()
        filling = self._admit() and None in self.owners
        # Slots whose request has all its tokens asked for (or only scores its prompt) need
        # no more steps.
        active = np.asarray([o is not None and o.dispatched < o.max_new for o in self.owners])
        if active.any():
            running = [o for o, on in zip(self.owners, active) if on]
            # While requests are arriving and slots are free, a call is one step, so that the
            # rest of a burst joins within a step instead of a whole call.
            count = 1 if filling else self._steps_per_call()
            count = min(count, *(o.max_new - o.dispatched for o in running))
            self._cache, self._slots, drawn = self.programs.step(
                self._cache, self._slots, active, max(o.wants for o in running), count)
            for request in running:
                request.dispatched += count
            self._records.append(("step", drawn, list(self.owners), count,
                                  time.perf_counter()))
            self.steps += count
            self._collect(keep=1)  # the call just dispatched runs while the host reads
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

    def _admit(self) -> int:
        """Prefill waiting requests into free slots: those that score their prompt one by
        one (their log-probabilities take [P, vocabulary] floats each), the others together.
        Returns how many were admitted."""
        free = [slot for slot, owner in enumerate(self.owners) if owner is None]
        admitted = []
        while free and self._waiting:
            request = self._waiting.popleft()
            if not request.cancelled:
                admitted.append((free.pop(0), request))
        together = [(s, r) for s, r in admitted if not r.prompt_logprobs]
        groups = ([together] if together else []) + [
            [(s, r)] for s, r in admitted if r.prompt_logprobs]
        for group in groups:
            self._prefill(group)
        return len(admitted)

    def _prefill(self, group: list[tuple[int, Request]]) -> None:
        rows, requests = [s for s, _ in group], [r for _, r in group]
        self._cache, self._slots, drawn, prompt = self.programs.prefill(
            self._cache, self._slots, rows, [r.prompt for r in requests],
            temperature=[r.temperature for r in requests], top_p=[r.top_p for r in requests],
            keys=[seed_key(r.seed) for r in requests], want=max(r.wants for r in requests),
            prompt_logprobs=requests[0].prompt_logprobs)
        for slot, request in group:
            self.owners[slot] = request
            request.dispatched = min(1, request.max_new)  # the prefill draws the first token
        self._records.append(("prefill", drawn, prompt, group))

    def _collect(self, *, keep: int) -> None:
        """Read the results of all dispatched programs but the newest `keep`, in order."""
        while len(self._records) > keep:
            record = self._records.popleft()
            (self._read_step if record[0] == "step" else self._read_prefill)(*record[1:])

    def _read_prefill(self, drawn, prompt, group: list[tuple[int, Request]]) -> None:
        drawn = [np.asarray(a) for a in drawn]
        for j, (slot, request) in enumerate(group):
            if request.finished or request.cancelled:
                continue
            if prompt is not None:
                n, top = len(request.prompt), request.top
                given, ids, logprobs = (np.asarray(a)[j] for a in prompt)
                self._emit(request, ("prompt", given[:n - 1].tolist(),
                                     ids[:n, :top].tolist(), logprobs[:n, :top].tolist()))
            if request.max_new == 0:
                self._finish(request, slot, "length")
            else:
                self._take(request, slot, *(a[j:j + 1] for a in drawn))

    @property
    def step_seconds(self) -> float:
        """A decode step's time: the fastest of the last calls' (0.0: not known yet)."""
        return min(self._step_times, default=0.0)

    def _steps_per_call(self) -> int:
        """Decode steps for the next call: as many as fit in TARGET_CALL_SECONDS (at least 1,
        at most the program's `most`), from the steps measured so far."""
        if not self.step_seconds:
            return 1
        return max(1, min(self.programs.most, round(TARGET_CALL_SECONDS / self.step_seconds)))

    def _read_step(self, drawn, owners: list[Request | None], count: int,
                   dispatched: float) -> None:
        tokens = np.asarray(drawn[0])  # [most, S]: waits for the call
        ready = time.perf_counter()
        took = (ready - max(dispatched, self._last_ready)) / count
        self._step_times.append(took)
        self._last_ready = ready
        live = [(s, r) for s, r in enumerate(owners)
                if r is not None and not (r.finished or r.cancelled)]
        if not live:
            return
        logprobs = np.asarray(drawn[1])
        wanted = any(r.top for _, r in live)
        ids, top = (np.asarray(drawn[2]), np.asarray(drawn[3])) if wanted else (None, None)
        for slot, request in live:
            self._take(request, slot, tokens[:count, slot], logprobs[:count, slot],
                       None if ids is None else ids[:count, slot],
                       None if top is None else top[:count, slot])

    def _take(self, request: Request, slot: int, tokens, logprobs, ids, top) -> None:
        """A run of new tokens [n] for `request` (their log-probabilities [n] and
        alternatives [n, TOP]): one event for those it keeps, up to a stop token or its
        max_new, and its end if it ends."""
        tokens = tokens.tolist()
        keep = min(len(tokens), request.max_new - request.generated)
        stop = next((i for i, t in enumerate(tokens[:keep]) if t in request.stop_ids), None)
        end = "stop" if stop is not None else (
            "length" if request.generated + keep >= request.max_new else None)
        keep = keep if stop is None else stop
        if keep:
            k = request.top
            self._emit(request, ("tokens", tokens[:keep], logprobs[:keep].tolist(),
                                 ids[:keep, :k].tolist() if k else None,
                                 top[:keep, :k].tolist() if k else None))
            request.generated += keep
            self.tokens += keep
        if end:
            self._finish(request, slot, end)

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

