"""One trainer per run directory: the lock refuses a second trainer by name, is given back on
every exit, and is taken over from a holder that is gone (killed, or on a lost machine)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, losses, refused, small_vocab

from minigpt import train
from minigpt.config import TrainConfig
from minigpt.train.lock import LOCK_NAME, RunLock, RunLocked

MODEL = small_vocab("minigpt-tiny")


def a_finished_pid() -> int:
    """The pid of a process that has already exited."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def write_holder(run: Path, **holder) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **holder}))
    return path


def test_a_second_lock_is_refused_naming_the_holder_and_released_locks_are_gone(tmp_path):
    (tmp_path / "run").mkdir()
    first = RunLock(tmp_path / "run").acquire()
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(RunLocked) as e:
        RunLock(tmp_path / "run").acquire()
    assert f"is being trained by process {os.getpid()} on {socket.gethostname()}" in str(e.value)
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    with RunLock(tmp_path / "run") as again:
        assert again.took_over is None
    assert (tmp_path / "run").is_dir()  # it held nothing but the lock, and was there before


def test_a_directory_made_only_to_hold_the_lock_goes_with_it(tmp_path):
    with RunLock(tmp_path / "new"):
        assert (tmp_path / "new" / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()


def test_the_lock_of_a_process_that_is_gone_is_taken_over(tmp_path):
    write_holder(tmp_path, pid=a_finished_pid())
    with RunLock(tmp_path) as lock:
        assert lock.took_over["pid"] != os.getpid()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    # A reused pid is told apart by its start time.
    write_holder(tmp_path, process_started="1")
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over is not None
    lock.release()


def test_a_holder_on_another_host_is_gone_when_it_stops_refreshing_the_lock(tmp_path):
    path = write_holder(tmp_path, host="elsewhere", pid=123)
    with pytest.raises(RunLocked, match="process 123 on elsewhere"):
        RunLock(tmp_path, stale_after=60).acquire()
    old = time.time() - 120
    os.utime(path, (old, old))
    lock = RunLock(tmp_path, stale_after=60).acquire()
    assert lock.took_over["host"] == "elsewhere"
    lock.release()


def test_the_holder_refreshes_its_lock_while_it_holds_it(tmp_path):
    with RunLock(tmp_path, heartbeat=0.05) as lock:
        old = time.time() - 120
        os.utime(lock.path, (old, old))
        time.sleep(0.5)
        assert time.time() - lock.path.stat().st_mtime < 5


def test_an_unreadable_lock_is_left_while_young_and_taken_over_when_old(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text('{"host": "half-wri')  # its writer died mid-write, or is writing now
    with pytest.raises(RunLocked):
        RunLock(tmp_path).acquire()
    old = time.time() - 60
    os.utime(path, (old, old))
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over == {}
    lock.release()


# Two real trainers -------------------------------------------------------------------------


@pytest.fixture
def command(data_4k, tmp_path):
    """A run of 40 steps of the tiny model (TinyStories vocabulary) that saves every 4, and its
    command line."""
    cfg = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(data_4k),),
                      out=str(tmp_path / "run"), steps=40, decay_steps=40, batch_size=8,
                      seq_len=32, lr=3e-3, warmup_steps=2, eval_every=100, eval_batches=1,
                      save_every=4, log_every=1)
    argv = ["--preset", "dp", "--model", "minigpt-tiny", "--data", str(data_4k), "--steps", "40",
            "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3", "--save-every", "4",
            "--set", "decay_steps=40", "--set", "warmup_steps=2", "--set", "eval_every=100",
            "--set", "eval_batches=1", "--set", "model.tokenizer=tinystories-4k",
            "--set", "model.vocab_size=4096", "--no-sample", "--out", cfg.out]
    return cfg, argv


def start_trainer(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "MINIGPT_HUGE_PAGES": "0"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "minigpt.train", *argv], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow  # two real trainers, one in another process: about a minute
def test_a_second_trainer_is_refused_and_the_first_finishes_as_if_alone(command, straight,
                                                                         tmp_path, capsys):
    cfg, argv = command
    first = start_trainer(argv, tmp_path / "first.log")
    run = Path(cfg.out)
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file(), first, tmp_path / "first.log")
        before = sorted(p.name for p in run.iterdir())
        err = refused(capsys, train.main([*argv, "--resume"]))
        assert err.startswith(
            f"error: {run} is being trained by process {first.pid} on {socket.gethostname()}")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
    assert set(before) - {LOCK_NAME} <= {p.name for p in run.iterdir()}  # nothing removed
    assert not (run / LOCK_NAME).exists()
    assert losses(run) == straight(MODEL, cfg)


@pytest.mark.slow
def test_resume_takes_over_from_a_killed_trainer(command, straight, tmp_path, capsys):
    cfg, argv = command
    first = start_trainer(argv, tmp_path / "first.log")
    run = Path(cfg.out)
    try:
        wait_for(lambda: (run / "checkpoints" / "4").is_dir(), first, tmp_path / "first.log")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == first.pid  # left behind
    assert train.main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"took over {run / LOCK_NAME}: its holder, process {first.pid} on " in out
    assert losses(run) == straight(MODEL, cfg)
    assert not (run / LOCK_NAME).exists()
