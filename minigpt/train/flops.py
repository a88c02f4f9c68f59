"""What a step costs and what a device can do: model FLOPs per token, and the peak FLOP/s that
MFU (model FLOPs utilisation) is measured against.

MFU is the FLOPs the model needs per token, times tokens per second, over the peak FLOP/s of the
devices. Peaks come from a table of known accelerators; on a CPU or any device not in the table
the peak is measured here with a large float32 matmul, and the log says so, because such a
figure is an estimate and not a vendor number.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from minigpt.config import ModelConfig

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
    mlp = D * F * (3 if cfg.arch == "llama" else 2)  # SwiGLU has a gate projection
    if cfg.num_experts:  # a token's k experts, the shared expert and its gate, the router
        mlp = (3 * D * (cfg.experts_per_token * cfg.expert_dim + cfg.shared_expert_mlp_dim)
               + D * (cfg.num_experts + (1 if cfg.shared_expert_mlp_dim else 0)))
    matmul_params = L * (attention + mlp) + D * cfg.vocab_size
    return 6.0 * matmul_params + 12.0 * L * q * seq_len


def measure_matmul_peak(dtype: str = "float32", size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s one device reaches on a large square matmul: the best of `repeats` runs."""
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@functools.cache
def device_peak(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from), measured once per process."""
    kind = jax.devices()[0].device_kind
    for name, peaks in KNOWN_PEAKS.items():
        if kind.startswith(name):
            return peaks[dtype], f"{kind} data sheet"
    return measure_matmul_peak(dtype), f"{kind}: measured {dtype} matmul (an estimate)"
