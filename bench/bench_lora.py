"""LoRA against full fine-tuning: the compiled step's memory, the peak RSS and the step time.

    python bench/bench_lora.py [--shapes llama-3.2-1b smollm2-135m] [--setups fsdp8 dp1]
                               [--modes full r8 r64 r64-replicated] [--steps 2]

For each shape, writes a random bfloat16 checkpoint in the Hugging Face layout (safetensors and
config.json: Llama 3.2 1B's shape, or SmolLM2-135M's; both tied; a small tokenizer.json, which
is not what is measured) and imports it (`python -m minigpt.hub import`). Then each
configuration runs in a fresh process: a setup (`fsdp` on 8 simulated CPU devices, or `dp` on
one), a mode (every weight trains with AdamW, or adapters of rank 8 or 64 on the attention and
feed-forward projections, `--set train.lora_rank=R`; "-replicated" keeps the adapters whole on
every device instead of split as their layer is) and 256 tokens a step (8 x 32 under fsdp, whose
batch splits 8 ways; 2 x 128 on one device).

The train step is first compiled from the state's shapes alone, nothing allocated, for its
`memory_analysis()`: per device, its arguments (parameters, optimizer state, batch), outputs and
temporaries. On simulated devices device memory is host memory, so what the step needs is that
times the devices. Where that leaves 4 GiB of the memory the machine has free, the process then
builds the state, starts from the imported run's weights as `--init-from` does, and times
`--steps` steps after one that compiles; its peak RSS (`ru_maxrss`) is what the fine-tuning
process needed. Where it does not, the peak is estimated from the computed need and what the
measured rows of the same shape and setup took beyond theirs, and nothing is run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (hidden, layers, heads, kv heads, intermediate, vocab, rope theta, name)
SHAPES = {"llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, 500000.0, "Llama 3.2 1B"),
          "smollm2-135m": (576, 30, 9, 3, 1536, 49152, 100000.0, "SmolLM2-135M")}
MODES = {"full": (0, False), "r8": (8, False), "r64": (64, False), "r8-replicated": (8, True),
         "r64-replicated": (64, True)}
# preset, devices, batch x sequence: 256 tokens a step either way (fsdp splits the batch 8 ways)
SETUPS = {"fsdp8": ("fsdp", 8, 8, 32), "dp1": ("dp", 1, 2, 128)}
GIB = 2**30


def write_checkpoint(shape: str, directory: Path) -> int:
    """A random tied Llama-family checkpoint of `shape` in the Hub's layout, bfloat16; returns
    its bytes."""
    from bench.bench_import import write_llama

    D, L, N, K, F, V, theta, _ = SHAPES[shape]
    return write_llama(directory, hidden=D, layers=L, heads=N, kv_heads=K, intermediate=F,
                       vocab=V, config={"max_position_embeddings": 2048, "rope_theta": theta})


def free_bytes() -> int:
    """MemAvailable of /proc/meminfo: what the machine can give a new process now."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(spec: dict) -> dict:
    """Compile (and, where it fits, run) one configuration in this fresh process."""
    from bench.report import timed
    from minigpt.runtime import set_simulated_devices

    set_simulated_devices(spec["devices"])
    import jax
    import numpy as np
    from flax import nnx

    from minigpt import sharding
    from minigpt.config import TrainConfig
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim import state as adapters
    from minigpt.runs import RunDir
    from minigpt.runs.resolved import adapters as requested

    jax.devices()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_cfg = RunDir(spec["run"]).read().model
    B, T = spec["batch"], spec["seq"]
    train_cfg = TrainConfig(preset=spec["preset"], batch_size=B, seq_len=T,
                            lora_rank=spec["rank"], lr=1e-4, warmup_steps=0)
    layout = sharding.Layout.make(spec["preset"])

    def build():
        return adapters.build(model_cfg, train_cfg, replicated=spec["replicated"])

    # The state's shapes, laid out as the preset says: the step compiles from these alone.
    graphdef, state = nnx.split(nnx.eval_shape(build))
    placed = jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                          state, sharding.state_shardings(layout, state))
    shapes = nnx.merge(graphdef, placed)
    held = {name: sum(r["bytes_per_device"] for r in sharding.describe(layout, part))
            for name, part in (("base", nnx.state(shapes[0], nnx.All(
                nnx.Param, nnx.Not(nnx.LoRAParam)))),
                ("adapters", nnx.state(shapes[0], nnx.LoRAParam)),
                ("optimizer", nnx.state(shapes[1])))}
    batch_sharding = layout.batch_sharding()
    batch = {k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=batch_sharding)
             for k in ("inputs", "targets")}
    rng, rates = jax.random.key(0), lr_schedule.lr_schedule(train_cfg)
    with layout.active():
        start = time.perf_counter()
        memory = steps.train_step.lower(*shapes, batch, rng, rates).compile().memory_analysis()
        compile_s = time.perf_counter() - start
    per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                  - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    result = {"per_device": per_device, "temp": memory.temp_size_in_bytes,
              "need": per_device * layout.mesh.size, "compile_s": compile_s, "held": held,
              "before": before}
    # Run only what leaves room beside it: starting from the weights and compiling took up to
    # 2.5 GiB beyond the step in the rows measured, for the 1B shape.
    if result["need"] + 4 * GIB > spec["free"]:
        return result
    model, optimizer = sharding.create_sharded(build, layout)
    adapters.start_from(model, Path(spec["run"]), requested(train_cfg),
                        say=lambda _: None)
    tokens = np.random.default_rng(0).integers(0, 4096, (B, T + 1)).astype(np.int32)
    with layout.active():
        placed_batch = sharding.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                          batch_sharding)
        times, _ = timed(lambda: steps.train_step(model, optimizer, placed_batch, rng, rates),
                         spec["steps"])
    return {**result, "step_s": sorted(times)[len(times) // 2],
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_worker(spec: dict, timeout: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")}
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                             capture_output=True, text=True, check=False, cwd=REPO, env=env,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout} s"}
    if out.returncode:
        why = (f"killed by signal {-out.returncode}" if out.returncode < 0
               else out.stderr.strip()[-300:])
        return {"error": why}
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows_of(results: list[tuple[str, str, str, dict]]) -> list[tuple]:
    """Table rows. A row not run gets an estimated peak: its step's need plus the most any
    measured row of the same shape and setup needed beyond its step (reading the start
    weights, compiling, the process itself); it fits in 24 GB when that is under 24 GiB."""
    beyond: dict[tuple[str, str], float] = {}
    for shape, setup, _, r in results:
        if "peak_rss" in r:
            key = (shape, setup)
            beyond[key] = max(beyond.get(key, 0), r["peak_rss"] - r["need"])
    rows = []
    for shape, setup, mode, r in results:
        if "error" in r:
            rows.append((shape, setup, mode, r["error"], "", "", "", "", "", "", ""))
            continue
        mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
        if "peak_rss" in r:
            peak, how = r["peak_rss"], "measured"
        elif (shape, setup) in beyond:
            peak, how = r["need"] + beyond[shape, setup], "estimated"
        else:
            peak, how = None, ""
        rows.append((shape, setup, mode, mib(r["held"]["base"]), mib(r["held"]["adapters"]),
                     mib(r["held"]["optimizer"]), mib(r["per_device"]),
                     f"{r['need'] / GIB:,.1f}",
                     f"{peak / GIB:,.1f} ({how})" if peak else "not run",
                     ("yes" if peak < 24 * GIB else "no") if peak else "",
                     f"{r['step_s']:.1f}" if "step_s" in r else "not run"))
    return rows


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                        default=["smollm2-135m", "llama-3.2-1b"])
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=["fsdp8", "dp1"])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one more)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--no-record", action="store_true", help="print, do not append")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-lora-") as tmp:
        for shape in args.shapes:
            source, run = Path(tmp) / shape, Path(tmp) / f"{shape}-run"
            source.mkdir()
            size = write_checkpoint(shape, source)
            subprocess.run([sys.executable, "-m", "minigpt.hub", "import", str(source), "--out",
                            str(run), "--preset", "fsdp", "--devices", "8"], check=True,
                           cwd=REPO, capture_output=True)
            shutil.rmtree(source)  # the run holds the weights now
            print(f"{shape}: {size / GIB:.2f} GiB of bfloat16 weights, imported", flush=True)
            for setup in args.setups:
                for mode in args.modes:
                    preset, devices, batch, seq = SETUPS[setup]
                    rank, replicated = MODES[mode]
                    if replicated and (not rank or devices == 1):
                        continue
                    spec = {"run": str(run), "preset": preset, "devices": devices,
                            "batch": batch, "seq": seq,
                            "rank": rank, "replicated": replicated, "steps": args.steps,
                            "free": free_bytes()}
                    results.append((SHAPES[shape][-1], setup, mode,
                                    run_worker(spec, args.timeout)))
                    print("  " + " | ".join(rows_of(results)[-1]), flush=True)
    body = table(["shape", "setup", "mode", "base MiB/dev", "adapters MiB/dev",
                  "optimizer MiB/dev", "step needs MiB/dev", "step needs GiB in all",
                  "peak RSS GiB", "fits 24 GB", "step s"], rows_of(results))
    details = [
        "a random tied checkpoint of each shape (bfloat16 safetensors), imported; parameters "
        "are float32 in minigpt, the frozen base included; 256 tokens a step (fsdp8: 8 x 32, "
        "dp1: 2 x 128), AdamW, model dtype float32, kernels auto (cpu)",
        "setups: fsdp8 = preset fsdp on 8 simulated CPU devices, dp1 = preset dp on 1; modes: "
        "full = every weight trains, rN = LoRA rank N on query, key, value, out, gate, up, "
        "down (adapters split as their layer), rN-replicated = the same adapters whole on "
        "every device",
        "base/adapters/optimizer: bytes each device holds; 'step needs' = the compiled step's "
        "memory_analysis() per device (arguments + outputs - aliased + temporaries), and times "
        "the devices (simulated devices share the host's memory); compiled from shapes alone",
        "peak RSS and step time (median of the timed steps, after one that compiles) measured "
        "in a fresh process per row, started from the imported run's weights as --init-from "
        "does, where the step's need left 4 GiB of the memory free at the time; otherwise the "
        "peak is estimated: the step's need plus the most a measured row of the same shape and "
        "setup took beyond its step",
    ]
    if args.no_record:
        print("\n".join(body))
    else:
        append_section("LoRA against full fine-tuning: memory and step time", details, body)


if __name__ == "__main__":
    main()
