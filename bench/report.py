"""What every benchmark shares: a description of the machine and appending to RESULTS.md.

Each benchmark prints a section and appends it to bench/RESULTS.md with the exact command, the
machine and the date, so every recorded figure says where it came from.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def timed(call: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """Call `call()` once to warm up, then `repeats` times, waiting for each result
    (`jax.block_until_ready`); returns the timed calls' seconds and the last result."""
    import jax

    result = jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times, result


def machine(cpuinfo: str | None = None) -> str:
    """Architecture, cores and CPU, with the family and vector width: the same "AMD EPYC" name
    covers virtual machines whose speeds differ fourfold, so each figure says which one it was."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    about = []
    if "cpu family" in fields and "model" in fields:
        about.append(f"family {fields['cpu family']} model {fields['model']}")
    if flags & {"avx512f", "avx2"}:
        about.append("AVX-512" if "avx512f" in flags else "AVX2")
    model = fields.get("model name", "") + (f" ({', '.join(about)})" if about else "")
    return f"{platform.machine()}, {os.cpu_count()} cores{', ' + model if model else ''}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |",
             "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def append_section(title: str, details: Sequence[str], body: Sequence[str],
                   results: Path = RESULTS) -> str:
    """Print a dated section (command, machine, details, body) and append it to RESULTS.md."""
    command = "python " + shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    load = os.getloadavg()[0]
    section = "\n".join([
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: {title}",
        "",
        f"- command: `{command}`",
        f"- machine: {machine()}; Python {platform.python_version()}; load average "
        f"{load:.2f} at start (the machine may be shared)",
        *[f"- {d}" for d in details],
        "",
        *body,
        "",
    ])
    print(section)
    if not results.exists():
        results.write_text(
            "# Benchmark results\n\nEach section is appended by the script it names, with the "
            "exact command, the machine and the date.\n\n")
    with open(results, "a") as f:
        f.write(section + "\n")
    return section
