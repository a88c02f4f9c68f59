"""What every benchmark shares: a description of the machine and appending to RESULTS.md.

Each benchmark prints a section and appends it to bench/RESULTS.md with the exact command, the
machine and the date, so every recorded figure says where it came from.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
