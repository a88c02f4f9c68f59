"""A run's settings resolved once: every derived default turned into the value the run uses.

The configs say what a user asked for, with defaults that mean "work it out": a `seq_len` of 0
(the model's context), a `warmup_steps` of -1 (a tenth of the run, at most 100), "auto" dtype,
kernels, layer scan and remat, pipeline microbatches of 0 (two per stage), LoRA at rank 0 (no
adapters). This module is the one place that works them out; the rest of minigpt reads the
`Resolved` value a run makes once (`resolve`), and config.json records it beside what was
asked (`Resolved.record`), so a run says both what it was told and what it did.

Two of the decisions need more than the configs. How a step's memory compares with the device
is the planner's to estimate (`minigpt.plan`): it passes in the remat policy that fits. And the
warm-up of a run with a time budget is fixed when it starts, from the planner's estimate of
its step count, so the learning rate never jumps when the budget later fits the run's end.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minigpt import sharding
from minigpt.config import ModelConfig, TrainConfig
from minigpt.models import execution, flops, fp8, lora

# The longest default warm-up, in steps, and the share of the run it takes below that.
MAX_DEFAULT_WARMUP = 100
WARMUP_SHARE = 10


def seq_len(model_cfg: ModelConfig, train_cfg: TrainConfig) -> int:
    """The training window: `train.seq_len`, or (0) the model's context."""
    return train_cfg.seq_len or model_cfg.context_len


def warmup_steps(train_cfg: TrainConfig, horizon: int | None = None) -> int:
    """The warm-up steps of a run: as configured, or (-1) a tenth of its horizon (its decay's
    end, or its step count; `horizon` where a time budget estimates it), at most 100."""
    if train_cfg.warmup_steps >= 0:
        return train_cfg.warmup_steps
    horizon = horizon or train_cfg.decay_steps or train_cfg.steps
    return max(1, min(MAX_DEFAULT_WARMUP, horizon // WARMUP_SHARE))


def adapters(train_cfg: TrainConfig) -> lora.Adapters | None:
    """The low-rank adapters a run's training config asks for (None: rank 0, no adapters)."""
    if not train_cfg.lora_rank:
        return None
    lora.check_scale("train.lora_alpha", train_cfg.lora_alpha, train_cfg.lora_rank)
    return lora.Adapters(rank=train_cfg.lora_rank, alpha=train_cfg.lora_alpha,
                         targets=train_cfg.lora_targets, dropout=train_cfg.lora_dropout)


def layout_settings(train_cfg: TrainConfig) -> dict[str, Any]:
    """How the run's layout runs a pipeline and attention over a split sequence, as the train
    config asks (microbatches not yet resolved: that needs the stages)."""
    return {"pipeline": sharding.Pipeline(microbatches=train_cfg.pipeline_microbatches,
                                          schedule=train_cfg.pipeline_schedule,
                                          repeats=train_cfg.pipeline_repeats),
            "context_parallel": sharding.ContextParallel(strategy=train_cfg.context_strategy)}


def layout(model_cfg: ModelConfig, train_cfg: TrainConfig,
           on: sharding.Layout | None = None) -> sharding.Layout:
    """The run's layout: its preset over the devices (or `on`'s preset and mesh: an abstract
    mesh for a plan), with its pipeline and context-parallel settings, checked against the
    model and the batch (PresetError or ConfigError, one line, before anything compiles) and
    its pipeline's microbatches resolved."""
    on = on or sharding.Layout.make(train_cfg.preset)
    return on.replace(**layout_settings(train_cfg)).checked(
        model=train_cfg.model, num_layers=model_cfg.num_layers,
        batch_size=train_cfg.batch_size, accumulation=train_cfg.microbatches,
        seq_len=seq_len(model_cfg, train_cfg), num_experts=model_cfg.num_experts)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a run uses: the model config with its execution settings concrete for the backend,
    the window, the warm-up, the checked layout and the adapters."""

    model: ModelConfig
    seq_len: int
    warmup_steps: int
    layout: sharding.Layout
    adapters: lora.Adapters | None
    dtype_reason: str = ""  # why an "auto" dtype became what it is, where it was measured

    def record(self) -> dict[str, Any]:
        """What config.json records of it ("resolved"), beside what was asked."""
        pipe, context = self.layout.pipeline, self.layout.context_parallel
        return {"seq_len": self.seq_len, "warmup_steps": self.warmup_steps,
                "dtype": self.model.dtype, "kernels": self.model.kernels,
                "scan_layers": self.model.scan_layers, "remat": self.model.remat,
                "fp8": self.model.fp8, "preset": self.layout.name,
                "mesh": dict(self.layout.mesh.shape),
                "pipeline": {"microbatches": pipe.microbatches, "schedule": pipe.schedule,
                             "repeats": pipe.repeats} if self.layout.stages > 1 else None,
                "context_parallel": {"strategy": context.strategy, "balanced": context.balanced}
                if self.layout.ways("seq") > 1 else None,
                "lora": None if self.adapters is None else self.adapters.record()}


def resolve(model_cfg: ModelConfig, train_cfg: TrainConfig, layout: sharding.Layout, *,
            platform: str | None = None, remat: str | None = None,
            horizon: int | None = None) -> Resolved:
    """A run's settings, resolved once: the execution settings for `platform` (default: the
    backend here; `remat` is the policy an "auto" one becomes, the planner's choice), the
    window, the warm-up (over `horizon` steps where a time budget estimates them) and the
    adapters. `layout` is the run's, checked (`layout(...)`); FP8 where the devices have no
    FP8 products is refused here, before anything is written (`fp8.check`)."""
    fp8.check(model_cfg)
    dtype, reason = training_dtype(model_cfg.dtype, platform)
    return Resolved(model=execution.for_backend(dataclasses.replace(model_cfg, dtype=dtype),
                                                platform, remat=remat),
                    seq_len=seq_len(model_cfg, train_cfg),
                    warmup_steps=warmup_steps(train_cfg, horizon), layout=layout,
                    adapters=adapters(train_cfg), dtype_reason=reason)


def training_dtype(choice: str, platform: str | None = None) -> tuple[str, str]:
    """What a training run's `model.dtype` computes with, and why where "auto" decided it by
    measurement: on a CPU, bfloat16 operands (float32 accumulation and float32 elsewhere:
    `execution.operand_dtype`) where this machine's bfloat16 products run at least
    `flops.BFLOAT16_PAYS` times its float32 ones, float32 otherwise; elsewhere as
    `execution` resolves it (bfloat16 on accelerators)."""
    if choice != "auto" or execution.backend(platform) != "cpu":
        return execution.resolved_dtype(choice, platform), ""
    speedup, source = flops.bfloat16_speedup()
    chosen = "bfloat16" if speedup >= flops.BFLOAT16_PAYS else "float32"
    return chosen, (f"auto: bfloat16 products run {speedup:.1f}x float32's ({source}; "
                    f"bfloat16 operands from {flops.BFLOAT16_PAYS}x)")
