"""How a model runs on a backend: the execution settings' "auto" made concrete, in one place.

A `ModelConfig` says what a model is and, in four fields, how it runs: `dtype`, `kernels`,
`scan_layers` and `remat` (and `fp8`, never "auto"). Each may be "auto", which `for_backend`
resolves for the backend the model is built on; `build_model` builds from the result, so the
layers read concrete values and never ask which backend runs. The rules, and what they rest on:

- dtype: float32 on a CPU, bfloat16 on an accelerator, whose matrix units run it at twice
  float32's rate or more; parameters and optimizer state stay float32 either way. On a CPU,
  "bfloat16" means bfloat16 operands with float32 accumulation and float32 everywhere else
  (`operand_dtype`; activations, norms, softmax and loss in float32, `compute_dtype`): its
  bfloat16 products with float32 outputs run 3-6x float32's at the stories shape where
  bfloat16 outputs run below float32's, and bfloat16 elementwise work is slower than float32's
  (bench/RESULTS.md, 2026-12-02: the stories step 1.3x float32's this way, 1.08x with
  bfloat16 activations).
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


def resolved_dtype(choice: str, platform: str | None = None) -> str:
    """A `ModelConfig.dtype` value on `platform` (default: here), "auto" made concrete."""
    if choice == "auto":
        return "float32" if backend(platform) == "cpu" else "bfloat16"
    return choice


def compute_dtype(choice: str, platform: str | None = None) -> str:
    """The dtype a `ModelConfig.dtype` value computes in on `platform` (default: here): its
    activations, and what its products give. A CPU's bfloat16 computes in float32, its
    products taking bfloat16 operands (`operand_dtype`)."""
    dtype = resolved_dtype(choice, platform)
    return "float32" if dtype == "bfloat16" and backend(platform) == "cpu" else dtype


def operand_dtype(choice: str, platform: str | None = None) -> str:
    """The dtype the products of a model with this `ModelConfig.dtype` take their operands in,
    accumulating in `compute_dtype`."""
    return resolved_dtype(choice, platform)


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
    return dataclasses.replace(cfg, dtype=resolved_dtype(cfg.dtype, platform),
                               kernels=kernel_set(cfg.kernels, platform),
                               scan_layers=scanned(cfg.scan_layers, platform), remat=policy)


def remat_policy(policy: str):
    """The `jax.checkpoint` policy of a remat setting (None: no rematerialisation)."""
    if policy in ("none", "auto"):
        return None
    if policy == "minimal":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.nothing_saveable
