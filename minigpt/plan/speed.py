"""A speed estimate per preset: enough to rank presets, not to promise seconds.

A step's time is taken as the sum of three parts, each from what the preset makes one device do:

- compute: the step's FLOPs (`minigpt.models.flops`: 6 per weight and token, attention, the
  head), a device's share of them, plus the forward recomputed under remat and in a pipeline
  stage's backward, over the device's peak FLOP/s; a pipeline on real devices also waits its
  bubble, (S - 1) / (R M + S - 1) of the step;
- memory: the optimizer's update, which reads and writes every weight it keeps (a replicated
  optimizer state does so on every device), over the memory bandwidth;
- communication: the bytes each collective moves through one device's links (ring
  algorithms: an all-reduce of n bytes over k devices moves 2 n (k - 1) / k), over the link
  bandwidth, plus a latency per collective: gradients summed over the replicas of a weight
  (data parallelism), weights gathered in the forward and backward and gradients
  reduce-scattered (FSDP), activations summed after the split projections (tensor
  parallelism), stage activations and gradients passed on (pipelines), keys and values round
  the ring (context parallelism), tokens to their experts and back (expert parallelism).

Peaks and bandwidths: for GPUs and TPUs from data sheets (named in the output); on a CPU
measured once in the process (a matmul and a copy, a few milliseconds). Simulated devices share
the one machine: each is given 1/N of its peak and bandwidth, so the estimate ranks presets by
the work all of them do together, which is what a simulated step's time measures.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp

import minigpt.models.flops as flops
import minigpt.plan.layout as layouts
from minigpt import pipeline, sharding
from minigpt.config import ConfigError

# Memory and interconnect bandwidth per device (bytes/s) from data sheets: HBM, and NVLink (or
# PCIe where a card has none) one way, or a TPU chip's inter-chip links.
DATA_SHEETS: dict[str, tuple[float, float]] = {
    "NVIDIA H100": (3.35e12, 450e9),
    "NVIDIA H200": (4.8e12, 450e9),
    "NVIDIA A100": (2.0e12, 300e9),
    "NVIDIA L4": (0.3e12, 32e9),
    "Tesla T4": (0.32e12, 16e9),
    "TPU v4": (1.2e12, 270e9),
    "TPU v5 lite": (0.82e12, 200e9),
    "TPU v5e": (0.82e12, 200e9),
    "TPU v5p": (2.76e12, 600e9),
    "TPU v6 lite": (1.64e12, 450e9),
    "TPU v6e": (1.64e12, 450e9),
}
# Seconds each collective costs beyond its bytes: a launch and a handshake.
LATENCY = {"cpu": 30e-6, "gpu": 10e-6, "tpu": 5e-6}
# Bytes the optimizer reads and writes per trained weight per step: AdamW reads the weight, its
# gradient and two moments and writes the weight and the moments (7 float32), and clipping
# reads the gradient again.
UPDATE_BYTES = 32


@dataclasses.dataclass(frozen=True)
class Device:
    """What one device can do, and where the numbers come from."""

    kind: str
    platform: str  # "cpu", "gpu" or "tpu"
    peak: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s
    source: str
    shared: bool = False  # simulated devices sharing one machine's cores and memory

    def describe(self) -> str:
        if self.shared:
            return f"{self.kind}: {self.source}"
        return (f"{self.kind}: {self.peak / 1e12:.0f} TFLOP/s, memory "
                f"{self.memory_bandwidth / 1e12:.2f} TB/s, links "
                f"{self.link_bandwidth / 1e9:.0f} GB/s per device ({self.source})")


@dataclasses.dataclass(frozen=True)
class Speed:
    """Estimated seconds per step and their parts."""

    seconds: float
    compute: float
    memory: float
    communication: float
    bubble: float  # the share of the step a pipeline stage waits (0 without one)


def device(kind: str | None = None, dtype: str = "float32", devices: int = 1) -> Device:
    """The device a plan is for: `kind` names a data-sheet kind ("NVIDIA H100", "TPU v5e",
    "cpu"); default the devices present. Simulated CPU devices share the machine."""
    if kind is None:
        present = jax.devices()[0]
        kind = present.device_kind if present.platform != "cpu" else "cpu"
    if dtype == "auto":  # as `minigpt.models.kernels.compute_dtype` resolves it there
        dtype = "float32" if kind.lower() == "cpu" else "bfloat16"
    if kind.lower() == "cpu":
        peak, bandwidth = _measured(dtype)
        n = max(devices, 1)
        return Device(kind="cpu", platform="cpu", peak=peak / n, memory_bandwidth=bandwidth / n,
                      link_bandwidth=bandwidth / n, shared=n > 1,
                      source=f"{peak / 1e9:.0f} GFLOP/s ({dtype} matmul) and "
                             f"{bandwidth / 1e9:.1f} GB/s (copy) measured here"
                             + (f", shared by {n} simulated devices" if n > 1 else ""))
    for name, peaks in flops.KNOWN_PEAKS.items():
        if kind.startswith(name) and name in DATA_SHEETS:
            memory, link = DATA_SHEETS[name]
            platform = "tpu" if name.startswith("TPU") else "gpu"
            return Device(kind=kind, platform=platform, peak=peaks[dtype],
                          memory_bandwidth=memory, link_bandwidth=link, source="data sheet")
    known = ", ".join(n for n in flops.KNOWN_PEAKS if n in DATA_SHEETS)
    raise ConfigError(f"--device-kind {kind!r}: no data sheet for it; name one of cpu, {known}")


@functools.cache
def _measured(dtype: str) -> tuple[float, float]:
    """(FLOP/s of a 1024 x 1024 matmul, bytes/s of a 64 MiB copy) on this machine: small and
    quick, the best of a few runs."""
    a = jnp.ones((1024, 1024), dtype)
    x = jnp.ones((16 * 2**20,), jnp.float32)
    matmul, copy = jax.jit(lambda a: a @ a), jax.jit(lambda x: x * 2.0)
    return (2 * 1024**3 / _best(matmul, a), 2 * x.nbytes / _best(copy, x))


def _best(fn, x, repeats: int = 5) -> float:
    fn(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def estimate(subject, layout, dev: Device) -> Speed:
    """Seconds per step under `layout` on devices like `dev` (see the module docstring)."""
    cfg, train_cfg = subject.model_cfg, subject.train_cfg
    T = subject.seq_len
    tokens = train_cfg.batch_size * T
    per_token = flops.flops_per_token(cfg, T)
    head = 6.0 * cfg.embed_dim * cfg.vocab_size
    blocks = per_token - head
    if train_cfg.lora_rank:  # no weight gradients for the frozen base: 4 FLOPs, not 6
        blocks, head = blocks * 4 / 6, head * 4 / 6
    recompute = blocks / 3 if (cfg.remat_policy == "full" or layout.stages > 1) else 0.0
    work = (blocks + head + recompute) * tokens / layout.devices
    bubble = 0.0
    if layout.stages > 1:
        S, M, R = layout.stages, layout.pipeline.microbatches, layout.pipeline.repeats
        bubble = (S - 1) / (R * M + S - 1)
    # The stages wait for each other at every tick (their activations pass by collective
    # permutes), simulated devices as much as real ones.
    compute = work / dev.peak / (1.0 - bubble)
    trained = layouts.state_bytes(layout, subject.trainable)
    memory = trained / 4 * UPDATE_BYTES / dev.memory_bandwidth
    moved, count = _collectives(subject, layout)
    communication = moved / dev.link_bandwidth + count * LATENCY[dev.platform]
    return Speed(seconds=compute + memory + communication, compute=compute, memory=memory,
                 communication=communication, bubble=bubble)


def _collectives(subject, layout) -> tuple[float, int]:
    """(bytes through one device's links, number of collectives) in one step."""
    cfg, train_cfg = subject.model_cfg, subject.train_cfg
    mesh, preset = layout.mesh, layout.preset
    data_axes = set(preset.mesh_axes_of("batch")) | set(preset.mesh_axes_of("seq"))
    expert_axes = set(preset.mesh_axes_of("expert"))
    trained = {r["name"] for r in sharding.describe(layout.layout, subject.trainable)}
    gathers = 3 if cfg.remat_policy == "full" else 2  # forward, backward (remat's recompute)
    moved, count = 0.0, 0
    for r in sharding.describe(layout.layout, subject.params):
        local = r["bytes_per_device"]
        split = {a for entry in r["spec"] for a in sharding.mesh_axes_in(entry)}
        sharded = [a for a in split & data_axes if a not in expert_axes]
        replicas = [a for a in data_axes - split]
        f = math.prod(mesh.shape[a] for a in sharded)
        n = math.prod(mesh.shape[a] for a in replicas)
        # a stacked weight is gathered (and its gradient scattered) a layer at a time
        layers = r["shape"][0] // layout.stages if r["axes"][:1] == ("layers",) else 1
        if f > 1:  # FSDP: gathered for each use, the gradient reduce-scattered
            moved += gathers * (f - 1) * local
            count += gathers * layers
        if r["name"] in trained:
            if f > 1:
                moved += (f - 1) * local
                count += layers
            if n > 1:
                moved += 2 * (n - 1) / n * local
                count += 1
        if layout.stages > 1 and r["axes"][:1] != ("layers",) and r["name"] in trained:
            moved += 2 * (layout.stages - 1) / layout.stages * local  # summed over stages
            count += 1
    act = jnp.dtype(cfg.dtype).itemsize
    x = layout.rows * layout.positions * cfg.embed_dim * act  # one piece's [b, t, D]
    pieces = train_cfg.microbatches * max(layout.pipeline.microbatches, 1)
    layers = cfg.num_layers // layout.stages
    m = layout.model_ways
    if m > 1:  # two sums per layer forward, two backward, the embedding's and the head's
        moved += (4 * layers + 2) * 2 * (m - 1) / m * x * pieces
        count += (4 * layers + 2) * pieces
    c = layout.seq_ways
    if c > 1:
        kv = layout.rows * layout.positions * layout.kv_heads * cfg.head_dim * act * 2
        hops = (c - 1) * 3 if train_cfg.context_strategy == "ring" else (c - 1) * 2
        moved += cfg.num_layers * hops * kv * pieces
        count += cfg.num_layers * (3 * c if train_cfg.context_strategy == "ring" else 3) * pieces
    e = math.prod(mesh.shape[a] for a in expert_axes & data_axes)
    if cfg.num_experts and e > 1:  # tokens to their experts and back, forward and backward
        moved += cfg.num_layers * 4 * (e - 1) / e * x * cfg.experts_per_token * pieces
        count += cfg.num_layers * 4 * pieces
    if layout.stages > 1:
        S = layout.stages
        ticks = _ticks(layout)
        moved += 2 * ticks * x * train_cfg.microbatches + 2 * (S - 1) / S * x * pieces
        count += 2 * ticks * train_cfg.microbatches + 2 * pieces
    return moved, count


def _ticks(layout) -> int:
    return pipeline.table(layout.pipeline, layout.stages).ticks
