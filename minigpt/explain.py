"""The explainer: how a preset lays a model out, parameter by parameter, and what each device holds.

    python -m minigpt.sharding --model minigpt --preset fsdp --devices 8

prints every parameter with its logical axes, the mesh PartitionSpec they resolve to and the bytes
each device holds, then the per-device totals of parameters and optimizer state. Nothing is
allocated: the model and optimizer are built abstractly (shapes only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from minigpt import sharding
from minigpt.config import ConfigError, TrainConfig
from minigpt.models import build_model, get_config
from minigpt.runtime import set_simulated_devices
from minigpt.steps import make_optimizer


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt.sharding",
        description="Explain how a preset shards a model: every parameter's logical axes, mesh "
                    "PartitionSpec and bytes per device.")
    parser.add_argument("--model", default="minigpt", help="a model name from the zoo")
    parser.add_argument("--preset", default="fsdp", help="preset name or path to a .toml file")
    parser.add_argument("--devices", type=int, default=0,
                        help="simulate this many CPU devices (default: the devices present)")
    args = parser.parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    try:
        preset = sharding.load_preset(args.preset)
        cfg = get_config(args.model)
        mesh = sharding.make_mesh(preset)

        def build():
            model = build_model(cfg, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, make_optimizer(TrainConfig()), wrt=nnx.Param)

        model, optimizer = nnx.eval_shape(build)
        sharding.check_divisible(preset, mesh, nnx.state(model))
    except (sharding.PresetError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = sharding.describe(preset, mesh, nnx.state(model, nnx.Param))
    opt = sharding.describe(preset, mesh, nnx.state(optimizer))

    mesh_text = " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
    print(f"model {args.model} under preset {preset.name!r}: {preset.description}")
    print(f"mesh: {mesh_text} ({mesh.size} {jax.devices()[0].platform} devices)\n")
    print("\n".join(parameter_table(params)))
    print(f"\nparameters:      {mib(params, 'bytes_per_device')} per device "
          f"(of {mib(params, 'bytes')} in all)")
    print(f"optimizer state: {mib(opt, 'bytes_per_device')} per device "
          f"(of {mib(opt, 'bytes')} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
