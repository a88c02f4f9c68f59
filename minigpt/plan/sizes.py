"""Memory sizes as people write them: `16GiB`, `80GB`, `512MiB`, `1.5TB`, or plain bytes.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000, as
device data sheets use both (an "80 GB" H100 reports 79.6 GiB). The device memory a plan is
judged against, when none is given: what the devices present report, or on a CPU the machine's
memory shared by its (simulated) devices.
"""

from __future__ import annotations

import os
import re

from minigpt.config import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# The sizes a device's memory may be given as: a mebibyte (less holds no model) to an exbibyte.
SMALLEST, LARGEST = 2**20, 2**60


def parse_size(text: str, what: str = "--device-memory") -> int:
    """Bytes from "16GiB", "80GB", "512MiB", "1.5TB" or "17179869184" (ConfigError otherwise,
    and for sizes outside 1 MiB to 1 EiB: a typo, not a device)."""
    match = re.fullmatch(r"\s*([0-9]{1,30}\.?[0-9]{0,30})\s*([a-zA-Z]*)\s*", str(text)[:100])
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS or match.group(1) in ("", "."):
        raise ConfigError(f"{what} {str(text)[:40]!r}: give a size such as 16GiB, 80GB or "
                          f"512MiB")
    size = float(match.group(1)) * UNITS[unit]
    if not SMALLEST <= size <= LARGEST:
        raise ConfigError(f"{what} {str(text)[:40]!r} is {format_size(size)}: a device's "
                          f"memory is between 1MiB and 1EiB; give a size such as 16GiB")
    return int(size)


def format_size(n: float) -> str:
    """1.23 GiB, 412.5 MiB, 86.0 KiB: binary units, three or four figures."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if abs(n) < 100 * scale else \
                f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def present_memory(devices: int) -> tuple[int, str]:
    """(bytes per device, where that comes from): the memory the first device present reports
    (an accelerator's), or on a CPU the machine's memory divided among `devices` devices."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"as {device.device_kind} reports it"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = total // max(devices, 1)
    return share, (f"this machine's {format_size(total)} shared by {devices} CPU devices "
                   f"(--device-memory to plan for others)")
