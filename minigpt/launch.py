"""Try a multi-process job on one machine: `python -m minigpt.launch --processes 2 -- <train args>`.

The launcher starts `--processes` copies of `python -m minigpt.train` on 127.0.0.1, each with
`--devices-per-process` simulated CPU devices, joined into one JAX job through a coordinator on a
free local port. Together they form one mesh of processes x devices, exactly as the hosts of a
TPU pod slice or a GPU cluster do, so every preset runs across process boundaries here.

Process 0's output is streamed; the others write to log files in a temporary folder, and the
tail of a failing process's log is printed. If any process fails, the launcher stops all the
others and exits with the failing process's code; Ctrl-C stops them all. Nothing is left
running: the processes also die with the launcher if it is killed. Checkpoints are written
only when complete, so the last one survives any of this and `--resume` continues from it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

GRACE_SECONDS = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_command(train_args: Sequence[str], *, index: int, processes: int, devices: int,
                    port: int) -> list[str]:
    return [sys.executable, "-m", "minigpt.train", *train_args,
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
            "--process-id", str(index), "--devices", str(devices)]


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    with contextlib.suppress(OSError, AttributeError):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128 + N


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    return ""


def launch(train_args: Sequence[str], *, processes: int, devices_per_process: int,
           port: int | None = None, log_dir: Path | None = None) -> int:
    """Run the job; return 0 when every process succeeds, else the first failure's exit code."""
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="minigpt-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs = []
    preexec = _die_with_parent if sys.platform == "linux" else None
    try:
        for i in range(processes):
            cmd = process_command(train_args, index=i, processes=processes,
                                  devices=devices_per_process, port=port)
            if i == 0:
                out = None  # inherit: process 0 speaks for the job
            else:
                out = open(log_dir / f"process_{i}.log", "wb")  # noqa: SIM115
                logs.append(out)
            # A session of their own: Ctrl-C reaches the launcher, which stops them all together.
            err = subprocess.STDOUT if out else None
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                          preexec_fn=preexec))
        print(f"launched {processes} processes x {devices_per_process} devices "
              f"(coordinator 127.0.0.1:{port}; logs of processes 1.. in {log_dir})",
              file=sys.stderr, flush=True)
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                print(f"launch: process {index} exited with code {_exit_code(code)}; "
                      f"stopping the others", file=sys.stderr, flush=True)
                _stop_all(procs)
                if index > 0:
                    tail = _tail(log_dir / f"process_{index}.log")
                    print(f"--- last lines of process {index} ---\n{tail}", file=sys.stderr)
                return _exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("\nlaunch: interrupted; stopping all processes (resume from the last checkpoint "
              "with --resume)", file=sys.stderr, flush=True)
        _stop_all(procs)
        return 130
    finally:
        _stop_all(procs)
        for f in logs:
            f.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(
        prog="python -m minigpt.launch", description=__doc__.split("\n")[0],
        epilog="example: python -m minigpt.launch --processes 2 --devices-per-process 4 -- "
               "--preset fsdp --model minigpt-tiny --steps 50")
    p.add_argument("--processes", type=int, default=2, help="number of processes (default 2)")
    p.add_argument("--devices-per-process", type=int, default=4,
                   help="simulated CPU devices in each process (default 4)")
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument("--log-dir", help="where processes 1.. write their output (default: a "
                                     "temporary folder)")
    args = p.parse_args(own)
    if args.processes < 1 or args.devices_per_process < 1:
        p.error("--processes and --devices-per-process must be at least 1")
    clashing = {"--coordinator", "--num-processes", "--process-id", "--devices"} & {
        a.split("=")[0] for a in train_args}
    if clashing:
        p.error(f"the launcher sets {', '.join(sorted(clashing))} itself; leave them out of the "
                f"training arguments")
    return launch(train_args, processes=args.processes,
                  devices_per_process=args.devices_per_process, port=args.port,
                  log_dir=Path(args.log_dir) if args.log_dir else None)


if __name__ == "__main__":
    sys.exit(main())
