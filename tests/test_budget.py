"""Time budgets (`minigpt.budget`): the decisions, against a fake clock, step by step; and a real
budgeted run whose refits never recompile the train step."""

import json
import logging
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import small_vocab

from minigpt import train
from minigpt.config import TrainConfig
from minigpt.train.budget import TimeBudget


class Job:
    """The trainer's side of a budget, with a clock that moves only when a step says so: each
    step() takes the seconds it is given, then the budget decides as it does in the trainer."""

    def __init__(self, seconds=100.0, eval_share=8 / (3 * 100)):
        self.now, self.step_done, self.total, self.fits = 0.0, 0, 10**9, []
        self.budget = TimeBudget(seconds, 0.0, eval_share=eval_share, clock=lambda: self.now,
                                 say=lambda line: None)
        self.waits = 0

    def step(self, seconds):
        self.now += seconds
        self.step_done += 1
        total = self.budget.check(self.step_done, self.total, self._wait)
        if total is not None:
            self.total = total
            self.fits.append((self.step_done, total))
        stopped = self.budget.out_of_time(self.step_done, self.total)
        if stopped:
            self.total = self.step_done
        return stopped

    def _wait(self):
        self.waits += 1

    def run(self, until, seconds):
        """Steps of `seconds` until step `until` or a stop; returns whether the budget stopped."""
        while self.step_done < min(until, self.total):
            if self.step(seconds):
                return True
        return False


def first_fit(job):
    """Compilation 10 s, then 0.5 s steps: the probe ends after 5 s (5% of the budget), at
    step 11, which leaves 100 - 15.5 = 84.5 s for steps of 0.5 s plus their share of
    evaluations (8 batches every 100 steps, a third of a step each): 0.5133 s, 164 steps."""
    job.step(10.5)
    job.run(11, 0.5)
    assert job.fits == [(11, 175)]
    record = job.budget.take_record()
    assert record == {"seconds": 100.0, "steps": 175, "compile_s": 10.0,
                      "fit1": {"at_step": 11, "s_per_step": 0.5133}}
    assert job.budget.take_record() is None  # nothing new since


def test_the_budget_waits_only_for_the_steps_it_measures():
    job = Job()
    first_fit(job)
    # the first step, then each of the probe's steps from 9 to 11 (until 5 s had passed)
    assert job.waits == 4
    job.run(92, 0.5)
    assert job.waits == 4  # nothing measured until halfway through the rest


def test_a_run_on_time_keeps_its_schedule():
    job = Job()
    first_fit(job)
    job.run(93, 0.51)  # halfway (step 93), the pace says it ends at 99.14 s
    assert job.fits == [(11, 175)]
    assert job.budget.take_record()["ends_early_s"] == pytest.approx(0.86, abs=0.01)
    assert not job.run(175, 0.51) and job.step_done == 175
    assert job.now == pytest.approx(99.14, abs=0.01)


def test_a_run_late_by_more_than_the_tolerance_is_refitted_to_the_deadline():
    job = Job()
    first_fit(job)
    job.run(93, 0.7)  # 72.9 s: 82 more steps of 0.7 s would end 30.3 s late
    assert job.fits == [(11, 175), (93, 93 + int((100 - 72.9) / 0.7))] == [(11, 175), (93, 131)]
    assert job.budget.take_record()["fit2"] == {"at_step": 93, "s_per_step": 0.7}
    assert not job.run(131, 0.7)  # measured no more: the budget decided twice
    assert job.now == pytest.approx(99.5)


@pytest.mark.parametrize("rest_s, ends_at", [(0.6, 175), (0.7, 171)])
def test_steps_slower_after_the_last_measurement_finish_unless_a_quarter_slower(rest_s, ends_at):
    job = Job()
    first_fit(job)
    job.run(93, 0.51)  # kept: expected to end at 99.14 s
    # The hard stop: 99.14 + 2 (2% of the budget) + a quarter of the 41.82 s to go = 111.6 s.
    # 82 steps of 0.6 s end at 106.5 s, inside it; 0.7 s steps reach it at step 171.
    stopped = job.run(175, rest_s)
    assert job.step_done == job.total == ends_at and stopped == (ends_at < 175)
    assert job.now < 111.6 + rest_s
    if stopped:
        assert job.budget.take_record()["steps"] == ends_at


def test_a_run_far_slower_than_measured_stops_at_the_hard_stop():
    job = Job()
    first_fit(job)
    assert job.run(175, 1.5)  # 1.5 s steps reach 102 s (deadline + 2%) at step 69
    assert job.step_done == job.total == 69 and job.fits == [(11, 175)]


def test_a_budget_shorter_than_compiling_stops_after_the_first_step():
    job = Job(seconds=10.0)
    assert job.step(10.5)
    assert job.total == 1 and job.budget.take_record() == {"seconds": 10.0, "steps": 1}


# A real run ---------------------------------------------------------------------------------


def test_a_budgeted_run_ends_its_cosine_with_the_time_and_compiles_its_step_once(
        data_4k, tmp_path, caplog):
    budget = 18.0
    cfg = TrainConfig(preset="dp", model="llama-tiny", data=(str(data_4k),),
                      out=str(tmp_path / "run"), steps=5, batch_size=8, seq_len=64, lr=3e-3,
                      time_budget=budget, eval_batches=1, eval_every=40, save_every=10_000)
    model = small_vocab("llama-tiny")
    start = time.monotonic()
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            summary = train.train(model, cfg, sample=False)
    finally:
        jax.config.update("jax_log_compiles", False)
    took = time.monotonic() - start
    # One train step program for the whole run: the fit changed its numbers, not its code.
    compiles = [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
    assert len(compiles) == 1
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    record = saved["time_budget"]
    # The budget, not `steps`, decided the length; the decision is in config.json, with the
    # budget cleared so that --resume continues to the same step.
    assert saved["train"]["time_budget"] == 0 and saved["train"]["steps"] == summary["step"]
    assert record["seconds"] == budget and record["steps"] == summary["step"] > 20
    assert record["fit1"]["at_step"] >= TimeBudget.PROBE and record["compile_s"] > 0
    # The cosine reached its floor at the last step: the schedule was fitted to the time.
    metrics = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").open()]
    lrs = [r["lr"] for r in metrics if "lr" in r]
    assert len(lrs) == summary["step"]
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.1)
    # The default warm-up was fixed when the run started (config.json's "resolved"), before
    # the budget knew the run's end: the rate rose by the same step all through it, never
    # jumping when the budget fitted the end (as it did when the warm-up followed the end).
    warmup = saved["resolved"]["warmup_steps"]
    assert saved["train"]["warmup_steps"] == warmup and 1 <= warmup < summary["step"] // 2
    rises = np.diff(lrs[:warmup])
    assert np.all(rises > 0) and np.allclose(rises, cfg.lr / warmup, rtol=1e-3)
    assert lrs[warmup - 1] == pytest.approx(cfg.lr, rel=1e-3)  # the peak, at its last step
    # Training stopped by the deadline (2% tolerance), or later by at most what the last
    # measurement said it would; data, the final eval and save come on top, and so would steps
    # slowing down after the last measurement (up to a quarter of the rest).
    late = record.get("ends_late_s", 0.0)
    assert took < budget * 1.02 + late + 15
