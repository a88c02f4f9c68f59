"""The decoding engine: a fixed set of slots that requests join and leave call by call.

Every door decodes here: `minigpt.generate` (a batch of prompts, `run` on the caller's thread),
`minigpt.serve` (requests arriving all the time, on a thread of the engine's own: `start`,
`submit`, `cancel`, `stop`), `minigpt.eval` (the harness's generations) and post-training's
rollouts. At every call the engine lets go of the slots whose requests finished or were
cancelled, prefills waiting requests into free slots (together: one program per prompt count
and length bucket), then runs decode steps for the slots in use with the program of the
smallest row count that holds them (1, 4, 16, ... up to the slots): as many steps a call as fit
in `call_seconds` (a server's stream gets its tokens that often) or `most` (a caller that waits
for the end). A request that reaches its limit or a stop id during a call stops there on the
device while the others go on; the call ends early once all have stopped. While requests arrive
and slots are free, a call is one step, so that a burst joins together.

The host reads a call's tokens while the device runs the next one (JAX dispatches
asynchronously and a step needs nothing from the host): each dispatched program is a record of
which request held which slot, processed in order one call behind. What comes out goes to each
request's `sink` as typed events (`minigpt.decoding.request`), in one `post` per call. Which
program serves a call, and what compiles when, is `minigpt.decoding.compiled`'s.
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

from minigpt import sharding
from minigpt.decoding.compiled import Programs
from minigpt.decoding.request import End, Event, Failed, PromptScores, Request, Tokens
from minigpt.models import DecoderLM

# A server's call of decode steps aims at this long: the host's work per call (dispatching,
# reading the tokens, handing them to the web app) takes a millisecond or two on a CPU, which a
# model whose step takes 4 ms would otherwise pay at every step; a new request or a hang-up
# waits at most about this long for the call to end.
TARGET_CALL_SECONDS = 0.1


def post_directly(events: list[tuple[Request, Event]]) -> None:
    """Hand each event to its request's sink on the calling thread (the engine's)."""
    for request, event in events:
        request.sink(event)


@dataclasses.dataclass
class _Dispatched:
    """A program on its way: its outputs, which request held each of its rows (with the
    request's window then) and what it was asked."""

    kind: str  # "decode" | "prefill"
    drawn: tuple
    held: list[tuple[int, Request, int]]  # (column of the outputs, request, its epoch)
    steps: Any = None  # decode: the steps it ran (a device scalar)
    asked: int = 0  # decode: the steps it was asked for
    rows: int = 0  # decode: its row count
    prompt: tuple | None = None  # prefill: the prompts' own log-probabilities
    began: float = 0.0


class Engine:
    """Decode slots for a model. `context` is entered around all device work (a run's layout:
    its mesh and rules; by default the caller's context as it is); `length` is each slot's
    number of positions (prompt and new tokens together, at most the model's context); `how`
    the layers run (`programs.HOWS`; None: `programs.default_how`)."""

    def __init__(self, model: DecoderLM, *, slots: int = 16, length: int | None = None,
                 context: Callable[[], Any] = lambda: sharding.running(),
                 log: Callable[[str], None] = print,
                 post: Callable[[list[tuple[Request, Event]]], None] = post_directly,
                 smallest_bucket: int = 32, how: str | None = None, most: int = 64,
                 call_seconds: float | None = None, background: bool = False):
        self.length = length or model.config.context_len
        self.model, self.slots, self.context = model, slots, context
        self.log, self.post, self.call_seconds = log, post, call_seconds
        self.programs = Programs(model, slots, self.length, smallest=smallest_bucket, how=how,
                                 most=most, context=context, log=log, background=background)
        self.owners: list[Request | None] = [None] * slots
        self.steps = self.tokens = 0
        # Each row count's last calls' time a step: a call's host work and a prefill beside it
        # only add to a step's, so the fastest of these is the step's own.
        self._step_times: dict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=8))
        self._last_ready = 0.0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._records: collections.deque[_Dispatched] = collections.deque()
        self._outbox: list[tuple[Request, Event]] = []
        self._cache = self._slots = None
        self._ready, self._stopping = threading.Event(), False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- a caller that waits for its answers ----------------------------------------------

    def run(self, requests: list[Request]) -> None:
        """Decode `requests` to their ends on the calling thread (their sinks receive the
        events as they come): what `minigpt.generate` and evaluation do."""
        with self.context():
            if self._cache is None:
                self._fresh_state()
            self.submit(*requests)
            while not all(r.finished for r in requests):
                self._iteration()
            self._collect(keep=0)
            self._flush()

    # --- a server: the engine's own thread --------------------------------------------------

    def start(self) -> None:
        """Start the engine's thread and wait until its first programs are compiled."""
        self._thread = threading.Thread(target=self._main, name="minigpt-decoding-engine",
                                        daemon=True)
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
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.programs.close()

    def health(self) -> dict[str, Any]:
        return {"slots": self.slots, "slots_in_use": sum(o is not None for o in self.owners),
                "queue_length": len(self._waiting) + self._inbox.qsize(),
                "max_len": self.length, "steps": self.steps, "tokens_generated": self.tokens,
                "step_ms": {str(b): round(self.step_seconds(b) * 1e3, 3)
                            for b in self.programs.rows if self.step_seconds(b)},
                "compiled": self.programs.compiled, "compiling": self.programs.compiling}

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

    def _warm_up(self) -> None:
        """Compile, before the first request, the decode programs of one row and of every
        slot for requests that need no log-probabilities, and the smallest prefills of one
        prompt and of a prompt for every slot (which serve any burst of short prompts while
        their own compile); in the background, those of the other row counts and the one that
        holds every request. Greedy-only ones compile in the background when first met."""
        began, programs = time.perf_counter(), self.programs
        for b in sorted({1, self.slots}):
            programs.compile(("decode", b, True, 0), self._decode_args(b, list(range(b)), 1))
        for n in sorted({1, self.slots}):
            group = [(slot, Request([0], 1)) for slot in range(n)]
            name = ("prefill", next(c for c in programs.rows if c >= n), programs.lengths[0],
                    False)
            programs.compile(name, self._prefill_args(name, group))
        how = {"per layer": "each layer on weights of its own", "scanned": "layers scanned",
               "unrolled": "layers unrolled"}[programs.how]
        self.log(f"compiled the first programs ({how}) for {self.slots} slots of {self.length} "
                 f"positions in {time.perf_counter() - began:.1f} s; decode compiles for "
                 f"{', '.join(map(str, programs.rows))} rows, prefill once per prompt count and "
                 f"length ({', '.join(map(str, programs.lengths))}), in the background while a "
                 f"larger one serves")
        for name in [*(("decode", b, True, 0) for b in programs.rows),
                     ("decode", self.slots, True, 2)]:
            programs.in_background(name, self._decode_args(name[1], list(range(name[1])), 1))

    # --- one call --------------------------------------------------------------------------

    def _fresh_state(self) -> None:
        self._cache, self._slots = self.programs.empty()
        self.owners = [None] * self.slots
        self._records.clear()

    def _iteration(self) -> None:
        busy = self._records or self._waiting or any(o is not None for o in self.owners)
        self._receive(block=not busy)
        self._release_cancelled()
        filling = self._admit() and None in self.owners
        running = [(slot, o) for slot, o in enumerate(self.owners)
                   if o is not None and o.dispatched < o.max_new]
        if running:
            name = self.programs.decode_for(
                len(running), any(o.temperature > 0 for _, o in running),
                max(o.wants for _, o in running),
                lambda b: self._decode_args(b, list(range(b)), 1))
            # While requests are arriving and slots are free, a call is one step, so that the
            # rest of a burst joins within a step instead of a whole call.
            count = 1 if filling else self._steps_per_call(name[1])
            rows = [slot for slot, _ in running]
            self._cache, self._slots, drawn, steps = self.programs.run(
                name, self._decode_args(name[1], rows, count))
            whole = name[1] == self.slots
            held = [(slot if whole else j, o, o.epoch) for j, (slot, o) in enumerate(running)]
            for _, request in running:
                request.dispatched = min(request.max_new, request.dispatched + count)
            self._records.append(_Dispatched("decode", drawn, held, steps=steps, asked=count,
                                             rows=name[1], began=time.perf_counter()))
            self._collect(keep=1)  # the call just dispatched runs while the host reads
        else:
            self._collect(keep=0)
        self._flush()

    def _flush(self) -> None:
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
            if request.cancelled:
                request.finished = True
            else:
                admitted.append((free.pop(0), request))
        scoring = [(s, r) for s, r in admitted if r.prompt_logprobs and r.epoch == 0]
        together = [(s, r) for s, r in admitted if (s, r) not in scoring]
        for group in ([together] if together else []) + [[one] for one in scoring]:
            self._prefill(group)
        return len(admitted)

    def _prefill(self, group: list[tuple[int, Request]]) -> None:
        requests = [r for _, r in group]
        name = self.programs.prefill_for(
            len(group), max(len(r.window) for r in requests),
            any(r.prompt_logprobs and r.epoch == 0 for r in requests),
            lambda name: self._prefill_args(name, group))
        self._cache, self._slots, drawn, prompt = self.programs.run(
            name, self._prefill_args(name, group))
        for slot, request in group:
            self.owners[slot] = request
            request.dispatched = min(request.max_new, request.generated + 1)
        self._records.append(_Dispatched("prefill", drawn, [
            (j, r, r.epoch) for j, (_, r) in enumerate(group)], prompt=prompt))

    def _decode_args(self, b: int, rows: list[int], count: int):
        return self.programs.decode_args(self._cache, self._slots, rows, b, count)

    def _prefill_args(self, name: tuple, group: list[tuple[int, Request]]):
        requests = [r for _, r in group]
        return self.programs.prefill_args(
            self._cache, self._slots, [s for s, _ in group], [r.window for r in requests],
            name[1], name[2], [r.generated for r in requests],
            [r.max_new - r.generated for r in requests], [tuple(r.stop_ids) for r in requests],
            requests, max(r.wants for r in requests))

    def step_seconds(self, rows: int) -> float:
        """A decode step's time for a program of `rows` rows: the fastest of its last calls'
        (0.0: not known yet)."""
        return min(self._step_times.get(rows, ()), default=0.0)

    def _steps_per_call(self, rows: int) -> int:
        """Decode steps for the next call: `most`, or with `call_seconds`, as many as fit in
        it (at least 1, at most `most`) from the steps measured so far."""
        most = self.programs.most
        if self.call_seconds is None:
            return most
        step = self.step_seconds(rows)
        if not step:
            return 1
        return max(1, min(most, round(self.call_seconds / step)))

    # --- reading what came back ------------------------------------------------------------

    def _collect(self, *, keep: int) -> None:
        """Read the results of all dispatched programs but the newest `keep`, in order."""
        while len(self._records) > keep:
            record = self._records.popleft()
            (self._read_decode if record.kind == "decode" else self._read_prefill)(record)

    def _live(self, record: _Dispatched):
        return [(column, r) for column, r, epoch in record.held
                if not (r.finished or r.cancelled) and r.epoch == epoch]

    def _read_prefill(self, record: _Dispatched) -> None:
        drawn = [np.asarray(a) for a in record.drawn]
        for column, request in self._live(record):
            if record.prompt is not None and request.prompt_logprobs:
                n, top = len(request.prompt), request.top
                given, ids, logprobs = (np.asarray(a)[column] for a in record.prompt)
                self._emit(request, PromptScores(given[:n - 1].tolist(), ids[:n, :top].tolist(),
                                                 logprobs[:n, :top].tolist()))
            if request.max_new == 0:
                self._finish(request, "length")
            else:
                self._take(request, *(a[column:column + 1] for a in drawn))

    def _read_decode(self, record: _Dispatched) -> None:
        tokens = np.asarray(record.drawn[0])  # [most, b]: waits for the call
        steps = int(record.steps)
        ready = time.perf_counter()
        took = (ready - max(record.began, self._last_ready)) / max(steps, 1)
        self._step_times[record.rows].append(took)
        self._last_ready = ready
        self.steps += steps
        live = self._live(record)
        if not live:
            return
        logprobs = np.asarray(record.drawn[1])
        wanted = any(r.top for _, r in live)
        ids, top = ((np.asarray(record.drawn[2]), np.asarray(record.drawn[3])) if wanted
                    else (None, None))
        for column, request in live:
            self._take(request, tokens[:steps, column], logprobs[:steps, column],
                       None if ids is None else ids[:steps, column],
                       None if top is None else top[:steps, column])

    def _take(self, request: Request, tokens, logprobs, ids, top) -> None:
        """A run of new tokens [n] for `request` (their log-probabilities [n] and
        alternatives [n, TOP]): one event for those it keeps and its end if it ends; where its
        slot's positions are full, its next window waits before anything else."""
        tokens = tokens.tolist()
        keep, end = request.accept(tokens, self.length)
        if keep:
            k = request.top
            self._emit(request, Tokens(tokens[:keep], logprobs[:keep].tolist(),
                                       ids[:keep, :k].tolist() if k else None,
                                       top[:keep, :k].tolist() if k else None))
            self.tokens += keep
        if end == "full":
            self._release(request)
            request.next_window()
            self._waiting.appendleft(request)
        elif end:
            self._finish(request, end)

    def _release(self, request: Request) -> None:
        for slot, owner in enumerate(self.owners):
            if owner is request:
                self.owners[slot] = None

    def _finish(self, request: Request, reason: str) -> None:
        request.finished = True
        self._release(request)
        self._emit(request, End(reason))

    def _emit(self, request: Request, event: Event) -> None:
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
                self._emit(request, Failed(message))
        self.owners = [None] * self.slots
        self._flush()
