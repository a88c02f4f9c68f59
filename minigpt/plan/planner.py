"""The planner's library: an estimate per preset, and all of them at once.

`estimate(model_cfg, train_cfg, preset, devices)` says whether a preset applies to a run on
`devices` devices (refusing it with the trainer's own line where not), how many bytes each
device holds at the step's peak (`minigpt.plan.memory`), whether that fits the device memory
with a headroom, and about how long a step takes (`minigpt.plan.speed`). `plan_all` does so for
every shipped preset, building the abstract model once. Nothing is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax import nnx

import minigpt.optim.state as adapters
import minigpt.plan.layout as layouts
import minigpt.plan.speed as speeds
from minigpt import sharding
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.models import build_model, execution, lora
from minigpt.plan.activations import BlockTracer
from minigpt.plan.memory import Memory, Subject, estimate_memory
from minigpt.runs import resolved

# The share of a device's memory a plan leaves free: XLA's own buffers, fragmentation, what
# the plan does not see. A preset fits when its total is at most (1 - HEADROOM) of the memory.
HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One preset's plan: whether it applies (and why not), the memory per device, whether it
    fits, and the speed estimate."""

    preset: str
    applies: bool
    why: str = ""
    memory: Memory | None = None
    fits: bool = False
    device_memory: int | None = None  # bytes per device the fit was judged against
    headroom: float = HEADROOM
    speed: speeds.Speed | None = None
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    pipeline: sharding.Pipeline | None = None  # how a pipeline runs (microbatches resolved)
    compiled_total: int | None = None  # what XLA reports, with --compile

    @property
    def total(self) -> int:
        return self.memory.total if self.memory else 0

    def as_json(self) -> dict[str, Any]:
        """The contract `python -m minigpt.plan --json` prints for a preset."""
        m = self.memory
        out: dict[str, Any] = {
            "preset": self.preset, "applies": self.applies, "why": self.why, "fits": self.fits,
            "bytes": {"parameters": m.parameters if m else 0, "gradients": m.gradients if m else 0,
                      "optimizer": m.optimizer if m else 0,
                      "activations": m.activations if m else 0, "total": self.total}}
        if self.compiled_total is not None:
            out["compiled_total"] = self.compiled_total
        return out


def make_subject(model_cfg: ModelConfig, train_cfg: TrainConfig, *,
                 platform: str | None = None) -> Subject:
    """The abstract model and optimizer of a run (shapes only), once for every preset;
    `platform` ("cpu", "gpu", "tpu"; default the backend present) decides what "auto" means
    for the model's kernels and compute dtype (`minigpt.models.kernels`), as it would there."""
    wanted = resolved.adapters(train_cfg)
    if wanted is not None:  # targets named by the architecture, as the trainer refuses them
        plain = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
        lora.check_targets(plain, wanted.targets, model_cfg.arch)
    model_cfg = execution.for_backend(model_cfg, platform)
    kernels = model_cfg.kernels
    model, optimizer = nnx.eval_shape(lambda: adapters.build(model_cfg, train_cfg))
    adapted = lora.trainable(model) is nnx.LoRAParam
    dropping = model_cfg.dropout > 0 or (adapted and train_cfg.lora_dropout > 0)
    tracer = BlockTracer(model, model_cfg, kernels, adapted=adapted, dropping=dropping,
                         documents=train_cfg.document_mask)
    return Subject(model_cfg=model_cfg, train_cfg=train_cfg, params=nnx.state(model, nnx.Param),
                   trainable=nnx.state(model, lora.trainable(model)),
                   optimizer=nnx.state(optimizer), state=nnx.state((model, optimizer)),
                   kernels=kernels, tracer=tracer)


def estimate(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: str | sharding.Preset,
             devices: int, *, device_memory: int | None = None, headroom: float = HEADROOM,
             device: speeds.Device | None = None, subject: Subject | None = None) -> Estimate:
    """The plan of one preset for this run on `devices` devices of `device_memory` bytes each
    (None: fits is judged against nothing and is True)."""
    subject = subject or make_subject(model_cfg, train_cfg)
    preset = preset if isinstance(preset, sharding.Preset) else sharding.load_preset(preset)
    try:
        layout = layouts.check(model_cfg, train_cfg, preset, devices, subject.state)
    except (sharding.PresetError, ConfigError) as error:
        return Estimate(preset=preset.name, applies=False, why=str(error),
                        device_memory=device_memory, headroom=headroom)
    memory = estimate_memory(subject, layout)
    fits = device_memory is None or memory.total <= (1 - headroom) * device_memory
    speed = speeds.estimate(subject, layout, device) if device is not None else None
    return Estimate(preset=preset.name, applies=True, memory=memory, fits=fits,
                    device_memory=device_memory, headroom=headroom, speed=speed,
                    mesh=dict(layout.mesh.shape), pipeline=layout.pipeline)


def plan_all(model_cfg: ModelConfig, train_cfg: TrainConfig, devices: int, *,
             presets: Sequence[str] | None = None, device_memory: int | None = None,
             headroom: float = HEADROOM, device: speeds.Device | None = None,
             platform: str | None = None) -> list[Estimate]:
    """`estimate` for every shipped preset (or those named), in the order given."""
    subject = make_subject(model_cfg, train_cfg, platform=platform)
    return [estimate(model_cfg, train_cfg, name, devices, device_memory=device_memory,
                     headroom=headroom, device=device, subject=subject)
            for name in (presets or sharding.available_presets())]
