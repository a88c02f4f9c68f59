"""How a model runs on a backend: the execution settings' "auto" made concrete, in one place.

A `ModelConfig` says what a model is and, in four fields, how it runs: `dtype`, `kernels`,
`scan_layers` and `remat` (and `fp8`, never "auto"). Each may be "auto", which `for_backend`
resolves for the backend the model is built on; `build_model` builds from the result, so the
layers read concrete values and never ask which backend runs. The rules, and what they rest on:

- dtype: float32 on a CPU (bfloat16 matmuls are no faster there), bfloat16 on an accelerator,
  whose matrix units run it at twice float32's rate or more; parameters and optimizer state
  stay float32 either way.
- kernels: the CPU-tuned set on a CPU, cuDNN's flash attention on GPUs, Splash on TPUs, the
  plain reference elsewhere (`minigpt.models.kernels`).
- scan_layers: scanned on a CPU, where a scan compiles fastest and the tutorial's shapes step
  no slower; unrolled on GPUs and TPUs: on an H200 (bench/RESULTS.md, 2026-11-27) unrolling
  took gpt2-small's step from 52.2 to 42.5 ms and stories-gpu's from 61 to 41 ms, and on an
  H100 the trainer went from 291,509 to 412,671 tokens/s for gpt2-small. (A scan with
  `unroll=k` was not measured faster on any shape tried; the rule stays two-valued until one
  is.)
- remat: "none" unless told otherwise: the one setting whose right value depends on memory,
  which the run's resolver (`minigpt.runs.resolved`) decides with the planner's estimate and passes
  in. Policies: "none" keeps everything, "minimal" keeps the outputs of the matmuls and
  recomputes the elementwise work and attention between them, "full" keeps each layer's input
  alone and recomputes the layer.
"""

from __future__ import annotations

import dataclasses

import jax

from minigpt.config import ModelConfig

# The kernel set "auto" means on each backend (`jax.default_backend()`); others: "reference".
AUTO_KERNELS = {"cpu": "cpu", "gpu": "cudnn", "tpu": "splash"}


def backend(platform: str | None = None) -> str:
    """The backend a model is resolved for: `platform`, or the one JAX runs here."""
    return platform or jax.default_backend()


def compute_dtype(choice: str, platform: str | None = None) -> str:
    """The dtype a `ModelConfig.dtype` value computes in on `platform` (default: here)."""
    if choice == "auto":
        return "float32" if backend(platform) == "cpu" else "bfloat16"
    return choice


def kernel_set(choice: str, platform: str | None = None) -> str:
    """The kernels a `ModelConfig.kernels` value means on `platform` (default: here)."""
    if choice == "auto":
        return AUTO_KERNELS.get(backend(platform), "reference")
    return choice


def scanned(choice: bool | str, platform: str | None = None) -> bool:
    """Whether the layers run as a scan: `scan_layers` as given, or (auto) on a CPU only."""
    if choice == "auto":
        return backend(platform) == "cpu"
    return bool(choice)


def for_backend(cfg: ModelConfig, platform: str | None = None, *,
                remat: str | None = None) -> ModelConfig:
    """`cfg` with its execution settings concrete for `platform` (default: the backend here):
    no field left "auto"; `remat` is the policy an "auto" one becomes (default "none")."""
    policy = cfg.remat_policy
    if policy == "auto":
        policy = remat or "none"
    return dataclasses.replace(cfg, dtype=compute_dtype(cfg.dtype, platform),
                               kernels=kernel_set(cfg.kernels, platform),
                               scan_layers=scanned(cfg.scan_layers, platform), remat=policy)


def remat_policy(policy: str):
    """The `jax.checkpoint` policy of a remat setting (None: no rematerialisation)."""
    if policy in ("none", "auto"):
        return None
    if policy == "minimal":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.nothing_saveable
