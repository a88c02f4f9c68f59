"""One trainer per run directory: a lock file naming the process that trains the run.

`<run>/trainer.lock` holds the holder's host, process id and start time as JSON. It is created
with O_EXCL, so of two trainers starting together exactly one gets it; the other is refused at
once with the holder's name, and touches nothing of the run. The holder removes it however the
run ends (finished, failed, Ctrl-C). A holder that can no longer remove it (SIGKILL, a lost
machine) leaves it behind, and the next trainer takes it over when the holder is gone:

- on the same host, when no process with the holder's pid and start time is running;
- from another host (a run directory on shared storage), when the holder has not refreshed the
  file for `STALE_AFTER` seconds: a holder refreshes it every `HEARTBEAT` seconds while it
  trains.

A take-over renames the stale file aside first: of two trainers taking over together, only one
rename succeeds, and the loser finds the winner's fresh lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from minigpt.errors import UserError
from minigpt.runs import LOCK

LOCK_NAME = LOCK  # trainer.lock, named by minigpt.runs
GARBAGE: dict[str, Any] = {"garbage": True}  # what an unreadable lock holds, by identity
HEARTBEAT = 10.0
STALE_AFTER = 60.0


class RunLocked(UserError, RuntimeError):
    """Another trainer holds the run directory; the message names it."""


def _start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: field 22 of /proc/<pid>/stat), to tell a reused pid
    from the holder; None where that cannot be read."""
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    return None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder on this host is still running."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    started = holder.get("process_started")
    return started is None or _start_time(pid) in (None, started)


def describe(holder: dict[str, Any]) -> str:
    return (f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (started "
            f"{holder.get('since', 'at an unknown time')})")


class RunLock:
    """The lock of one run directory, taken by `acquire()` and given back by `release()` (also
    as a context manager)."""

    def __init__(self, run_dir: str | Path, *, heartbeat: float = HEARTBEAT,
                 stale_after: float = STALE_AFTER):
        self.path = Path(run_dir) / LOCK_NAME
        self.heartbeat, self.stale_after = heartbeat, stale_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict[str, Any] | None = None  # the holder a take-over replaced
        self._made_directory = False

    def _content(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "process_started": _start_time(pid),
                "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._content(), f)
        return True

    def _holder(self, path: Path | None = None) -> dict[str, Any] | None:
        """What the lock file says: {} if it cannot be read yet (being written), GARBAGE if
        it never will be (bytes that are no lock's beginning: no JSON object, or a host and pid
        of the wrong types), None if gone. Anything else that is not a lock minigpt writes (a
        directory, a JSON list...) is refused and left as it is: it is the user's."""
        path = path or self.path
        try:
            if not path.is_file() and path.exists():
                raise self._foreign("is not a file")
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            holder = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, RecursionError):
            return GARBAGE
        except ValueError:  # a lock being written begins with "{"; what does not, never will
            return {} if raw.lstrip()[:1] in (b"", b"{") else GARBAGE
        if not isinstance(holder, dict) or not {"host", "pid"} <= set(holder):
            raise self._foreign("does not hold what a minigpt trainer writes (its host and pid)")
        if not isinstance(holder["host"], str) or not isinstance(holder["pid"], int):
            return GARBAGE
        return holder

    def _foreign(self, why: str) -> RunLocked:
        return RunLocked(f"{self.path} {why}, so it is not a lock minigpt wrote; it is left "
                         f"as it is: move it out of the run directory, then train again")

    def _age(self) -> float:
        """Seconds since the holder last refreshed the lock file."""
        with contextlib.suppress(FileNotFoundError):
            return time.time() - self.path.stat().st_mtime
        return float("inf")

    def _gone(self, holder: dict[str, Any]) -> bool:
        if holder is GARBAGE:  # no trainer wrote this, or one was cut off mid-write long ago
            return True
        if not holder:  # unreadable: being written this instant, or its writer died doing it
            return self._age() > 5.0
        if holder.get("host") == socket.gethostname():
            return not _alive(holder)
        return self._age() > self.stale_after

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunLocked naming the holder (or the reason it cannot be
        written: a read-only or full disk, a folder of someone else's)."""
        self._made_directory = not self.path.parent.exists()
        try:
            for _ in range(10):
                if self._try():
                    self._start_heartbeat()
                    return self
        except OSError as error:
            raise RunLocked(f"cannot write {self.path} ({error.strerror}): a run is trained in a "
                            f"directory it may write") from None
        raise RunLocked(f"could not take {self.path} after several tries: other trainers are "
                        f"starting on this run at the same time")

    def _try(self) -> bool:
        """One attempt: create the lock, or take over a gone holder's (then False: try
        again); RunLocked where a live trainer holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._create():
            return True
        holder = self._holder()
        if holder is None:
            return False  # released meanwhile: try again
        if not self._gone(holder):
            raise RunLocked(
                f"{self.path.parent} is being trained by {describe(holder)}: wait for it to "
                f"finish or stop it; if that process is gone for good, delete {self.path}")
        self._take_over(holder)
        return False

    def _take_over(self, holder: dict[str, Any]) -> None:
        """Remove a gone holder's lock file, unless another trainer replaced it meanwhile."""
        aside = self.path.with_name(f"{LOCK_NAME}.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)  # of several trainers doing this, one succeeds
        except FileNotFoundError:
            return
        moved = None
        with contextlib.suppress(OSError, RunLocked):
            moved = self._holder(aside)
        if moved == holder or (holder is GARBAGE and moved is GARBAGE):
            self.took_over = holder
        else:  # a fresh lock another trainer wrote after we looked: give it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.heartbeat):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="minigpt-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lock back (only if this process still holds it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            holder = self._holder()
        except RunLocked:  # something not ours replaced the lock: it is not ours to remove
            return
        if holder and holder.get("pid") == os.getpid() and \
                holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
            if self._made_directory:  # a run refused before writing anything leaves no trace
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold_run_lock(run_dir: str | Path, say: Callable[[str], Any] = print) -> Iterator[RunLock]:
    """Hold a run directory's lock while the block runs. In a multi-process job process 0 takes
    it and every process learns the outcome, so all of them stop when it is refused."""
    lock, error = RunLock(run_dir), None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except RunLocked as e:
            error = e
    if jax.process_count() > 1:
        refused = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if refused and error is None:
            error = RunLocked(f"process 0 could not take the lock of {run_dir}; see its message")
    if error is not None:
        raise error
    try:
        if lock.took_over is not None and {"host", "pid"} <= set(lock.took_over):
            say(f"took over {lock.path}: its holder, {describe(lock.took_over)}, is gone")
        elif lock.took_over is not None:
            say(f"took over {lock.path}: it held no lock a trainer could read (garbage, or a "
                f"trainer stopped while writing it)")
        yield lock
    finally:
        if jax.process_index() == 0:
            lock.release()
