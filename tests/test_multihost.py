"""Multi-process jobs: 2 real processes x 4 simulated devices form one 8-device mesh.

The launcher starts the processes; their losses must equal a 1-process 8-device run with the same
seed and data, their checkpoints must resume in a 1-process run and the reverse, and a process
killed mid-run must bring the whole job down with the last checkpoint intact.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env, losses

from minigpt import train
from minigpt.config import TrainConfig
from minigpt.models import get_config

MODEL = get_config("minigpt-tiny")
STEPS = 4


pytestmark = pytest.mark.usefixtures("gpt2")  # skipped, saying why, where it cannot load


def config(data_dir, out, preset="fsdp", steps=STEPS) -> TrainConfig:
    """A short run; the 3-D preset runs the 1F1B schedule (the other pipeline one, GPipe)."""
    return TrainConfig(preset=preset, model="minigpt-tiny", data=(str(data_dir),), out=str(out),
                       steps=steps, decay_steps=STEPS, batch_size=8, seq_len=32, lr=3e-3,
                       warmup_steps=1, eval_every=STEPS, eval_batches=1, save_every=2,
                       log_every=1, pipeline_microbatches=2,
                       pipeline_schedule="1f1b" if preset == "dp_pp_tp" else "gpipe")


def cli_args(cfg: TrainConfig, *, resume=False) -> list[str]:
    args = ["--preset", cfg.preset, "--model", cfg.model, "--data", *cfg.data, "--out", cfg.out,
            "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size), "--seq-len",
            str(cfg.seq_len), "--lr", str(cfg.lr), "--eval-every", str(cfg.eval_every),
            "--save-every", str(cfg.save_every), "--no-sample"]
    for field in ("decay_steps", "warmup_steps", "eval_batches", "log_every",
                  "pipeline_microbatches", "pipeline_schedule"):
        args += ["--set", f"{field}={getattr(cfg, field)}"]
    return args + (["--resume"] if resume else [])


def launcher(train_args: list[str], log_dir: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "minigpt.launch", "--processes", "2", "--devices-per-process", "4",
         "--log-dir", str(log_dir), "--", *train_args],
        env=child_env("JAX_PLATFORMS"),  # the launched processes choose their own devices
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def launch(cfg: TrainConfig, tmp_path: Path, *, resume=False) -> str:
    proc = launcher(cli_args(cfg, resume=resume), tmp_path / "logs")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + "".join(
        p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    return out


_references: dict[str, list[float]] = {}


def reference(data_dir, tmp_path_factory, preset: str) -> list[float]:
    """Losses of the same run in this one process on 8 devices."""
    if preset not in _references:
        out = tmp_path_factory.mktemp(f"single-{preset}")
        train.train(MODEL, config(data_dir, out, preset), sample=False)
        _references[preset] = losses(out)
    return _references[preset]


# Real multi-process jobs are part of the slower set (`python -m pytest -m slow`): `fsdp`
# (weights gathered across processes) and `dp_pp_tp`, whose two pipeline stages are the two
# processes (activations and gradients cross between them) while batch and heads split inside
# each; dp_tp and dp_pp each split a subset of those axes, so they add a process each and no
# new crossing. LoRA's two-process test runs `fsdp` and `dp_pp` (tests/test_lora.py).
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "dp_pp_tp"])
def test_two_processes_train_like_one(data_dir, tmp_path, tmp_path_factory, preset):
    out = launch(config(data_dir, tmp_path / "run", preset), tmp_path)
    assert "mesh {" in out and "checkpoint:" in out
    assert out.count("checkpoint:") == 1  # only process 0 speaks
    np.testing.assert_allclose(losses(tmp_path / "run"),
                               reference(data_dir, tmp_path_factory, preset), rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4"]


@pytest.mark.slow
def test_checkpoints_move_between_one_and_two_processes(data_dir, tmp_path, tmp_path_factory):
    expected = reference(data_dir, tmp_path_factory, "fsdp")
    # two processes, then one
    two_then_one = config(data_dir, tmp_path / "a", steps=2)
    launch(two_then_one, tmp_path)
    train.train(MODEL, dataclasses.replace(two_then_one, steps=STEPS), resume=True, sample=False)
    np.testing.assert_allclose(losses(tmp_path / "a"), expected, rtol=1e-5)
    # one process, then two
    one_then_two = config(data_dir, tmp_path / "b", steps=2)
    train.train(MODEL, one_then_two, sample=False)
    launch(dataclasses.replace(one_then_two, steps=STEPS), tmp_path, resume=True)
    np.testing.assert_allclose(losses(tmp_path / "b"), expected, rtol=1e-5)


def job_pids(marker: str) -> dict[int, int]:
    """process index -> pid of the running training processes whose command line has `marker`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if marker in argv and "minigpt.train" in argv and "--process-id" in argv:
            found[int(argv[argv.index("--process-id") + 1])] = int(entry.name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the processes through /proc")
def test_a_killed_process_stops_the_job_and_the_last_checkpoint_resumes(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "run", steps=10_000)
    checkpoints = tmp_path / "run" / "checkpoints"
    proc = launcher(cli_args(cfg), tmp_path / "logs")
    try:
        deadline = time.monotonic() + 240
        while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        pids = job_pids(cfg.out)
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL
    assert "process 1 exited with code 137; stopping the others" in out
    time.sleep(0.5)
    assert job_pids(cfg.out) == {}  # no orphans
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert saved and all(s % 2 == 0 for s in saved)
    last = saved[-1]
    summary = train.train(MODEL, dataclasses.replace(cfg, steps=last + 2), resume=True,
                          sample=False)
    assert summary["step"] == last + 2
    assert len(losses(tmp_path / "run")) == last + 2
