"""What really goes wrong in a long run, made to happen for real: a torn metrics line, a latest
checkpoint garbled on disk, a save interrupted mid-write, a learning rate that diverges. None of
them may cost the run, or overwrite what is good.

The runs are the tiny model with the TinyStories vocabulary, all of one shape (one compiled
step). A six-step run (`six`, checkpoints at 2, 4 and 6) is trained once; tests damage copies of
it and resume them to step 8, which must give the losses of eight uninterrupted steps."""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import losses, small_vocab
from flax import nnx

import minigpt
from minigpt import generate, train
from minigpt.checkpoint import TEMPORARY_MARK, Checkpointer, CheckpointError
from minigpt.config import ConfigError, TrainConfig
from minigpt.models import build_model
from minigpt.train import metrics, trainer

MODEL = small_vocab("minigpt-tiny")


def short_run(data: Path, out: Path) -> TrainConfig:
    return TrainConfig(preset="fsdp", model="minigpt-tiny", data=(str(data),), out=str(out),
                       steps=6, decay_steps=8, batch_size=8, seq_len=32, lr=3e-3,
                       warmup_steps=2, eval_every=100, eval_batches=1, save_every=2,
                       log_every=1)


@pytest.fixture
def config(data_4k, tmp_path) -> TrainConfig:
    return short_run(data_4k, tmp_path / "run")


@pytest.fixture(scope="module")
def six(data_4k, tmp_path_factory) -> Path:
    """The short run's six steps, trained once for the module; tests change only copies."""
    out = tmp_path_factory.mktemp("six") / "run"
    train.train(MODEL, short_run(data_4k, out), sample=False)
    return out


@pytest.fixture
def trained(six, config) -> Path:
    """A copy of `six` at `config.out`, as if `config` had trained it."""
    return Path(shutil.copytree(six, config.out))


def files_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def garble(checkpoint: Path) -> None:
    """Overwrite every array file of a checkpoint with random bytes of the same length."""
    data_files = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    rng = np.random.default_rng(0)
    for path in data_files:
        path.write_bytes(rng.bytes(path.stat().st_size))


@pytest.fixture
def uninterrupted(config, straight) -> list[float]:
    """Losses of 8 uninterrupted steps: what every recovered run must reproduce."""
    return straight(MODEL, dataclasses.replace(config, steps=8))


def test_a_torn_last_metrics_line_does_not_block_resume(config, trained, uninterrupted):
    metrics = trained / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 7, "grad_norm": 0.5, "lo')  # killed mid-append
    with pytest.warns(UserWarning, match=r"metrics.jsonl, line 8: not a complete record"):
        train.train(MODEL, dataclasses.replace(config, steps=8), resume=True, sample=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # all parse
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert losses(config.out) == uninterrupted


# A failed restore must not spill TensorStore's "Event loop is closed" tracebacks (one per array
# still being read) onto stderr: pytest reports them as unraisable exceptions, here errors.
QUIET = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@QUIET
def test_resume_falls_back_past_a_garbled_latest_checkpoint(config, trained, uninterrupted,
                                                            capsys):
    checkpoints = trained / "checkpoints"
    garble(checkpoints / "6")
    damaged = files_digest(checkpoints / "6")
    summary = train.train(MODEL, dataclasses.replace(config, steps=8), resume=True,
                          sample=False)
    out = capsys.readouterr().out
    assert "warning: checkpoint 6 cannot be read (ValueError: " in out
    assert "resumed from" in out and f"checkpoint: {checkpoints / '8'}\n" in out
    assert summary["step"] == 8
    # The damaged files are kept byte for byte, out of the way of the new save of step 6.
    set_aside = Path(config.out) / "damaged-checkpoints" / "6"
    assert files_digest(set_aside) == damaged
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [4, 6, 8]
    assert losses(config.out) == uninterrupted  # steps 5..8 rerun exactly from step 4


@QUIET
def test_generation_skips_a_garbled_latest_checkpoint_and_touches_nothing(config, trained,
                                                                           capsys):
    checkpoints = trained / "checkpoints"
    garble(checkpoints / "6")
    before = files_digest(checkpoints)
    with pytest.warns(UserWarning, match="checkpoint 6 of .* cannot be read .* using step 4"):
        step = minigpt.load_run(config.out).step
    assert step == 4 and files_digest(checkpoints) == before
    capsys.readouterr()
    assert generate.main(["--run", config.out, "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()  # the story, and the warning in one line of its own
    assert out.startswith("Once upon a time") and err.count("\n") == 1
    assert err.startswith(f"warning: checkpoint 6 of {config.out} cannot be read (")
    for name in ("4", "2"):
        garble(checkpoints / name)
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be read .*step 6.*step 2"):
        minigpt.load_run(config.out)


class _AbandonedRead:
    """Stands for a TensorStore read that completes after Orbax has closed its event loop."""

    def __del__(self):
        raise RuntimeError("Event loop is closed")


def test_reads_that_report_before_the_failure_reaches_us_stay_quiet(trained, monkeypatch):
    """TensorStore's threads can report an abandoned read before Orbax's error reaches the
    checkpointer: the filter must already be in place when the restore starts."""
    for later in ("4", "6"):  # one checkpoint: one failing restore
        shutil.rmtree(trained / "checkpoints" / later)
    checkpointer = Checkpointer(trained / "checkpoints", read_only=True)

    class _Unrelated:
        def __del__(self):
            raise RuntimeError("something else")

    def failing_restore(*args, **kwargs):
        _AbandonedRead()  # reported at once, while the restore is still failing
        _Unrelated()
        raise ValueError("unreadable")

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)  # no filter installed yet
    monkeypatch.setattr(checkpointer._manager, "restore", failing_restore)
    with pytest.raises(CheckpointError, match="ValueError: unreadable"):
        checkpointer.restore(build_model(MODEL, rngs=nnx.Rngs(0)))
    assert [str(u.exc_value) for u in reported] == ["something else"]  # only the noise dropped


def test_a_save_interrupted_mid_write_is_never_restored(config, trained, uninterrupted,
                                                        capsys):
    checkpoints = trained / "checkpoints"
    shutil.rmtree(checkpoints / "6")  # stopped after step 4 was saved
    leftover = checkpoints / f"6{TEMPORARY_MARK}1700000000"
    shutil.copytree(checkpoints / "4", leftover)  # looks like a checkpoint, but was never done
    assert Checkpointer(checkpoints, read_only=True).all_steps() == [2, 4]
    train.train(MODEL, dataclasses.replace(config, steps=8), resume=True, sample=False)
    out = capsys.readouterr().out
    assert f"removed {leftover}: an incomplete checkpoint" in out
    assert "at step 4" in out and not leftover.exists()
    assert losses(config.out) == uninterrupted


@pytest.mark.slow
def test_a_diverging_run_stops_at_once_and_keeps_its_last_good_checkpoint(config, capsys):
    cfg = dataclasses.replace(config, steps=30, lr=1e4, warmup_steps=1)
    with pytest.raises(metrics.TrainingDiverged) as e:
        train.train(MODEL, cfg, sample=False)
    message = str(e.value)
    step = int(message.split(":")[0].removeprefix("step "))
    assert step < 10 and "learning rate too high" in message and "--resume --lr 0.001" in message
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").open()]
    assert records[-1]["step"] == step and not math.isfinite(records[-1]["loss"]
                                                             * records[-1]["grad_norm"])
    saved = sorted(int(p.name) for p in (Path(cfg.out) / "checkpoints").iterdir())
    assert saved and saved[-1] < step
    assert f"the latest checkpoint is still step {saved[-1]}" in message
    model = build_model(MODEL, rngs=nnx.Rngs(0))
    Checkpointer(Path(cfg.out) / "checkpoints", read_only=True).restore(model)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(nnx.state(model)))
    # From the command line: one line, a non-zero exit, the checkpoints as they were.
    before = files_digest(Path(cfg.out) / "checkpoints")
    code = train.main(["--out", cfg.out, "--resume", "--no-sample"])
    err = capsys.readouterr().err
    last_line = err.rstrip("\n").split("\n")[-1]  # after the progress bar's
    assert code == 3 and last_line.startswith("error: step ") and err.count("error:") == 1
    assert files_digest(Path(cfg.out) / "checkpoints") == before
    # The command the message suggests goes on from the last good checkpoint, and trains.
    assert train.main(hinted(message) + ["--no-sample"]) == 0
    assert losses(cfg.out)[saved[-1]:] and all(map(math.isfinite, losses(cfg.out)))


def hinted(message: str) -> list[str]:
    """The arguments of the command an error message suggests."""
    command = message.split("python -m minigpt.train ", 1)[1].split(" (", 1)[0]
    return command.split()


def test_a_run_that_diverges_before_saving_is_told_a_command_that_starts_it_again(config,
                                                                                  capsys):
    cfg = dataclasses.replace(config, steps=4, lr=1e4, warmup_steps=1, save_every=100)
    with pytest.raises(metrics.TrainingDiverged) as e:
        train.train(MODEL, cfg, sample=False)
    message = str(e.value)
    assert "no checkpoint was saved" in message and "starts again from step 0" in message
    assert train.main(hinted(message) + ["--no-sample"]) == 0
    assert "nothing of" in capsys.readouterr().out
    assert len(losses(cfg.out)) == 4 and all(map(math.isfinite, losses(cfg.out)))


def test_the_library_refuses_to_overwrite_a_run(config, trained):
    before = files_digest(trained)
    with pytest.raises(ConfigError, match="already holds checkpoints: pass --resume"):
        train.train(MODEL, config, sample=False)
    assert files_digest(Path(config.out)) == before


def test_the_closing_sample_uses_the_runs_seed(config, monkeypatch):
    keys = []
    monkeypatch.setattr(trainer, "generate", lambda *a, rng, **k: keys.append(rng) or ["story"])
    train.train(MODEL, dataclasses.replace(config, steps=2, seed=11), sample=True)
    assert np.array_equal(jax.random.key_data(keys[0]), jax.random.key_data(jax.random.key(11)))
    assert os.path.exists(Path(config.out) / "loss.png")
