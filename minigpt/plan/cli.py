"""`python -m minigpt.plan`: which preset fits a model on these devices, and which is fastest.

    python -m minigpt.plan --model llama-15m --devices 8 --device-memory 16GiB
    python -m minigpt.plan --hf path/to/Llama-3.2-1B --devices 8 --device-memory 80GB --json
    python -m minigpt.plan --run runs/demo --compile
    python -m minigpt.plan --recipe stories-gpu --device-memory 80GB

For a zoo model, a run directory or a Hugging Face folder (or its config.json), a device count,
the memory of each device and the training settings that change memory (`--batch-size`,
`--seq-len`, and `--set` exactly as `python -m minigpt.train` takes it), it prints a table over
every shipped preset: per device, the bytes of parameters, gradients, optimizer state and
activations at the step's peak, the largest temporary, the total, whether that fits with the
headroom, and an estimated step time to rank them by; and for the presets that do not apply,
the trainer's own one-line reason. Nothing is compiled unless `--compile` asks to check the plan
against what XLA allocates for the real step (`minigpt.plan.compiled`). `--json` prints one JSON
list with an object per preset (the contract in `minigpt.plan.planner.Estimate.as_json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import minigpt.plan.planner as planner
import minigpt.plan.speed as speed
from minigpt import models, runtime
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.errors import exit_code
from minigpt.models import execution
from minigpt.plan.sizes import format_size, parse_size, present_memory
from minigpt.runs import resolved
from minigpt.runs.overrides import parse_overrides, recipe_configs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minigpt.plan",
        description="Plan a training run: the memory each preset needs per device, whether it "
                    "fits, and which is fastest; nothing compiled unless --compile.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="a model of the zoo (default minigpt)")
    source.add_argument("--run", metavar="DIR",
                        help="a run directory: its model and training settings")
    source.add_argument("--hf", metavar="PATH",
                        help="a Hugging Face model folder, or its config.json")
    source.add_argument("--recipe", metavar="NAME",
                        help="a recipe (recipes/NAME.toml, or a .toml path): its model and "
                             "training settings, as python -m minigpt.train --recipe runs them")
    p.add_argument("--devices", type=int, default=0,
                   help="plan for this many devices; on a CPU, simulates them (default: the "
                        "devices present)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory per device, e.g. 16GiB, 80GB, 512MiB (default: what the devices "
                        "present report; on a CPU the machine's memory shared by the devices)")
    p.add_argument("--device-kind", metavar="KIND",
                   help="rank presets for this kind of device: cpu, 'NVIDIA H100', 'TPU v5e', "
                        "... (default: the devices present)")
    p.add_argument("--headroom", type=float, default=planner.HEADROOM,
                   help=f"share of the memory left free (default {planner.HEADROOM:g})")
    p.add_argument("--batch-size", type=int, help="global batch in sequences (default: the "
                                                  "run's, or the trainer's)")
    p.add_argument("--seq-len", type=int, help="training context (default: the model's)")
    p.add_argument("--preset", action="append",
                   help="plan only this preset (repeatable; default: every shipped preset)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field as python -m minigpt.train takes it, e.g. "
                        "--set model.remat=full --set train.lora_rank=8")
    p.add_argument("--json", action="store_true", help="print one JSON list, an object per preset")
    p.add_argument("--compile", action="store_true",
                   help="also compile the real train step under each preset that applies and "
                        "compare with what XLA allocates (slow)")
    return p


def resolve_configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """The model and training settings the command line describes."""
    if args.run:
        from minigpt.runs import RunDir

        saved = RunDir(args.run).read()
        model_cfg = saved.model
        train_cfg = saved.train or TrainConfig(model=Path(args.run).name)
    elif args.hf:
        path = Path(args.hf)
        model_cfg = hf_config(path)
        train_cfg = TrainConfig(model=(path.parent if path.is_file() else path).name)
    elif args.recipe:
        model_cfg, train_cfg = recipe_configs(args.recipe)
    else:
        from minigpt.models import get_config

        model_cfg = get_config(args.model or TrainConfig.model)
        train_cfg = TrainConfig(model=args.model or TrainConfig.model)
    given = {k: v for k, v in (("batch_size", args.batch_size), ("seq_len", args.seq_len))
             if v is not None}
    changes = parse_overrides(args.set)
    model_cfg = models.replaced(model_cfg, **changes["model"])
    train_cfg = dataclasses.replace(train_cfg, **{**given, **changes["train"]})
    if train_cfg.seq_len > model_cfg.context_len:
        raise ConfigError(f"train.seq_len {train_cfg.seq_len} exceeds the model's context "
                          f"{model_cfg.context_len}")
    return model_cfg, train_cfg


def hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json (or of that file)."""
    from minigpt.hub import configs
    from minigpt.hub.convert import read_config

    if path.is_file():
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path} is not a readable JSON file ({error})") from None
        if not isinstance(payload, dict):
            raise ConfigError(f"{path} is not a JSON object")
        return configs.model_config(payload)
    return configs.model_config(read_config(path))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with runtime.plain_warnings():
        return exit_code(lambda: _plan(args))


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse device counts and headroom that mean nothing, before anything is built."""
    from minigpt.runs import MAX_DEVICES

    if args.devices and not 1 <= args.devices <= MAX_DEVICES:
        raise ConfigError(f"--devices {args.devices}: plan for 1 to {MAX_DEVICES:,} devices")
    if not 0 <= args.headroom < 1:  # also refuses nan, which no comparison holds for
        raise ConfigError(f"--headroom {args.headroom}: the share of the memory left free is a "
                          f"number from 0 to below 1 (default {planner.HEADROOM:g})")


def _plan(args: argparse.Namespace) -> int:
    check_numbers(args)
    if args.devices and args.compile:  # only compiling needs the devices; a plan needs none
        runtime.set_simulated_devices(args.devices)
    import jax

    model_cfg, train_cfg = resolve_configs(args)
    devices = args.devices or jax.device_count()
    if args.device_memory:
        memory, memory_source = parse_size(args.device_memory), "given"
    else:
        memory, memory_source = present_memory(devices)
    dev = speed.device(args.device_kind, model_cfg.dtype, devices)
    estimates = planner.plan_all(model_cfg, train_cfg, devices, presets=args.preset,
                                 device_memory=memory, headroom=args.headroom, device=dev,
                                 platform=dev.platform)
    if args.compile:
        estimates = [_compiled(e, model_cfg, train_cfg) for e in estimates]
    if args.json:
        print(json.dumps([e.as_json() for e in estimates]))
        return 0
    print("\n".join(report(estimates, model_cfg, train_cfg, devices, memory, memory_source,
                           dev, args.headroom)))
    return 0


def _compiled(estimate: planner.Estimate, model_cfg: ModelConfig,
              train_cfg: TrainConfig) -> planner.Estimate:
    """The estimate with what XLA allocates for the real step beside it."""
    from minigpt.plan.compiled import compile_step

    if not estimate.applies:
        return estimate
    on = dataclasses.replace(train_cfg, preset=estimate.preset)
    compiled = compile_step(model_cfg, train_cfg, resolved.layout(model_cfg, on))
    return dataclasses.replace(estimate, compiled_total=compiled.total)


def report(estimates: list[planner.Estimate], model_cfg: ModelConfig, train_cfg: TrainConfig,
           devices: int, memory: int, memory_source: str, dev: speed.Device,
           headroom: float) -> list[str]:
    """The table: presets that apply, fastest first, then those that do not and why."""
    seq = resolved.seq_len(model_cfg, train_cfg)
    dtype = execution.compute_dtype(model_cfg.dtype, dev.platform)  # as it computes there
    policy = model_cfg.remat_policy
    remat = "" if policy in ("auto", "none") else f", remat {policy}"
    lines = [f"model {train_cfg.model} ({model_cfg.arch}, {model_cfg.num_layers} layers, width "
             f"{model_cfg.embed_dim}, {dtype}{remat}"
             f"{f', LoRA rank {train_cfg.lora_rank}' if train_cfg.lora_rank else ''}); batch "
             f"{train_cfg.batch_size} x {seq} tokens"
             + (f" in {train_cfg.microbatches} microbatches" if train_cfg.microbatches > 1
                else ""),
             f"{devices} devices of {format_size(memory)} ({memory_source}); fits: total at "
             f"most {1 - headroom:.0%} of it; speed: {dev.describe()}", ""]
    # Those that fit first, each group fastest first: the top row is what --preset auto picks.
    applying = sorted((e for e in estimates if e.applies),
                      key=lambda e: (not e.fits, e.speed.seconds))
    compiled = any(e.compiled_total for e in applying)
    header = ["preset", "mesh", "parameters", "gradients", "optimizer", "activations",
              "largest temp", "total", "fits", "step (est.)"]
    header += ["compiled", "plan/compiled"] if compiled else []
    rows = [header]
    for e in applying:
        m = e.memory
        row = [e.preset, "x".join(str(n) for n in e.mesh.values()), format_size(m.parameters),
               format_size(m.gradients), format_size(m.optimizer), format_size(m.activations),
               format_size(m.temporary), format_size(m.total), "yes" if e.fits else "no",
               f"{e.speed.seconds:.3g} s"]
        if compiled:
            row += [format_size(e.compiled_total), f"{m.total / e.compiled_total:.3f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    skipped = [e for e in estimates if not e.applies]
    if skipped:
        lines += ["", "do not apply:"]
        width = max(len(e.preset) for e in skipped)
        lines += [f"  {e.preset.ljust(width)}  {e.why}" for e in skipped]
    return lines
