"""What a step costs and what a device can do: model FLOPs per token, and the peak FLOP/s that
MFU (model FLOPs utilisation) is measured against.

MFU is the FLOPs the model needs per token, times tokens per second, over the peak FLOP/s of the
devices. Peaks come from a table of known accelerators' data sheets; on a CPU or any device not
in the table the peak is a large matmul timed once per machine and kept in a small JSON file
(`peaks_file`), so a run does not measure it again under its own load (a peak measured while the
machine is busy comes out low, and MFU above 1 with it). An MFU above 1 is impossible: a rate
above the peak proves the peak low, and `Peak.mfu` raises it to that rate, says so once and keeps
the raised figure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from minigpt.config import ModelConfig
from minigpt.files import write_text_atomic
from minigpt.models import family_of

# Dense peak FLOP/s per device (one chip, or one GPU) by compute dtype, from vendor data sheets.
# float32 entries are what XLA uses for float32 matmuls by default (TF32 on NVIDIA GPUs, bf16
# passes on TPUs).
KNOWN_PEAKS: dict[str, dict[str, float]] = {
    "TPU v2": {"bfloat16": 45e12, "float32": 45e12},
    "TPU v3": {"bfloat16": 123e12, "float32": 123e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5e": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12},
    "TPU v6e": {"bfloat16": 918e12, "float32": 918e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "NVIDIA H100": {"bfloat16": 989e12, "float32": 494e12},
    "NVIDIA H200": {"bfloat16": 989e12, "float32": 494e12},
    "NVIDIA A100": {"bfloat16": 312e12, "float32": 156e12},
    "NVIDIA L4": {"bfloat16": 121e12, "float32": 60e12},
    "Tesla T4": {"bfloat16": 65e12, "float32": 8.1e12},
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward and backward) plus attention.

    Embedding lookups are not matmuls and are left out; the output head is counted. A mixture
    of experts counts the experts a token uses, not all of them. Attention
    scores and the weighted sum cost 2 * 2 * T * D per layer forward, x3 with the backward pass;
    half of it is masked by causality but computed all the same, so it counts in full.
    """
    D, F, L = cfg.embed_dim, cfg.mlp_dim, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = D * q * 2 + D * kv * 2  # query and output, key and value
    mlp = D * F * (3 if family_of(cfg).gated_mlp else 2)  # SwiGLU and GeGLU have a gate
    if cfg.num_experts:  # a token's k experts, the shared expert and its gate, the router
        mlp = (3 * D * (cfg.experts_per_token * cfg.expert_dim + cfg.shared_expert_mlp_dim)
               + D * (cfg.num_experts + (1 if cfg.shared_expert_mlp_dim else 0)))
    matmul_params = L * (attention + mlp) + D * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * L * q * seq_len


def measure_matmul_peak(dtype: str = "float32", size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s one device reaches on a large square matmul: the best of `repeats` runs.
    bfloat16 operands accumulate in float32, as a model's products take them (`operand_dtype`
    in minigpt.models.execution)."""
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@dataclasses.dataclass
class Peak:
    """The peak FLOP/s of one device that MFU divides by, and where the figure comes from (`key`:
    its entry in the peaks file, where it was measured rather than read from a data sheet)."""

    flops: float
    source: str
    key: str | None = None
    raised: bool = False

    def mfu(self, achieved: float) -> float:
        """`achieved` FLOP/s per device over the peak, never above 1: a rate above the peak
        proves the figure low, so the peak rises to it (said once; kept in the peaks file where
        it was measured, so later runs start from it)."""
        if achieved > self.flops:
            if not self.raised:
                warnings.warn(
                    f"the step reached {achieved / 1e9:,.1f} GFLOP/s per device, above the peak "
                    f"MFU was taken against ({self.flops / 1e9:,.1f}: {self.source}), which was "
                    f"low; MFU is now against the fastest rate seen"
                    + (", kept for later runs" if self.key else ""), stacklevel=2)
            self.flops, self.raised = achieved, True
            if self.key:
                _keep_peak(self.key, achieved)
        return achieved / self.flops


def peaks_file() -> Path:
    """Where measured peaks are kept: $MINIGPT_CACHE_DIR/peaks.json, else under
    $XDG_CACHE_HOME/minigpt or ~/.cache/minigpt."""
    root = os.environ.get("MINIGPT_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minigpt"
    return Path(root) / "peaks.json"


def machine_key(kind: str, dtype: str) -> str:
    """What a measured peak belongs to: the CPU (model and cores), the device kind and how many
    devices this process has (simulated CPU devices share the cores), and the dtype."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores) | {kind} x{jax.device_count()} | {dtype}"


# The speedup of bfloat16 products over float32 ones at which a CPU run's `model.dtype` auto
# takes bfloat16 operands (minigpt.runs.resolved).
BFLOAT16_PAYS = 1.5


def bfloat16_speedup() -> tuple[float, str]:
    """How much faster this machine's products run with bfloat16 operands (float32
    accumulation) than in float32, and where the figure comes from: the two peaks of one
    device (`device_peak`), each measured once and kept; MINIGPT_BFLOAT16_SPEEDUP, where set,
    instead (how the tests keep float32 runs, and a machine whose measurement misleads can
    be told)."""
    given = os.environ.get("MINIGPT_BFLOAT16_SPEEDUP")
    if given:
        try:
            return float(given), "MINIGPT_BFLOAT16_SPEEDUP"
        except ValueError:
            warnings.warn(f"MINIGPT_BFLOAT16_SPEEDUP={given!r} is not a number: measured "
                          f"instead", stacklevel=2)
    ratio = device_peak("bfloat16").flops / device_peak("float32").flops
    return ratio, "the matmul peaks measured on this machine"


def _read_peaks() -> dict[str, float]:
    try:
        peaks = json.loads(peaks_file().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measured anew and rewritten
        return {}
    return peaks if isinstance(peaks, dict) else {}


def _keep_peak(key: str, value: float) -> None:
    try:
        peaks_file().parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(peaks_file(), json.dumps({**_read_peaks(), key: value}, indent=1))
    except OSError as error:  # a read-only home: the figure holds for this process only
        warnings.warn(f"cannot keep the measured peak in {peaks_file()}: {error}", stacklevel=2)


@functools.cache
def device_peak(dtype: str = "float32") -> Peak:
    """The peak FLOP/s of one device in `dtype`: a data sheet's, or (for a CPU and devices the
    table does not know) a matmul measured once on this machine and kept (`peaks_file`)."""
    kind = jax.devices()[0].device_kind
    for name, peaks in KNOWN_PEAKS.items():
        if kind.startswith(name):
            return Peak(peaks[dtype], f"{kind} data sheet")
    # bfloat16 products accumulate in float32 (measured so since 2026-12-02: a key of its own)
    key = machine_key(kind, "bfloat16 operands" if dtype == "bfloat16" else dtype)
    kept = _read_peaks().get(key)
    if isinstance(kept, int | float) and kept > 0:
        return Peak(float(kept), f"{kind}: {dtype} matmul measured on this machine, kept in "
                                 f"{peaks_file()}", key)
    measured = measure_matmul_peak(dtype)
    _keep_peak(key, measured)
    return Peak(measured, f"{kind}: {dtype} matmul measured now, kept in {peaks_file()}", key)
