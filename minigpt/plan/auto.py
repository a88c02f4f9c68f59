"""Before a run: `--preset auto` (the fastest preset that applies and fits, chosen before anything
is written), and the memory check every run makes (`preflight`).

The trainer asks `resolve` first thing: a run whose preset is "auto" gets the preset the plan
ranks fastest among those that apply to its devices and fit their memory (`minigpt.plan`), and
says so, with the runner-up and the plan's numbers, in the run's first lines. config.json then
records the chosen preset as the run's `train.preset`, and beside it that `auto` chose it, so a
resumed run keeps it. Where no preset fits, the run is refused in one line that gives the
smallest memory any preset needs and the setting that would help most.

Every run, whatever its preset, asks `preflight` before it allocates anything: the plan of the
configuration it is about to run, under its layout, against the device's memory. A run that
cannot fit is refused in one line saying what it needs and what would help, unless the user
says they know better (`--no-memory-check`); a `model.remat` of "auto" becomes the first policy
that fits ("none", else "full"); and a time budget learns the step time the plan expects, from
which its warm-up is fixed when the run starts (`minigpt.runs.resolved`).

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
from minigpt.models import execution
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
    if model_cfg.remat_policy in ("auto", "none"):
        options["rematerialisation (--set model.remat=full)"] = (
            dataclasses.replace(model_cfg, remat="full"), train_cfg, devices)
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


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the plan says of the run about to start: the remat policy an "auto" one becomes,
    the plan of the configuration as it will run, and (asked for a time budget) the step time
    it expects."""

    remat: str
    estimate: planner.Estimate
    step_seconds: float | None


def preflight(model_cfg: ModelConfig, train_cfg: TrainConfig, layout, *, enforce: bool = True,
              say=print) -> Preflight:
    """The plan of this run under its `layout` (a checked `sharding.Layout`) on the devices
    here, against their memory: ConfigError (one line: what it needs, what a device has, what
    would help) where nothing fits and `enforce`; else a warning line and the run goes on."""
    devices = layout.mesh.size
    memory, source = (_memory.get(), "given") if _memory.get() else present_memory(devices)
    device = speed.device(None, model_cfg.dtype, devices) if train_cfg.time_budget else None
    policies = ("none", "full") if model_cfg.remat_policy == "auto" else (model_cfg.remat_policy,)
    if execution.backend() == "cpu" and not execution.scanned(model_cfg.scan_layers):
        # Measured on XLA's CPU backend (stories-gpu's shape, batch 8, 2026-11-27): an unrolled
        # stack compiled to 3.35 GiB without remat and 3.26 GiB with it ("full"; scanned, 2.09
        # and 0.83 GiB): remat buys nothing there, so "auto" does not count on it.
        policies = policies[:1]
    for policy in policies:
        plan = planner.estimate(dataclasses.replace(model_cfg, remat=policy), train_cfg,
                                layout.preset, devices, device_memory=memory, headroom=0.0,
                                device=device)
        if not plan.applies or plan.fits:
            break
    else:
        needs = (f"preset {layout.name} needs about {format_size(plan.total)} per device "
                 f"({_parts(plan.memory)}), and a device here has {format_size(memory)} "
                 f"({source})")
        remat = ", set model.remat=full" if model_cfg.remat_policy == "none" else ""
        if enforce:
            raise ConfigError(f"{needs}: lower --batch-size or --seq-len{remat}, or choose a "
                              f"preset that splits more (python -m minigpt.plan compares "
                              f"them); --no-memory-check tries anyway")
        say(f"warning: {needs}; going on as --no-memory-check asks")
    seconds = plan.speed.seconds if plan.applies and plan.speed is not None else None
    return Preflight(remat=policy, estimate=plan, step_seconds=seconds)


def _parts(m) -> str:
    return (f"parameters {format_size(m.parameters)}, gradients {format_size(m.gradients)}, "
            f"optimizer {format_size(m.optimizer)}, activations {format_size(m.activations)}")


def _numbers(estimate: planner.Estimate) -> str:
    return (f"{format_size(estimate.memory.total)} per device: {_parts(estimate.memory)}; "
            f"about {estimate.speed.seconds:.3g} s/step")


def _chosen_before(train_cfg: TrainConfig) -> dict[str, Any] | None:
    """What config.json of the run being resumed says auto chose, if it did."""
    from minigpt.runs import RunDir, RunError

    try:
        saved = RunDir(train_cfg.out).read()
    except RunError:
        return None
    record = saved.record.get("preset_choice")
    return record if isinstance(record, dict) and record.get("by") == AUTO else None
