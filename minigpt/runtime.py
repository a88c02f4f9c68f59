"""Process set-up for the command-line entry points, before JAX starts its backends.

- `set_simulated_devices(n)`: make JAX see n CPU devices, so every preset can be tried on a
  laptop (`--devices 8`).
- `join_job(...)`: join a multi-process JAX job (several hosts, or several processes on one
  machine), before anything else touches the devices.
- `log(...)`: print from process 0 only, so a multi-process job prints each line once.
- `StopOnInterrupt`: the first Ctrl-C becomes a request a loop honours at a safe point.
- `relaunch_with_huge_pages()`: on Linux with glibc, restart the process once with
  `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. XLA's CPU backend allocates every large temporary
  buffer afresh on each step; with ordinary 4 KiB pages the kernel then spends much of the step
  zero-filling pages on first touch. Transparent huge pages cut that cost 512-fold: a CPU train
  step of `minigpt` runs 15-25% faster (bench/RESULTS.md). A trainer in the restarted process
  says so once, among its first lines (`huge_pages_note`); errors and help say nothing of it.
  It restarts only where that changes something: not for `--help`, not where the kernel's
  transparent huge pages are off, not with an accelerator attached (the steps do not
  run on the CPU there). `MINIGPT_HUGE_PAGES=0` turns it off; setting GLIBC_TUNABLES yourself,
  to anything, leaves your setting alone.
- `has_accelerator()`: whether a GPU or TPU is attached, asked without starting JAX.
- `set_gpu_flags()`: on an NVIDIA GPU, the XLA flags that speed up a training step, added to
  XLA_FLAGS before JAX starts without overriding any the user set, and said in the run's first
  lines (`gpu_flags_note`).
- `device_memory()`, `check_fits(...)`: the bytes one device may hold, and the refusal of a
  model (or adapters, or optimizer) whose weights alone exceed them, before anything is
  allocated.
- `plain_warnings()`: inside it, a Python warning reaches the user as one line on stderr,
  `warning: ...`, not with the source line that raised it (every command line runs in it).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from minigpt.config import ConfigError

if TYPE_CHECKING:
    from minigpt.sharding import Layout

HUGE_PAGES = "glibc.malloc.hugetlb=1"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_RELAUNCHED = "_MINIGPT_RELAUNCHED_WITH_HUGE_PAGES"  # set for the restarted process only


def log(*args) -> None:
    """Print from process 0 only, so a multi-process job prints each line once."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def set_simulated_devices(count: int) -> None:
    """Make JAX see `count` CPU devices; must run before JAX starts its backends."""
    try:
        jax.config.update("jax_num_cpu_devices", count)  # JAX refuses once its backends run
    except RuntimeError:
        raise RuntimeError("simulated devices must be set before JAX starts; it already has "
                           "(set them before anything asks JAX for its devices)") from None
    jax.config.update("jax_platforms", "cpu")


def device_memory() -> int | None:
    """Bytes one device may hold: an accelerator's own memory (its allocator's limit), or on
    the CPU the machine's physical memory shared by its (simulated) devices; None where it
    cannot be told."""
    devices = jax.local_devices()
    if devices[0].platform != "cpu":
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
        if all(limits):
            return min(limits)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that says
        return None
    return total // len(devices)


def check_fits(layout: Layout, states: list, *, what: str, hint: str) -> None:
    """Refuse (ConfigError, one line) what cannot fit the devices, from shapes alone, before
    anything is allocated: the bytes one device holds of `states` (abstract NNX states: the
    weights, and for training their gradients and the optimizer's state) laid out by `layout`,
    against a device's memory (`device_memory`). A lower bound of what a run needs:
    the activations of a step come on top (`minigpt.plan` estimates those); this catches a
    size no machine can hold (a rank of a billion, a width from a damaged file) before JAX
    tries to allocate it."""
    from minigpt import sharding  # the layout's bytes per device; it imports nothing of ours

    have = device_memory()
    need = sum(row["bytes_per_device"] for state in states
               for row in sharding.describe(layout, state))
    if have is not None and need > have:
        raise ConfigError(f"{what} needs {need / 2**30:,.1f} GiB on each device under preset "
                          f"{layout.name} for its weights{' and optimizer' * (len(states) > 1)} "
                          f"alone, more than a device here has ({have / 2**30:,.1f} GiB): "
                          f"{hint}")


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


_relaunched = []  # [True] in a process restarted with huge pages, until the note is taken


def relaunch_with_huge_pages() -> None:
    """Replace this process by the same command with huge pages for malloc (see above); the
    restarted process remembers it (`huge_pages_note`) and says nothing yet: a command that
    then fails, or prints its help, should not talk about memory pages."""
    if os.environ.pop(_RELAUNCHED, None):
        _relaunched.append(True)
        return
    libc, version = platform.libc_ver()
    if (sys.platform != "linux" or libc != "glibc" or "GLIBC_TUNABLES" in os.environ
            or os.environ.get("MINIGPT_HUGE_PAGES") == "0"
            or tuple(int(v) for v in version.split(".")[:2]) < (2, 35)
            or {"-h", "--help"} & set(sys.argv[1:]) or not _huge_pages_available()
            or has_accelerator()):
        return
    env = {**os.environ, "GLIBC_TUNABLES": HUGE_PAGES, _RELAUNCHED: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def huge_pages_note() -> str | None:
    """Once, in a process restarted with huge pages: the line that says so (a trainer shows it
    among its first lines); else None."""
    if not _relaunched:
        return None
    _relaunched.clear()
    return (f"note: restarted with huge pages for malloc (GLIBC_TUNABLES={HUGE_PAGES}), which "
            f"makes CPU steps 15-25% faster; MINIGPT_HUGE_PAGES=0 turns this off")


@contextlib.contextmanager
def plain_warnings():
    """Show warnings as one line, `warning: <message>`, on stderr while the block runs."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _huge_pages_available() -> bool:
    """Whether the kernel gives transparent huge pages to a process that asks (the setting is
    `always` or `madvise`, not `never`)."""
    try:
        return "[never]" not in TRANSPARENT_HUGE_PAGES.read_text()
    except OSError:
        return False


# XLA flags for one NVIDIA GPU's training step, set before JAX starts (`set_gpu_flags`). They
# are MaxText's GPU defaults: the latency-hiding scheduler (it overlaps collectives and copies
# with compute) and cuBLAS rather than Triton for matrix products. NOT YET MEASURED HERE: the
# next GPU session's accelerator check times the step with and without each
# (bench/bench_gpu_step.py's variants) and keeps only what measures faster.
GPU_FLAGS = {"--xla_gpu_enable_latency_hiding_scheduler": "true",
             "--xla_gpu_enable_triton_gemm": "false"}
_gpu_flags_set: list[str] = []  # what set_gpu_flags added, for the run's first lines


def set_gpu_flags() -> list[str]:
    """On a machine with an NVIDIA GPU, add `GPU_FLAGS` to XLA_FLAGS before JAX starts, never
    overriding a flag the user set there (to anything); returns (and keeps for
    `gpu_flags_note`) the flags added. Elsewhere nothing. `MINIGPT_GPU_FLAGS=0` turns it off."""
    if shutil.which("nvidia-smi") is None or os.environ.get("MINIGPT_GPU_FLAGS") == "0":
        return []
    present = os.environ.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value in GPU_FLAGS.items() if flag not in present]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([present, *added]).strip()
        _gpu_flags_set[:] = added
    return added


def gpu_flags_note() -> str | None:
    """The line that says which XLA flags minigpt set for the GPU (None: none)."""
    if not _gpu_flags_set:
        return None
    return (f"note: XLA flags for the GPU, added to XLA_FLAGS: {' '.join(_gpu_flags_set)} "
            f"(yours are kept; MINIGPT_GPU_FLAGS=0 adds none)")


def has_accelerator() -> bool:
    """A GPU or TPU is attached (checked without starting JAX, which would fix the devices)."""
    return (shutil.which("nvidia-smi") is not None or Path("/dev/accel0").exists()
            or "COLAB_TPU_ADDR" in os.environ)


class StopOnInterrupt:
    """Turn the first Ctrl-C into a request the loop honours at a safe point (after a step has
    been dispatched), so the checkpoint it saves is consistent; a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
        print("\ninterrupted: finishing the current step and saving a checkpoint "
              "(Ctrl-C again to quit without saving)", flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class NoInterrupts(contextlib.nullcontext):
    """Where Ctrl-C cannot be honoured at a safe point (a multi-process job stops as a whole)."""

    requested = False

    def __enter__(self):
        return self
