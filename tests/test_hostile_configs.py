"""Hostile and mistaken settings: numbers (flags, `--set` keys, sampling), recipes and preset
files, the planner's numbers (`python -m minigpt.plan`), and runs that cannot fit the devices'
memory, fed to the command lines as a user would: a typo in a number, a file saved in the wrong
encoding, a preset of the same name in the working folder, a GPU recipe on a CPU. Each hostile
case sits beside one that must work.

The rule: a refusal is exit status 2 with one `error:` line naming the setting (or the file),
no traceback, and nothing written (every file in the test's folder as it was, no run folder),
before anything runs.
"""

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
from conftest import refused, snapshot, write_synthetic_stories
from tiny_llama import TEXT

import minigpt.optim.steps as steps
import minigpt.plan.auto as auto
import minigpt.train.trainer as trainer
from minigpt import generate, train
from minigpt.config import TrainConfig
from minigpt.errors import UserError
from minigpt.plan import cli as plan_cli
from minigpt.runs import resolved
from minigpt.runs.overrides import recipe_configs
from minigpt.sharding.presets import PRESETS_DIR
from minigpt.train import metrics


@pytest.fixture
def run(wordpiece_run, tmp_path) -> Path:
    """A copy of conftest's `wordpiece_run` (a tiny imported Llama) this test may damage."""
    return Path(shutil.copytree(wordpiece_run, tmp_path / "run"))


class Stopped(UserError):
    """A run stopped where a test has seen what it needed: before it writes its folder, or
    before its first step."""


STOPPED = "stopped where the test has seen what it needed"


def _stop(*args, **kwargs):
    raise Stopped(STOPPED)


# --- numbers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "train.lr must be a finite number, got inf"),
    (["--lr", "nan"], "train.lr must be a finite number, got nan"),
    (["--set", "train.muon_lr=nan"], "train.muon_lr must be a finite number"),
    (["--set", "train.weight_decay=-1"], "train.weight_decay >= 0"),
    (["--set", "model.dropout=nan"], "model.dropout must be a finite number"),
    (["--seed", "-1"], "train.seed must be in [0, 2^32)"),
    (["--set", "train.time_budget=inf"], "train.time_budget must be a finite number"),
])
def test_invalid_numbers_are_refused_before_anything_runs(data_4k, tmp_path, capsys, args,
                                                          message):
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--model", "minigpt-tiny", "--data", str(data_4k), "--out",
                                str(tmp_path / "new"), "--steps", "1", *args]),
            message, unchanged=before)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "need a finite temperature"),
    (["--temperature", "-1"], "need a finite temperature"),
    (["--top-p", "nan"], "0 < top_p <= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens >= 1"),
    (["--seed", "-3"], "0 <= --seed < 2^32"),
])
def test_invalid_sampling_is_refused(run, tmp_path, capsys, args, message):
    before = snapshot(tmp_path)
    refused(capsys, generate.main(["--run", str(run), *args]), message, unchanged=before)


def test_a_top_k_past_the_vocabulary_samples_from_all_of_it(run, capsys):
    """Benign: a top-k of the vocabulary size or more keeps every token (the help says so)."""
    assert generate.main(["--run", str(run), "--top-k", "999999", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")


def test_the_trainer_checks_configs_made_in_python_too():
    with pytest.raises(Exception, match="train.lr must be a finite number"):
        dataclasses.replace(TrainConfig(), lr=float("nan"))


@pytest.mark.parametrize("setting, message", [
    ("train.lora_rank=1000000000", "train.lora_rank=1000000000 needs"),
    ("model.embed_dim=1048576", "the model (minigpt, 2 layers of width 1048576) needs"),
])
def test_an_absurd_size_is_refused_before_jax_allocates_it(tmp_path, capsys, setting, message):
    (tmp_path / "stories.txt").write_text(TEXT[0])  # refused before it is read
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--model", "minigpt-tiny", "--data", str(tmp_path / "stories.txt"),
                                "--out", str(tmp_path / "new"), "--steps", "1", "--set", setting]),
            message, "more than a device", unchanged=before)
    assert not (tmp_path / "new").exists()


def test_a_divergence_names_the_extreme_setting_that_caused_it():
    from minigpt.config import ModelConfig

    moe = ModelConfig(arch="llama", num_experts=4, router_z_loss_coef=1e30)
    values = {"loss": 3.0, "grad_norm": float("inf"), "z_loss": float("inf")}
    extreme = metrics.extreme_settings(moe, TrainConfig(), values)
    assert extreme == ["model.router_z_loss_coef 1e+30"]
    message = str(metrics.TrainingDiverged.at(5, values, lr=1e-3, warmup=10, dtype="float32",
                                              out=Path("r"), latest_checkpoint=None,
                                              extreme=extreme))
    assert "likely cause: model.router_z_loss_coef 1e+30" in message and "\n" not in message
    assert "learning rate" not in message
    plain = metrics.extreme_settings(ModelConfig(), TrainConfig(lr=1e-3), values)
    assert plain == []  # a run with ordinary settings: the learning rate is the suspect


@pytest.mark.slow
def test_an_extreme_z_loss_diverges_naming_it(tmp_path, capsys):
    stories = write_synthetic_stories(tmp_path / "s.txt", copies=20)
    code = train.main(["--model", "moe-tiny", "--data", str(stories), "--out", str(tmp_path / "r"),
                       "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--no-sample",
                       "--set", "model.router_z_loss_coef=1e30",
                       "--set", f"train.data_root={tmp_path / 'data'}"])
    err = capsys.readouterr().err
    assert code == 3 and "model.router_z_loss_coef 1e+30" in err, err


# --- recipes and preset files ----------------------------------------------------------------

def test_a_recipe_value_of_the_wrong_type_names_it(data_4k, tmp_path, capsys):
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[model]\nname = "minigpt-tiny"\nnum_layers = "three"\n\n[train]\n')
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--recipe", str(recipe), "--data", str(data_4k), "--out",
                                str(tmp_path / "new")]),
            f"recipe {recipe}: model.num_layers must be an integer, got 'three'", unchanged=before)


def test_a_preset_file_that_is_not_utf8_is_refused_naming_it(data_4k, tmp_path, capsys):
    """A UTF-16 preset once gave "'utf-8' codec can't decode byte 0xff", naming no file."""
    preset = tmp_path / "mine.toml"
    preset.write_text('[mesh]\naxes = ["data"]\nshape = [-1]\n', encoding="utf-16")
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--preset", str(preset), "--model", "minigpt-tiny", "--data",
                                str(data_4k), "--out", str(tmp_path / "new"), "--steps", "1"]),
            f"preset 'mine' ({preset}) is not UTF-8 text", unchanged=before)


def test_a_preset_named_beside_a_local_file_of_that_name_says_which_it_read(
        data_4k, tmp_path, capsys, monkeypatch):
    """`--preset dp` from a folder holding a dp.toml of its own (one refused were it read)
    reads the shipped preset and says so, in the lines a run prints before its first step
    (where this one is stopped: a step's compilation would add nothing to what is checked)."""
    (tmp_path / "dp.toml").write_text('mesh = "not the shipped preset"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(steps, "train_step", _stop)
    code = train.main(["--model", "minigpt-tiny", "--tokenizer", "tinystories-4k", "--preset",
                       "dp", "--data", str(data_4k), "--out", str(tmp_path / "run"), "--steps",
                       "1", "--batch-size", "8", "--seq-len", "32", "--no-sample"])
    out, err = capsys.readouterr()
    # (after the progress bar of the step it was stopped at)
    assert code == 2 and err.splitlines()[-1] == f"error: {STOPPED}", err
    shipped = PRESETS_DIR / "dp.toml"
    lines = out.splitlines()
    assert f"note: dp is the shipped {shipped}, not ./dp.toml in this folder: give ./dp.toml to " \
           f"use that one" in lines, out
    assert any(line.startswith(f"preset dp ({shipped}) on mesh ") for line in lines), out


# --- the planner's numbers -------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--device-memory", "9" * 401],  # was an OverflowError
     f"--device-memory '{'9' * 40}': give a size such as 16GiB"),
    (["--device-memory", "0.5"], "--device-memory '0.5' is 0 B"),  # was taken as 0 B
    (["--devices", "-1"], "--devices -1: plan for 1 to"),  # was a TypeError
    (["--devices", "1000000"], "--devices 1000000: plan for 1 to"),  # aborted after minutes
    (["--headroom", "1.5"], "--headroom 1.5: the share of the memory left free is a number"),
    (["--headroom", "-0.5"], "--headroom -0.5: the share"),
    (["--headroom", "nan"], "--headroom nan: the share"),
    (["--headroom", "1"], "--headroom 1.0: the share"),  # was "total at most 0% of it"
])
def test_the_planners_numbers_are_refused_at_once(capsys, args, message):
    started = time.monotonic()
    refused(capsys, plan_cli.main(["--model", "minigpt-tiny", *args]), message)
    assert time.monotonic() - started < 10


def test_the_planner_plans_a_recipe_and_refuses_an_unknown_one(capsys):
    model_cfg, train_cfg = recipe_configs("stories-cpu")
    assert plan_cli.main(["--recipe", "stories-cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model llama-cpu (llama, {model_cfg.num_layers} layers, width "
                          f"{model_cfg.embed_dim}, "), out
    assert f"batch {train_cfg.batch_size} x {resolved.seq_len(model_cfg, train_cfg)} tokens" in out
    refused(capsys, plan_cli.main(["--recipe", "nope"]), "unknown recipe 'nope'")


def test_preset_auto_refuses_a_device_memory_under_a_byte(data_4k, tmp_path, capsys):
    """`--device-memory 0.5` was 0 B, which auto then replaced by the machine's memory."""
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--preset", "auto", "--device-memory", "0.5", "--model",
                                "minigpt-tiny", "--tokenizer", "tinystories-4k", "--data",
                                str(data_4k), "--out", str(tmp_path / "new"), "--steps", "1"]),
            "--device-memory '0.5' is 0 B", unchanged=before)
    assert not (tmp_path / "new").exists()


# --- memory that cannot fit ------------------------------------------------------------------

def test_a_run_that_cannot_fit_is_refused_before_its_folder_is_written(data_4k, tmp_path, capsys,
                                                                       monkeypatch):
    """A GPU recipe on a 24 GB CPU machine (the machine's memory is pinned to that): XLA once
    asked for 50 GB, after the run folder was written. Should the check let it through, the test
    fails where the run would lock its folder, before it writes or allocates anything."""
    monkeypatch.setattr(auto, "present_memory",
                        lambda devices: (24 * 10**9 // devices, "a 24 GB machine's share"))
    monkeypatch.setattr(trainer, "hold_run_lock", lambda *args, **kwargs: pytest.fail(
        "the memory check let the run through: it would now write its folder and allocate"))
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--recipe", "stories-gpu", "--data", str(data_4k), "--out",
                                str(tmp_path / "run"), "--steps", "1"]),
            "needs about", "per device", "--no-memory-check", unchanged=before)
    assert not (tmp_path / "run").exists()


def test_no_memory_check_goes_past_the_check_saying_so(data_4k, tmp_path, capsys, monkeypatch):
    """A device of 1 MiB (given) fits nothing: refused, and with the flag let through, saying
    so (then stopped where the run would lock its folder)."""
    monkeypatch.setattr(trainer, "hold_run_lock", _stop)
    args = ["--model", "minigpt-tiny", "--tokenizer", "tinystories-4k", "--data", str(data_4k),
            "--out", str(tmp_path / "run"), "--steps", "1", "--device-memory", "1MiB"]
    refused(capsys, train.main(args), "needs about",
            "per device (parameters", "and a device here has 1.00 MiB (given)")
    assert train.main([*args, "--no-memory-check"]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {STOPPED}\n", err
    assert "going on as --no-memory-check asks" in out
