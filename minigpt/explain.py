"""The explainer: how a preset lays a model out, parameter by parameter, and what each device holds.

    python -m minigpt.sharding --model minigpt --preset fsdp --devices 8

prints every parameter with its logical axes, the mesh PartitionSpec they resolve to and the bytes
each device holds, then the per-device totals of parameters and optimizer state; for a mixture of
experts, which experts each device holds and their bytes; under a pipeline preset, which layers
each stage holds on which devices, the schedule (`--schedule`, `--repeats`,
`--microbatches`), its bubble and the stage inputs each stage keeps for its backward; under a
preset that splits the sequence, which chunks of every sequence each device holds; with
`--lora-rank`, the adapters' bytes beside the frozen base's (and the optimizer state of the
adapters alone).
Nothing is allocated: the model and optimizer are built abstractly (shapes only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import minigpt.models.kernels as kernels
from minigpt import parallel, pipeline, sharding
from minigpt.config import LORA_TARGETS, TrainConfig
from minigpt.errors import exit_code
from minigpt.models import get_config
from minigpt.optim import state as adapters
from minigpt.runtime import set_simulated_devices


def parameter_table(rows: list[dict[str, Any]]) -> list[str]:
    """One aligned line per parameter row of `sharding.describe`, under a header."""
    header = ("parameter", "shape", "logical axes", "PartitionSpec", "bytes/device")
    table = [header] + [(r["name"], "x".join(map(str, r["shape"])),
                         "(" + ", ".join(str(a) for a in r["axes"]) + ")", str(r["spec"])[1:],
                         f"{r['bytes_per_device']:,}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if j == 4 else c.ljust(w)
                       for j, (c, w) in enumerate(zip(row, widths))) for row in table]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def mib(rows: list[dict[str, Any]], key: str) -> str:
    return f"{sum(r[key] for r in rows) / 2**20:,.2f} MiB"


def stage_map(layout: sharding.Layout, num_layers: int, block_rows: list[dict[str, Any]],
              sequences: int | None = None) -> list[str]:
    """Which layers and devices each pipeline stage holds, the schedule, its bubble and the
    stage inputs each stage keeps: lines to print."""
    mesh, settings, axis = layout.mesh, layout.pipeline, layout.axis_of("layers")
    S, M, R = mesh.shape[axis], settings.microbatches, settings.repeats
    devices = np.moveaxis(mesh.devices, list(mesh.axis_names).index(axis), 0).reshape(S, -1)
    block_bytes = sum(r["bytes_per_device"] for r in block_rows)
    per_stage = num_layers // S
    lines = [f"pipeline: {S} stages over mesh axis {axis!r}, {per_stage} layer(s) each"
             + (f" in {R} chunks (circular)" if R > 1 else "")
             + f"; block parameters {block_bytes:,} bytes per device (1/{S} of the stack "
             f"where nothing else splits it)"]
    order = pipeline.schedules.layer_order(num_layers, S, R).reshape(S, per_stage)
    for s in range(S):
        ids = ", ".join(str(d.id) for d in devices[s].flat)
        lines.append(f"  stage {s}: {_layer_ranges(order[s])} on device(s) {ids}")
    plan = pipeline.table(settings, S)
    lines.append(f"schedule {settings.schedule}" + (f", repeats {R}" if R > 1 else "")
                 + f", {M} microbatches"
                 + (f" of {sequences // M} sequences" if sequences else "")
                 + f": bubble (S - 1) / (R M + S - 1) = {S - 1}/{R * M + S - 1} = "
                 f"{pipeline.bubble_fraction(S, M, R):.1%} of each step; each stage keeps up "
                 f"to {plan.stash_size} microbatch inputs for its backward ({plan.ticks} ticks)")
    return lines


def expert_map(layout: sharding.Layout, num_experts: int,
               expert_rows: list[dict[str, Any]]) -> list[str]:
    """Which experts each device holds and the bytes of expert weights per device: lines."""
    preset, mesh = layout.preset, layout.mesh
    entry = layout.spec(("expert",))[0]
    axes = sharding.mesh_axes_in(entry)
    held = sum(r["bytes_per_device"] for r in expert_rows)
    total = sum(r["bytes"] for r in expert_rows)
    if not axes:
        return [f"experts: all {num_experts} on every device (no `expert` rule); expert weights "
                f"{held:,} bytes per device of {total:,}"]
    n = sharding.ways(mesh, entry)
    per = num_experts // n
    travel = ("tokens travel to their experts by all-to-all"
              if set(axes) <= set(preset.mesh_axes_of("batch")) else
              "the batch is not split over them, so each device gathers the experts it runs")
    lines = [f"experts: {num_experts} over mesh axes {axes}, {per} per device; expert weights "
             f"{held:,} bytes per device of {total:,}; {travel}"]
    moved = np.moveaxis(mesh.devices, [list(mesh.axis_names).index(a) for a in axes],
                        list(range(len(axes))))
    groups = moved.reshape(n, -1)
    for i in range(n):
        ids = ", ".join(str(d.id) for d in groups[i].flat)
        first, last = i * per, (i + 1) * per - 1
        which = f"expert {first}" if per == 1 else f"experts {first}-{last}"
        lines.append(f"  {which} on device(s) {ids}")
    return lines


def context_map(layout: sharding.Layout) -> list[str]:
    """Which chunks of every sequence each device of the sequence's mesh axis holds (the
    dual-chunk order `minigpt.parallel` runs the model in): lines to print."""
    axis = layout.axis_of("seq")
    n = layout.mesh.shape[axis]
    chunks = parallel.dual_chunk_order(2 * n, n).reshape(n, 2)
    lines = [f"context: every sequence cut into {2 * n} chunks over mesh axis {axis!r} "
             f"({n} devices), device i holding chunks i and {2 * n - 1}-i so that causal "
             f"attention gives each the same work;",
             f"attention: ring, or all_gather (--set train.context_strategy); the sequence "
             f"length must divide by {2 * n}"]
    lines += [f"  position {i} of {axis!r}: chunks {a:>2} and {b:>2}"
              for i, (a, b) in enumerate(chunks)]
    return lines


def _layer_ranges(layers) -> str:
    """"layer 3", "layers 0-3", "layers 0-1, 4-5": runs of consecutive layers."""
    runs, start = [], layers[0]
    for prev, cur in zip(layers, [*layers[1:], None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(runs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt.sharding",
        description="Explain how a preset shards a model: every parameter's logical axes, mesh "
                    "PartitionSpec and bytes per device.")
    parser.add_argument("--model", default="minigpt", help="a model name from the zoo")
    parser.add_argument("--preset", default="fsdp", help="preset name or path to a .toml file")
    parser.add_argument("--devices", type=int, default=0,
                        help="simulate this many CPU devices (default: the devices present)")
    parser.add_argument("--microbatches", type=int, default=0,
                        help="pipeline microbatches M, for the bubble (default: 2 per stage)")
    parser.add_argument("--schedule", default="",
                        help="pipeline schedule: gpipe or 1f1b (default: 1f1b, or gpipe with "
                             "--repeats above 1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="chunks of layers per stage (R > 1: the circular schedule)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="a global batch to check against the preset and M, as the trainer "
                             "does (default: none checked)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="with LoRA adapters of this rank (train.lora_rank): their bytes per "
                             "device beside the frozen base's, and the optimizer state of the "
                             "adapters alone (default 0: none, every weight trains)")
    parser.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                        help="the projections the adapters adapt (train.lora_targets)")
    return parser


def adapter_lines(layout: sharding.Layout, model, rows: list[dict[str, Any]],
                  rank: int) -> list[str]:
    """The parameters' bytes split into the frozen base and the adapters (what trains)."""
    adapted = sharding.describe(layout, nnx.state(model, nnx.LoRAParam))
    base = [r for r in rows if r["name"] not in {a["name"] for a in adapted}]
    return [f"  frozen base:   {mib(base, 'bytes_per_device')} per device (of "
            f"{mib(base, 'bytes')}): no gradients, no optimizer state",
            f"  adapters:      {mib(adapted, 'bytes_per_device')} per device (of "
            f"{mib(adapted, 'bytes')}), rank {rank}: what trains"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    return exit_code(lambda: _explain(args))


def _explain(args: argparse.Namespace) -> int:
    cfg = get_config(args.model)
    pipe = sharding.Pipeline(microbatches=args.microbatches, schedule=args.schedule,
                             repeats=args.repeats)
    layout = sharding.Layout.make(args.preset, pipeline=pipe)
    train_cfg = TrainConfig(lora_rank=args.lora_rank, lora_targets=tuple(
        t for t in args.lora_targets.split(",") if t))
    adapters.check(cfg, train_cfg, layout)
    model, optimizer = nnx.eval_shape(lambda: adapters.build(cfg, train_cfg))
    sharding.check_divisible(layout, nnx.state(model))
    layout = layout.checked(model=args.model, num_layers=cfg.num_layers,
                            batch_size=args.batch_size or None, num_experts=cfg.num_experts)
    params = sharding.describe(layout, nnx.state(model, nnx.Param))
    opt = sharding.describe(layout, nnx.state(optimizer))

    preset, mesh = layout.preset, layout.mesh
    mesh_text = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    print(f"model {args.model} under preset {preset.name!r}: {preset.description}")
    print(f"mesh: {mesh_text} ({mesh.size} {jax.devices()[0].platform} devices)")
    print(f"{kernels.describe(cfg.kernels, cfg.dtype)}\n")
    print("\n".join(parameter_table(params)))
    print(f"\nparameters:      {mib(params, 'bytes_per_device')} per device "
          f"(of {mib(params, 'bytes')} in all)")
    if args.lora_rank:
        print("\n".join(adapter_lines(layout, model, params, args.lora_rank)))
    print(f"optimizer state: {mib(opt, 'bytes_per_device')} per device "
          f"(of {mib(opt, 'bytes')} in all)")
    if cfg.num_experts:
        experts = [r for r in params if "expert" in r["axes"]]
        print("\n" + "\n".join(expert_map(layout, cfg.num_experts, experts)))
    if layout.ways("seq") > 1:
        print("\n" + "\n".join(context_map(layout)))
    if layout.pipeline.microbatches:
        blocks = [r for r in params if r["axes"][:1] == ("layers",)]
        print("\n" + "\n".join(stage_map(layout, cfg.num_layers, blocks,
                                           args.batch_size or None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
