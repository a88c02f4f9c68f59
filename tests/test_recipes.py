"""Recipes, time budgets, the tokenizer a model is trained with, and defaults for short runs."""

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import losses

from minigpt import generate, train
from minigpt.config import TrainConfig, load_recipe
from minigpt.models import get_config
from minigpt.tokenizer import load_tokenizer


def configs(*argv):
    return train.resolve_configs(train.build_parser().parse_args(list(argv)))


def test_flags_override_the_recipe_and_set_overrides_flags():
    recipe = load_recipe("stories-cpu")
    model, cfg = configs("--recipe", "stories-cpu")
    assert cfg.model == recipe.model and cfg.recipe == "stories-cpu"
    assert model == dataclasses.replace(get_config(recipe.model), **recipe.model_fields)
    for name, value in recipe.train_fields.items():
        assert getattr(cfg, name) == value
    assert model.tokenizer == "tinystories-4k" and model.vocab_size == 4096
    _, cfg = configs("--recipe", "stories-cpu", "--lr", "1e-4", "--batch-size", "8",
                     "--time-budget", "90s", "--set", "lr=2e-4")
    assert (cfg.lr, cfg.batch_size, cfg.time_budget) == (2e-4, 8, 90.0)
    _, cfg = configs("--recipe", "stories-cpu", "--steps", "40")  # steps instead of the budget
    assert (cfg.steps, cfg.time_budget) == (40, 0.0)
    model, cfg = configs("--recipe", "stories-cpu", "--model", "llama-tiny")
    assert model == get_config("llama-tiny") and cfg.model == "llama-tiny"


def test_the_tokenizer_flag_gives_the_model_a_matching_vocabulary():
    model, _ = configs("--model", "minigpt-tiny", "--tokenizer", "tinystories-4k")
    assert (model.tokenizer, model.vocab_size) == ("tinystories-4k", 4096)
    model, _ = configs("--model", "minigpt-tiny")
    assert (model.tokenizer, model.vocab_size) == ("gpt2", 50257)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "5", "--time-budget", "1m"], "give --steps or --time-budget, not both"),
    (["--time-budget", "soon"], "expected a duration"),
    (["--recipe", "stories-gpu"], "unknown recipe 'stories-gpu'"),
    (["--resume", "--recipe", "stories-cpu"], "apply to a new run"),
    (["--tokenizer", "nope"], "unknown tokenizer 'nope'"),
])
def test_bad_recipe_budget_and_tokenizer_flags_are_refused(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert train.main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.fixture(scope="module")
def small_stories(stories_file, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "stories.txt"
    path.write_bytes(stories_file.read_bytes()[:400_000].rsplit(b"<|endoftext|>", 1)[0])
    return path


def test_a_model_trains_and_tells_stories_with_the_tinystories_tokenizer(small_stories,
                                                                         tmp_path, capsys):
    out = tmp_path / "run"
    code = train.main(["--model", "llama-tiny", "--tokenizer", "tinystories-4k", "--preset",
                       "dp", "--data", str(small_stories), "--set",
                       f"data_root={tmp_path / 'data'}", "--steps", "3", "--batch-size", "8",
                       "--seq-len", "32", "--out", str(out), "--set", "eval_batches=1"])
    assert code == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["tokenizer"] == "tinystories-4k" and saved["model"]["vocab_size"] == 4096
    assert saved["tokenizer"] == "tinystories-4k"  # the data's, the same
    assert [p.name.endswith("-tinystories-4k") for p in (tmp_path / "data").iterdir()] == [True]
    model, tokenizer, *_ = generate.load_for_generation(out)
    assert tokenizer is load_tokenizer("tinystories-4k") and model.config.vocab_size == 4096
    capsys.readouterr()
    assert generate.main(["--run", str(out), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")


def test_a_time_budget_fixes_the_steps_and_ends_the_cosine_with_the_time(small_stories,
                                                                         tmp_path):
    budget = 30.0
    cfg = TrainConfig(preset="dp", model="llama-tiny", data=(str(small_stories),),
                      data_root=str(tmp_path / "data"), out=str(tmp_path / "run"), steps=5,
                      batch_size=8, seq_len=64, lr=3e-3, time_budget=budget, eval_batches=1,
                      eval_every=40, save_every=10_000)
    model = dataclasses.replace(get_config("llama-tiny"), tokenizer="tinystories-4k",
                                vocab_size=4096)
    start = time.monotonic()
    summary = train.train(model, cfg, sample=False)
    took = time.monotonic() - start
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    record = saved["time_budget"]
    # The budget, not `steps`, decided the length; the decision is in config.json, with the
    # budget cleared so that --resume continues to the same step.
    assert saved["train"]["time_budget"] == 0 and saved["train"]["steps"] == summary["step"]
    assert record["seconds"] == budget and record["steps"] == summary["step"] > 20
    assert record["fit1"]["at_step"] >= train._Budget.PROBE and record["compile_s"] > 0
    # The cosine reached its floor at the last step: the schedule was fitted to the time.
    metrics = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").open()]
    lrs = [r["lr"] for r in metrics if "lr" in r]
    assert len(lrs) == summary["step"]
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.1)
    # Training stopped by the deadline (2% tolerance), or later by less than a recompilation
    # (which a refit would have cost); data, the final eval and save come on top, and so
    # would steps slowing down after the last measurement (up to a quarter of the rest).
    late = record.get("ends_late_s", 0.0)
    assert late <= record.get("recompile_s", 0.0)
    assert took < budget * 1.02 + late + 15


class _BudgetedRun:
    """A run that only has a clock: each step() takes the seconds it is given, and the budget
    decides as it would in the trainer (config.json writes are collected instead)."""

    def __init__(self, monkeypatch, seconds=100.0):
        self.now, self.records = 0.0, []
        monkeypatch.setattr(train, "_write_config",
                            lambda run, time_budget: self.records.append(dict(time_budget)))
        cfg = TrainConfig(steps=10**9, time_budget=seconds, eval_every=100, eval_batches=8)
        self.run = SimpleNamespace(train_cfg=cfg, started=0.0, step=0,
                                   optimizer=SimpleNamespace(tx=None))
        self.budget = train._Budget(self.run, clock=lambda: self.now)
        self.totals = []

    def step(self, seconds):
        self.now += seconds
        self.run.step += 1
        recorder = SimpleNamespace(set_total=self.totals.append)
        fitted = self.budget.check(self.run, None, recorder)
        stopped = self.budget.out_of_time(self.run)
        return fitted, stopped

    def until(self, step, seconds):
        while self.run.step < step:
            fitted, stopped = self.step(seconds)
            assert not stopped


def _first_fit(job):
    """Compilation 10 s, then 0.5 s steps: the probe ends after 5 s (5% of the budget), at
    step 11, which leaves 100 - 15.5 - 10 (the recompilation) = 74.5 s for 145 more steps of
    0.5 s and their share of evaluations (8 batches every 100 steps, a third of a step each)."""
    job.step(10.5)
    job.until(10, 0.5)
    assert job.step(0.5) == (True, False)
    assert job.run.train_cfg.steps == 156 and job.totals == [156]
    assert job.records[-1]["fit1"] == {"at_step": 11, "s_per_step": 0.5133}
    assert job.records[-1]["compile_s"] == 10.0


def test_a_run_late_by_less_than_a_recompilation_keeps_its_schedule_and_ends_late(monkeypatch):
    job = _BudgetedRun(monkeypatch)
    _first_fit(job)
    job.step(12.0 + 0.5)  # the new schedule recompiles (12 s); then steps get slower
    assert job.records[-1]["recompile_s"] == 12.0
    job.until(84, 0.55)  # halfway through the rest: 72 steps at 0.55 s to go
    assert job.records[-1]["ends_late_s"] == pytest.approx(7.2)  # < 12 s: no refit
    assert job.run.train_cfg.steps == 156 and "fit2" not in job.records[-1]
    job.until(156, 0.55)  # finishes 7.2 s late (inside its hard stop), with its own cosine
    assert job.now == pytest.approx(107.2)


@pytest.mark.parametrize("rest_s, ends_at", [(0.65, 156), (0.75, 153)])
def test_steps_slower_after_the_last_measurement_finish_unless_a_quarter_slower(
        monkeypatch, rest_s, ends_at):
    job = _BudgetedRun(monkeypatch)
    _first_fit(job)
    job.step(12.0 + 0.5)
    job.until(84, 0.55)  # 67.6 s: expected to end at 107.2 s (kept, as above)
    # The hard stop: 107.2 + 2 (2% of the budget) + a quarter of the 39.6 s to go = 119.1 s.
    # 72 steps of 0.65 s end at 114.4 s, inside it; 0.75 s steps reach it at step 153.
    stopped = False
    while not stopped and job.run.step < 156:
        _, stopped = job.step(rest_s)
    assert job.run.step == job.run.train_cfg.steps == ends_at
    assert stopped == (ends_at < 156) and job.now <= 119.1 + rest_s


def test_a_run_late_by_more_than_a_recompilation_is_refitted_to_the_deadline(monkeypatch):
    job = _BudgetedRun(monkeypatch)
    _first_fit(job)
    job.step(12.0 + 0.5)
    job.until(83, 0.7)
    fitted, _ = job.step(0.7)  # 72 steps at 0.7 s to go: 28.8 s late
    now = 28.0 + 72 * 0.7
    assert fitted and job.run.train_cfg.steps == 84 + int((100 - now - 12.0) / 0.7) == 97
    assert job.records[-1]["fit2"] == {"at_step": 84, "s_per_step": 0.7}
    job.step(12.0 + 0.7)
    job.until(97, 0.7)  # the budget no longer measures: it recompiled twice already
    assert job.now == pytest.approx(100.0, abs=0.7)


def test_a_run_that_cannot_pay_for_a_refit_stops_at_the_deadline(monkeypatch):
    job = _BudgetedRun(monkeypatch)
    _first_fit(job)
    job.step(40.0 + 0.5)  # the recompilation took four times as long as the first one
    job.until(83, 0.6)
    fitted, stopped = job.step(0.6)  # 99.2 s, 42.4 s late: no time left to recompile
    assert not fitted and not stopped and job.run.train_cfg.steps == 156
    while not stopped:
        fitted, stopped = job.step(0.6)
    assert job.now >= 102.0 and job.run.train_cfg.steps == job.run.step < 156
    assert job.records[-1]["steps"] == job.run.step


def test_a_fit_that_leaves_few_steps_measures_its_recompilation_once(monkeypatch):
    job = _BudgetedRun(monkeypatch, seconds=26.6)
    job.step(10.5)
    job.until(8, 0.5)
    assert job.step(0.5) == (True, False)  # step 9: 26.6 - 14.5 - 10 s left: 4 more steps
    assert job.run.train_cfg.steps == 13
    job.step(12.0 + 0.5)  # step 10 recompiles; the halfway check falls on the very next step
    job.step(0.5)
    assert job.records[-1]["recompile_s"] == 12.0 and "ends_late_s" in job.records[-1]


def test_a_budget_shorter_than_compiling_stops_after_the_first_step(monkeypatch, capsys):
    job = _BudgetedRun(monkeypatch, seconds=10.0)
    assert job.step(10.5) == (False, True)
    assert job.run.train_cfg.steps == 1 and job.records == [{"seconds": 10.0, "steps": 1}]
    assert "took 10.5 s); stopping here: give a longer --time-budget" in capsys.readouterr().out


@pytest.mark.slow  # 40 steps of 64 x 128 tokens through a 50k-token head: about two minutes
def test_a_40_step_run_with_default_settings_lowers_the_loss_by_more_than_a_nat(data_dir,
                                                                               tmp_path):
    cfg = TrainConfig(model="minigpt-tiny", data=(str(data_dir),), out=str(tmp_path / "run"),
                      steps=40)
    train.train(get_config("minigpt-tiny"), cfg, sample=False)
    seen = losses(tmp_path / "run")
    assert len(seen) == 40 and np.mean(seen[-5:]) < seen[0] - 1.0

