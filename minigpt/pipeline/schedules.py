"""Pipeline schedules as data: which microbatch each stage runs forward and backward, tick by tick.

With S stages, M microbatches and R repeats (the circular schedule), the block stack is cut into
R S chunks of L / (R S) layers; chunk v (a *virtual stage*) runs on stage v mod S, in round
v // S. A schedule is two timing rules, the tick at which microbatch m runs chunk v forward and
the tick at which it runs it backward, and everything else is derived from them here:

- the table the loop in `minigpt.pipeline` executes (for each tick and stage: the forward of
  (m, round), the backward of (m', round'), or nothing), with the buffer slot every piece of data
  lives in: the *stash* of stage inputs a backward recomputes its stage from, and the *inboxes*
  for activations and gradients that arrive before they are used;
- the bubble, the stash size per stage, and the timeline notebook 02 draws.

GPipe runs every forward, then every backward in the mirror order; circular is GPipe with the
microbatches going round the ring R times; 1F1B starts each microbatch's backward as soon as its
forward has left the last stage, so a stage keeps at most 2S - 1 stage inputs however large M is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from minigpt.config import PIPELINE_SCHEDULES as SCHEDULES

F_COST, B_COST = 1.0, 2.0  # a chunk's backward costs about twice its forward


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule's table. Arrays are [ticks, stages] of ints, -1 where nothing happens."""

    name: str
    stages: int
    microbatches: int
    repeats: int
    fwd_mb: np.ndarray  # the microbatch a stage runs forward at a tick
    fwd_round: np.ndarray  # ... through which of its chunks (0..R-1)
    fwd_src: np.ndarray  # the inbox slot its input waits in (-1: the embedding's output)
    fwd_stash: np.ndarray  # the stash slot its input is kept in for the backward
    bwd_mb: np.ndarray  # the microbatch a stage runs backward at a tick
    bwd_round: np.ndarray
    bwd_stash: np.ndarray  # the stash slot of the input the backward recomputes from
    bwd_src: np.ndarray  # the gradient inbox slot its output's gradient waits in
    recv_fwd: np.ndarray  # where an activation arriving from the left at the tick's end goes
    recv_bwd: np.ndarray  # where a gradient arriving from the right at the tick's end goes
    head_mb: np.ndarray  # [ticks]: the microbatch whose last chunk ended this tick, or -1
    head_slot: np.ndarray  # [ticks]: the gradient inbox slot (on the last stage) it goes to
    stash_size: int
    inbox_size: int
    grad_inbox_size: int

    @property
    def ticks(self) -> int:
        return self.fwd_mb.shape[0]

    def forward_only(self) -> Schedule:
        """The same forwards with no backward (evaluation): the ticks up to the last forward."""
        last = int(np.max(np.nonzero((self.fwd_mb >= 0).any(axis=1))[0])) + 1
        idle = np.full((last, self.stages), -1)
        cut = {f.name: getattr(self, f.name)[:last] for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), np.ndarray)}
        return dataclasses.replace(self, **{**cut, "bwd_mb": idle, "bwd_round": idle,
                                            "bwd_stash": idle, "bwd_src": idle, "recv_bwd": idle,
                                            "head_slot": np.full(last, -1)})

    def bubble(self) -> float:
        """The share of the step each stage waits, with a backward costing two forwards and a
        tick as long as its busiest stage: (S - 1) / (R M + S - 1) for all three schedules."""
        work = ((self.fwd_mb >= 0) * F_COST + (self.bwd_mb >= 0) * B_COST) / self.repeats
        busy = self.microbatches * (F_COST + B_COST)
        return 1.0 - busy / float(work.max(axis=1).sum())


def _timing(name: str, S: int, M: int, R: int) -> tuple[Callable, Callable]:
    """The two rules: tick of the forward and of the backward of microbatch m at chunk v."""
    if name == "gpipe":
        def forward(m, v):
            return m + v % S + (v // S) * M

        span = R * M + S - 1  # ticks of forwards
        return forward, lambda m, v: 2 * span - 1 - forward(m, v)
    if name == "1f1b":
        return (lambda m, v: m + v), (lambda m, v: m + 2 * (S - 1) - v)
    raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")


def _allocate(intervals: dict, strict: bool) -> tuple[dict, int]:
    """Slots for items living over [first, last] ticks: a slot is reused once its item is done
    (from the tick it was last read, or only after it when `strict`); returns each item's slot
    and how many slots there are."""
    done_at, out = [], {}  # done_at[k]: the last tick slot k's current item is used
    for item, (first, last) in sorted(intervals.items(), key=lambda kv: kv[1]):
        free = [k for k, done in enumerate(done_at)
                if done < first or (done == first and not strict)]
        if free:
            out[item], done_at[free[0]] = free[0], last
        else:
            out[item] = len(done_at)
            done_at.append(last)
    return out, len(done_at)


def make(name: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The table of schedule `name` ("gpipe" or "1f1b") for S stages, M microbatches and R
    rounds of chunks (R > 1: circular, with "gpipe" only, and M >= S)."""
    S, M, R = stages, microbatches, repeats
    if name == "1f1b" and R > 1:
        raise ValueError("the 1f1b schedule runs with train.pipeline_repeats=1; for repeats, use "
                         "the gpipe schedule (circular)")
    if R > 1 and M < S:
        raise ValueError(f"a circular schedule needs at least as many microbatches as stages "
                         f"({M} < {S}): microbatches come round to the first stage after S ticks")
    forward, backward = _timing(name, S, M, R)
    V = R * S
    items = [(m, v) for m in range(M) for v in range(V)]
    ticks = max(max(forward(m, v), backward(m, v)) for m, v in items) + 1
    stage = {item: item[1] % S for item in items}
    stash, inbox, grads = {}, {}, {}
    for m, v in items:
        stash[(m, v)] = (forward(m, v), backward(m, v))
        if v > 0:
            inbox[(m, v)] = (forward(m, v - 1), forward(m, v))
        grads[(m, v)] = (forward(m, v) if v == V - 1 else backward(m, v + 1), backward(m, v))
    slot_of = {}
    sizes = {}
    for key, intervals, strict in (("stash", stash, True), ("inbox", inbox, False),
                                   ("grads", grads, True)):
        per_stage = [{i: span for i, span in intervals.items() if stage[i] == s}
                     for s in range(S)]
        allocated = [_allocate(p, strict) for p in per_stage]
        slot_of[key] = {i: slot for table, _ in allocated for i, slot in table.items()}
        sizes[key] = max([n for _, n in allocated] + [1])

    def grid():
        return np.full((ticks, S), -1, dtype=np.int32)

    t_ = {k: grid() for k in ("fwd_mb", "fwd_round", "fwd_src", "fwd_stash", "bwd_mb",
                              "bwd_round", "bwd_stash", "bwd_src", "recv_fwd", "recv_bwd")}
    head_mb = np.full(ticks, -1, dtype=np.int32)
    head_slot = np.full(ticks, -1, dtype=np.int32)
    for m, v in items:
        s, r = v % S, v // S
        tf, tb = forward(m, v), backward(m, v)
        if t_["fwd_mb"][tf, s] >= 0 or t_["bwd_mb"][tb, s] >= 0:
            raise ValueError(f"schedule {name}: stage {s} has two forwards or backwards at once")
        t_["fwd_mb"][tf, s], t_["fwd_round"][tf, s] = m, r
        t_["fwd_src"][tf, s] = slot_of["inbox"][(m, v)] if v > 0 else -1
        t_["fwd_stash"][tf, s] = slot_of["stash"][(m, v)]
        t_["bwd_mb"][tb, s], t_["bwd_round"][tb, s] = m, r
        t_["bwd_stash"][tb, s] = slot_of["stash"][(m, v)]
        t_["bwd_src"][tb, s] = slot_of["grads"][(m, v)]
        if v < V - 1:  # its output arrives at the next chunk's stage at the tick's end
            t_["recv_fwd"][tf, (s + 1) % S] = slot_of["inbox"][(m, v + 1)]
        else:
            head_mb[tf], head_slot[tf] = m, slot_of["grads"][(m, v)]
        if v > 0:  # the gradient of its input goes back to the previous chunk's stage
            t_["recv_bwd"][tb, (s - 1) % S] = slot_of["grads"][(m, v - 1)]
    return Schedule(name=name, stages=S, microbatches=M, repeats=R, head_mb=head_mb,
                    head_slot=head_slot, stash_size=sizes["stash"], inbox_size=sizes["inbox"],
                    grad_inbox_size=sizes["grads"], **t_)


def layer_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """Which layer each position of the stacked [layers, ...] arrays holds while a circular
    schedule runs: stage s's contiguous share holds chunks s, S + s, 2S + s, ...; the identity
    when R = 1 (and in every checkpoint)."""
    S, R = stages, repeats
    c = num_layers // (R * S)
    chunks = [r * S + s for s in range(S) for r in range(R)]  # position order, stage-major
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks]).astype(np.int32)


# Reading a table for the pipeline's settings (`sharding.Pipeline`) ---------------------------


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a step each stage spends idle: (S - 1) / (R M + S - 1), the same for GPipe
    and 1F1B (R = 1) and for the circular schedule (R > 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


@functools.cache
def table(settings, stages: int) -> Schedule:
    """The schedule table for these pipeline settings on `stages` stages."""
    return make(settings.schedule, stages, settings.microbatches, settings.repeats)


def describe(stages: int, num_layers: int, settings, *,
             sequences: int) -> str:
    """One line saying how the stack runs: stages and chunks, the schedule, microbatches of
    `sequences`, the bubble and the stage inputs each stage keeps for its backward."""
    S, M, R = stages, settings.microbatches, settings.repeats
    c = num_layers // (R * S)
    chunks = (f"{R} chunks of {c} layer(s) each, circular" if R > 1 else
              f"{num_layers // S} layer(s) each")
    return (f"pipeline: {S} stages of {chunks}; schedule {settings.schedule}, {M} microbatches of "
            f"{sequences // M} sequences; bubble (S - 1) / (R M + S - 1) = "
            f"{bubble_fraction(S, M, R):.1%} of each step; each stage keeps up to "
            f"{table(settings, S).stash_size} microbatch inputs for its backward")
