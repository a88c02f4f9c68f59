"""Process set-up for the command-line entry points, before JAX starts its backends.

- `set_simulated_devices(n)`: make JAX see n CPU devices, so every preset can be tried on a
  laptop (`--devices 8`).
- `join_job(...)`: join a multi-process JAX job (several hosts, or several processes on one
  machine), before anything else touches the devices.
- `relaunch_with_huge_pages()`: on Linux with glibc, restart the process once with
  `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. XLA's CPU backend allocates every large temporary
  buffer afresh on each step; with ordinary 4 KiB pages the kernel then spends much of the step
  zero-filling pages on first touch. Transparent huge pages cut that cost 512-fold: a CPU train
  step of `minigpt` runs 15-25% faster (bench/RESULTS.md). Setting GLIBC_TUNABLES yourself, to
  anything, opts out.
"""

from __future__ import annotations

import os
import platform
import sys

import jax

HUGE_PAGES = "glibc.malloc.hugetlb=1"


def set_simulated_devices(count: int) -> None:
    """Make JAX see `count` CPU devices; must run before JAX starts its backends."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("simulated devices must be set before JAX starts; it already has")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def join_job(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> None:
    """Join a multi-process job: `jax.distributed.initialize` with what is given, the rest read
    from the environment (JAX_COORDINATOR_ADDRESS, or what SLURM, Open MPI, Cloud TPU and
    Kubernetes set). On CPU the processes exchange data through gloo, so processes on one
    machine (or several) form one mesh."""
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def relaunch_with_huge_pages() -> None:
    """Replace this process by the same command with huge pages for malloc (see above)."""
    libc, version = platform.libc_ver()
    if (sys.platform != "linux" or libc != "glibc" or "GLIBC_TUNABLES" in os.environ
            or tuple(int(v) for v in version.split(".")[:2]) < (2, 35)):
        return
    env = {**os.environ, "GLIBC_TUNABLES": HUGE_PAGES}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
