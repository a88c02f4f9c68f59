"""Time budgets: `--time-budget 10m` turned into a step count, decided while the run goes.

A run with a budget starts open-ended (the warm-up only). Once the first step (which compiles)
is done and a few more have run (at least PROBE steps and 5% of the budget), the budget knows how
long compiling took and how long a step takes: it fixes the step count to what fits in the time
left, periodic evaluations set aside, and the trainer fits the cosine to it. The schedule's end
is a number the compiled step receives, so a fit costs no compilation. Halfway through the rest
the budget measures the pace again (evaluations and checkpoints included); if the run would miss
the deadline by more than 2% of the budget, it fits once more (a smaller miss ends the run that
much early or late, with its cosine complete). If the time runs out anyway, the run stops there;
after the last measurement that hard stop leaves room for the rest of the run to be up to a
quarter slower than measured (a machine whose load changes), so a nearly finished cosine is not
cut.

The budget only decides: it reads a clock and the step numbers it is given, and says what to do.
Its decisions are kept in `record`, which the trainer writes to config.json, so that a resumed run
continues to the same step with the same rates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class TimeBudget:
    """A wall-clock budget of `seconds`, counted from `started` (a `clock()` time).

    After each step is dispatched the trainer calls `check(step, total, wait)`: None, or the
    step count the run should now have (a fit). `wait()` must block until that step is done; it
    is called only when a measurement needs the time. `out_of_time(step, total)` says when to
    stop regardless. `eval_share` is what periodic evaluations add to a step's time (a forward
    pass costs about a third of a training step, so eval_batches / (3 * eval_every)).
    """

    PROBE = 8
    PROBE_FRACTION = 0.05
    TOLERANCE = 0.02  # of the budget: a refit (or a stop) only past this
    DRIFT = 0.25  # how much slower than measured the rest of a run may get before it is cut

    def __init__(self, seconds: float, started: float, *, eval_share: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], Any] = print):
        self.seconds, self.eval_share, self.clock, self.say = seconds, eval_share, clock, say
        self.deadline = started + seconds
        self.stop_at = self.deadline + self.TOLERANCE * seconds  # the hard stop
        self.loop_start = clock()
        self.mark: tuple[int, float] | None = None  # (step, time) the pace is measured from
        self.first_step_s = self.compile_s = 0.0  # the first step; its compilation alone
        self.check_at = 0  # the step of the next measurement; 0: right after the next step
        self.fits = 0
        self.done = False  # the last decision is taken: from here, only the hard stop
        self.record: dict[str, Any] = {"seconds": seconds}
        self._changed = False

    def take_record(self) -> dict[str, Any] | None:
        """The record, if it changed since the last call (for the trainer to write)."""
        changed, self._changed = self._changed, False
        return dict(self.record) if changed else None

    def _note(self, **values: Any) -> None:
        self.record.update(values)
        self._changed = True

    def check(self, step: int, total: int, wait: Callable[[], Any]) -> int | None:
        """Called after step `step` (of `total` planned) is dispatched; returns the new step
        count when the schedule should be (re)fitted, else None."""
        if self.done or step < self.check_at:
            return None
        wait()
        now = self.clock()
        if self.mark is None:  # the first step (and the compilation) just finished
            self.mark, self.first_step_s = (step, now), now - self.loop_start
            self.check_at = step + self.PROBE
            return None
        pace = (now - self.mark[1]) / (step - self.mark[0])
        if not self.fits:
            if now - self.mark[1] < self.PROBE_FRACTION * self.seconds:
                self.check_at = step + 1
                return None
            self.compile_s = max(0.0, self.first_step_s - pace)
            pace *= 1 + self.eval_share
        else:
            self.done = True
            ends = now + pace * (total - step)
            miss = ends - self.deadline
            if abs(miss) <= self.TOLERANCE * self.seconds:  # on time: keep the schedule
                self._allow_drift(now, ends)
                self._note(**{"ends_late_s" if miss > 0 else "ends_early_s": round(abs(miss), 2)})
                return None
            self._allow_drift(now, self.deadline)  # the refit ends at the deadline
        left = self.deadline - now
        if left < pace:  # no time for even one more step: the hard stop decides
            return None
        return self._fit(step, step + int(left / pace), pace, now)

    def _allow_drift(self, now: float, ends: float) -> None:
        """Move the hard stop past a run expected to end at `ends`, by the tolerance and by a
        quarter of the time still to go."""
        slack = self.TOLERANCE * self.seconds + self.DRIFT * max(0.0, ends - now)
        self.stop_at = max(self.stop_at, ends + slack)

    def _fit(self, step: int, total: int, pace: float, now: float) -> int:
        self.fits += 1
        self._note(steps=total, compile_s=round(self.compile_s, 2),
                   **{f"fit{self.fits}": {"at_step": step, "s_per_step": round(pace, 4)}})
        self.mark = (step, now)
        self.check_at = step + max(1, (total - step) // 2)  # halfway through the rest
        self.say(f"time budget {self.seconds:g} s: compiling took {self.compile_s:.1f} s and a "
                 f"step takes {pace:.3f} s, so the run trains {total} steps (schedule fitted at "
                 f"step {step})")
        return total

    def out_of_time(self, step: int, total: int) -> bool:
        """Past the hard stop with steps still to go: the run should stop at `step` (the record
        then says so)."""
        if self.clock() < self.stop_at or step >= total:
            return False
        self.say(f"the time budget ran out at step {step} of {total} (steps were slower than "
                 f"measured); stopping here" if self.fits else
                 f"the time budget ran out at step {step}, before the steps could be timed (the "
                 f"first step, compilation included, took {self.first_step_s:.1f} s); stopping "
                 f"here: give a longer --time-budget")
        self._note(steps=step)
        return True
