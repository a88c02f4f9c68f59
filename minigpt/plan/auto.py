"""`--preset auto`: the fastest preset that applies and fits, chosen before anything is written.

The trainer asks `resolve` first thing: a run whose preset is "auto" gets the preset the plan
ranks fastest among those that apply to its devices and fit their memory (`minigpt.plan`), and
says so, with the runner-up and the plan's numbers, in the run's first lines. config.json then
records the chosen preset as the run's `train.preset`, and beside it that `auto` chose it, so a
resumed run keeps it. Where no preset fits, the run is refused in one line that gives the
smallest memory any preset needs and the setting that would help most.

The device memory is the devices' own unless `budget` says otherwise (the command line's
`--device-memory`), a setting of how to choose, not of the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

import minigpt.plan.planner as planner
import minigpt.plan.speed as speed
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.plan.sizes import format_size, present_memory

AUTO = "auto"
_memory: contextvars.ContextVar[int | None] = contextvars.ContextVar("device_memory",
                                                                     default=None)


@contextlib.contextmanager
def budget(device_memory: int | None) -> Iterator[None]:
    """Choose for devices of `device_memory` bytes inside (None: the devices' own)."""
    token = _memory.set(device_memory)
    try:
        yield
    finally:
        _memory.reset(token)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen preset's plan, the runner-up's (None: nothing else fits) and every plan."""

    best: planner.Estimate
    runner_up: planner.Estimate | None
    estimates: list[planner.Estimate]


def choose(model_cfg: ModelConfig, train_cfg: TrainConfig, devices: int, device_memory: int,
           *, headroom: float = planner.HEADROOM, device: speed.Device | None = None) -> Choice:
    """The fastest preset that applies and fits, or ConfigError saying what would fit."""
    device = device or speed.device(None, model_cfg.dtype, devices)
    estimates = planner.plan_all(model_cfg, train_cfg, devices, device_memory=device_memory,
                                 headroom=headroom, device=device)
    fitting = sorted((e for e in estimates if e.applies and e.fits),
                     key=lambda e: e.speed.seconds)
    if not fitting:
        raise ConfigError(nothing_fits(model_cfg, train_cfg, devices, device_memory, headroom,
                                       estimates))
    return Choice(best=fitting[0], runner_up=fitting[1] if len(fitting) > 1 else None,
                  estimates=estimates)


def nothing_fits(model_cfg: ModelConfig, train_cfg: TrainConfig, devices: int, memory: int,
                 headroom: float, estimates: list[planner.Estimate]) -> str:
    """One line: the smallest memory any preset needs, and the setting that helps most."""
    applying = [e for e in estimates if e.applies]
    if not applying:
        return (f"preset auto: no preset applies to this run on {devices} devices "
                f"({estimates[0].preset}: {estimates[0].why})")
    least = min(applying, key=lambda e: e.total)
    needed = least.total / (1 - headroom)
    tried = []
    for label, (m_cfg, t_cfg, n) in _alternatives(model_cfg, train_cfg, devices).items():
        try:
            plans = planner.plan_all(m_cfg, t_cfg, n)
        except ConfigError:
            continue
        totals = [e.total for e in plans if e.applies]
        if totals:
            tried.append((min(totals), label))
    advice = ""
    if tried:
        total, label = min(tried)
        advice = (f"; {label} would help most ({format_size(total / (1 - headroom))} per "
                  f"device)")
    return (f"preset auto: no preset fits {devices} devices of {format_size(memory)} with "
            f"{headroom:.0%} headroom: the smallest, {least.preset}, needs "
            f"{format_size(needed)} per device{advice}")


def _alternatives(model_cfg: ModelConfig, train_cfg: TrainConfig,
                  devices: int) -> dict[str, tuple[ModelConfig, TrainConfig, int]]:
    """The settings that cut a step's memory, each as the configs and devices it makes."""
    options = {}
    if not train_cfg.lora_rank:
        options["LoRA adapters (--set train.lora_rank=8)"] = (
            model_cfg, dataclasses.replace(train_cfg, lora_rank=8), devices)
    if not model_cfg.remat:
        options["rematerialisation (--set model.remat=true)"] = (
            dataclasses.replace(model_cfg, remat=True), train_cfg, devices)
    half = train_cfg.batch_size // 2
    if half and half % train_cfg.microbatches == 0:
        options[f"a smaller batch (--batch-size {half})"] = (
            model_cfg, dataclasses.replace(train_cfg, batch_size=half), devices)
    options[f"more devices ({2 * devices})"] = (model_cfg, train_cfg, 2 * devices)
    return options


def resolve(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool,
            say=print) -> tuple[TrainConfig, dict[str, Any]]:
    """The run's train config with preset "auto" replaced by the chosen preset, and what
    config.json records of the choice ({} where the preset was named). A resumed run keeps the
    preset `auto` chose when it started."""
    if train_cfg.preset != AUTO:
        return train_cfg, {}
    if resume:
        kept = _chosen_before(train_cfg)
        if kept is not None:
            say(f"preset auto: keeping {kept['preset']}, which auto chose when the run started")
            return dataclasses.replace(train_cfg, preset=kept["preset"]), {"preset_choice": kept}
    devices = jax.device_count()
    memory, source = (_memory.get(), "given") if _memory.get() else present_memory(devices)
    choice = choose(model_cfg, train_cfg, devices, memory)
    best, second = choice.best, choice.runner_up
    say(f"preset auto: {best.preset} ({_numbers(best)}), the fastest of the presets that fit "
        f"{devices} devices of {format_size(memory)} ({source})"
        + (f"; runner-up {second.preset} ({_numbers(second)})" if second else
           "; nothing else fits"))
    record = {"by": AUTO, "preset": best.preset, "device_memory": memory,
              "planned_total": best.total, "estimated_step_seconds": best.speed.seconds,
              "runner_up": second.preset if second else None}
    return dataclasses.replace(train_cfg, preset=best.preset), {"preset_choice": record}


def _numbers(estimate: planner.Estimate) -> str:
    m = estimate.memory
    return (f"{format_size(m.total)} per device: parameters {format_size(m.parameters)}, "
            f"gradients {format_size(m.gradients)}, optimizer {format_size(m.optimizer)}, "
            f"activations {format_size(m.activations)}; about {estimate.speed.seconds:.3g} "
            f"s/step")


def _chosen_before(train_cfg: TrainConfig) -> dict[str, Any] | None:
    """What config.json of the run being resumed says auto chose, if it did."""
    from minigpt.runs import RunDir, RunError

    try:
        saved = RunDir(train_cfg.out).read()
    except RunError:
        return None
    record = saved.record.get("preset_choice")
    return record if isinstance(record, dict) and record.get("by") == AUTO else None
