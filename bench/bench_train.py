"""Train-step benchmark: throughput, MFU, compile time and memory, per preset and by shape.

Every figure is measured against this machine in the same process: MFU here is achieved model
FLOP/s over the float32 matmul FLOP/s JAX reaches on the same machine (best of several 2048^3
matmuls, measured before and after the timed steps). Each configuration runs in its own process,
because the number of simulated devices is fixed when JAX starts.

    python bench/bench_train.py                 # everything (about 30 minutes on 2 cores)
    python bench/bench_train.py --only presets  # or context, depth, scan, kernels, pipeline, bubble

Sections: the `minigpt` model at the tutorial's shape (batch 32 x 256 tokens) on 1 device and
under every preset on 8 simulated CPU devices (same global batch); then step time as the context
grows (128..1024 at 8,192 tokens per step) and as the model deepens (2..16 layers); last, the
compile time of unrolled layers against `nnx.scan` over layers (4..32 layers); and the CPU-tuned
kernels against the plain reference ones (`model.kernels`), which decides what "auto" picks;
and the pipeline presets beside `dp`, with the bubble measured by fitting step time against the
number of pipeline microbatches at a fixed microbatch size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def worker(spec: dict) -> dict:
    """Time one configuration; runs in a fresh process with the device count already set."""
    import jax
    import numpy as np
    from flax import nnx

    from bench.report import timed
    from minigpt import pipeline, sharding
    from minigpt.config import TrainConfig
    from minigpt.models import build_model, get_config, replaced
    from minigpt.models.flops import flops_per_token, measure_matmul_peak
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    cfg = replaced(get_config(spec["model"]), **spec.get("overrides", {}))
    train_cfg = TrainConfig(batch_size=spec["batch"])
    B, T = spec["batch"], cfg.context_len
    peak = measure_matmul_peak(repeats=10)

    def build():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    layout = sharding.Layout.make(spec["preset"])
    model, optimizer = sharding.create_sharded(build, layout)
    rows = sharding.describe(layout, nnx.state(model, nnx.Param))
    rows += sharding.describe(layout, nnx.state(optimizer))
    state_bytes = sum(r["bytes_per_device"] for r in rows)
    rng = jax.random.key(0)
    rates = lr_schedule.lr_schedule(train_cfg)
    layout = layout.replace(pipeline=sharding.Pipeline(
        microbatches=spec.get("pipeline_microbatches", 0),
        schedule=spec.get("pipeline_schedule", "gpipe"),
        repeats=spec.get("pipeline_repeats", 1))).checked(model=spec["model"],
                                                          num_layers=cfg.num_layers)
    pipe = layout.pipeline
    if pipe.repeats > 1:  # the circular schedule keeps each stage's chunks side by side
        order = pipeline.schedules.layer_order(cfg.num_layers, layout.stages, pipe.repeats)
        for obj in (model, optimizer):
            nnx.update(obj, pipeline.reorder_layers(nnx.state(obj), order))
    with layout.active():
        batch = sharding.put_batch(host_batch, layout.batch_sharding())
        start = time.perf_counter()
        compiled = steps.train_step.lower(model, optimizer, batch, rng, rates).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        times, _ = timed(lambda: steps.train_step(model, optimizer, batch, rng, rates),
                         spec["repeats"])
    peak = max(peak, measure_matmul_peak(repeats=10))
    step_s = min(times)
    flops = flops_per_token(cfg, T) * B * T
    peak_bytes = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                  - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return {"step_s": step_s, "compile_s": compile_s, "tokens_per_s": B * T / step_s,
            "temp_bytes": memory.temp_size_in_bytes,
            "achieved": flops / step_s, "peak": peak, "mfu": flops / step_s / peak,
            "peak_bytes": peak_bytes, "state_bytes": state_bytes, "devices": layout.mesh.size,
            "context": T,
            "device_kind": jax.devices()[0].device_kind}


def run(spec: dict) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES",
                                                          "glibc.malloc.hugetlb=1"),
           "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={spec['devices']}"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"worker failed for {spec}:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {spec['label']}: {result['step_s']:.3f} s/step, MFU {result['mfu']:.3f}, "
          f"compile {result['compile_s']:.1f} s", flush=True)
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["presets", "context", "depth", "scan", "kernels",
                                                 "pipeline", "bubble", "stash"])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    base = {"model": "minigpt", "batch": 32, "repeats": args.repeats}
    if args.only in (None, "presets"):
        from minigpt.sharding import available_presets

        specs = [{**base, "label": "1 device", "preset": "dp", "devices": 1}]
        specs += [{**base, "label": name, "preset": name, "devices": 8}
                  for name in available_presets()]
        results = [run(s) for s in specs]
        one = results[0]
        body = table(
            ["configuration", "devices", "step (s)", "vs 1 device", "tokens/s",
             "achieved GFLOP/s", "MFU", "compile (s)", "peak memory/device (MiB)",
             "params + optimizer/device (MiB)"],
            [(s["label"], r["devices"], f"{r['step_s']:.3f}", f"{r['step_s'] / one['step_s']:.2f}x",
              f"{r['tokens_per_s']:,.0f}", f"{r['achieved'] / 1e9:,.0f}", f"{r['mfu']:.3f}",
              f"{r['compile_s']:.1f}", mib(r["peak_bytes"]), mib(r["state_bytes"]))
             for s, r in zip(specs, results)])
        append_section("train step, minigpt at the tutorial's shape", [
            "model `minigpt` (8 layers, width 256, 8 heads, feed-forward 256, vocabulary 50257 "
            "padded to 50304), batch 32 x 256 tokens, AdamW, dropout 0.1, float32",
            f"MFU = model FLOPs (6N + 12LDT per token) x tokens/s / the float32 matmul peak "
            f"measured in the same process ({one['peak'] / 1e9:,.0f} GFLOP/s for the 1-device "
            f"run); the 8 simulated devices share the same 2 cores, so their MFU is against the "
            f"same machine peak",
            f"best of {args.repeats} steps after one warm-up step; compile = lowering and "
            f"compiling the first step; peak memory from the compiled step's memory analysis",
        ], body)

    scaling = []
    if args.only in (None, "context"):
        scaling += [{**base, "label": f"context {t}", "preset": "dp", "devices": 1,
                     "batch": 8192 // t, "overrides": {"context_len": t}}
                    for t in (128, 256, 512, 1024)]
    if args.only in (None, "depth"):
        scaling += [{**base, "label": f"{n} layers", "preset": "dp", "devices": 1,
                     "overrides": {"num_layers": n}} for n in (2, 4, 8, 16)]
    if scaling:
        results = [run(s) for s in scaling]
        body = table(["configuration", "batch x context", "step (s)", "tokens/s", "MFU",
                      "compile (s)", "peak memory (MiB)"],
                     [(s["label"], f"{s['batch']} x {r['context']}",
                       f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.3f}",
                       f"{r['compile_s']:.1f}", mib(r["peak_bytes"]))
                      for s, r in zip(scaling, results)])
        described = {"context": "context: 8,192 tokens per step at every length "
                                "(batch = 8192 / context)",
                     "depth": "depth: batch 32 x 256 with 2 to 16 layers"}
        what = [d for k, d in described.items() if args.only in (None, k)]
        append_section("train step scaling, minigpt on 1 device", [
            "; ".join(what) + "; other settings as the tutorial's shape"], body)

    if args.only in (None, "scan"):
        depths = (4, 8, 16, 32)
        specs = [{**base, "batch": 8, "repeats": 1, "preset": "dp", "devices": 1,
                  "label": f"{n} layers, {'scan' if scan else 'unrolled'}",
                  "overrides": {"num_layers": n, "scan_layers": scan}}
                 for n in depths for scan in (False, True)]
        results = [run(s) for s in specs]
        rows = []
        for i, n in enumerate(depths):
            unrolled, scanned = results[2 * i], results[2 * i + 1]
            rows.append((n, f"{unrolled['compile_s']:.1f}", f"{scanned['compile_s']:.1f}",
                         f"{unrolled['step_s']:.3f}", f"{scanned['step_s']:.3f}"))
        body = table(["layers", "compile unrolled (s)", "compile scan (s)", "step unrolled (s)",
                      "step scan (s)"], rows)
        append_section("compile time: unrolled layers vs nnx.scan, minigpt on 1 device", [
            "minigpt's shape with 4 to 32 layers, batch 8 x 256; compile = lowering and "
            "compiling the first train step; step = one timed step after a warm-up step",
        ], body)

    if args.only in (None, "kernels"):
        specs = [{**base, "preset": "dp", "devices": 1, "label": f"{model} kernels={k}",
                  "model": model, "overrides": {"kernels": k}}
                 for model in ("minigpt", "llama-15m") for k in ("reference", "cpu")]
        results = [run(s) for s in specs]
        rows = []
        for i in range(0, len(specs), 2):
            ref, cpu = results[i], results[i + 1]
            rows.append((specs[i]["model"], f"{ref['step_s']:.3f}", f"{cpu['step_s']:.3f}",
                         f"{ref['step_s'] / cpu['step_s']:.2f}x", f"{ref['compile_s']:.1f}",
                         f"{cpu['compile_s']:.1f}", mib(ref["peak_bytes"]),
                         mib(cpu["peak_bytes"])))
        body = table(["model", "step reference (s)", "step cpu (s)", "cpu speed-up",
                      "compile reference (s)", "compile cpu (s)", "peak memory reference (MiB)",
                      "peak memory cpu (MiB)"], rows)
        append_section("kernels: plain reference vs CPU-tuned, 1 CPU device", [
            "batch 32 x the model's context (256), AdamW, float32, dropout as configured; "
            "`model.kernels=reference` (jax.nn attention, optax cross-entropy, autodiff) against "
            "`model.kernels=cpu` (blocked attention, fused chunked loss, row sums as products)",
        ], body)

    if args.only in (None, "pipeline"):
        pipeline_section(base)
    if args.only in (None, "bubble"):
        bubble_section(base)
    if args.only in (None, "stash"):
        stash_section(base)


PIPELINE_RUNS = [("pp", "gpipe", 1), ("pp", "1f1b", 1), ("dp_pp", "gpipe", 1),
                 ("dp_pp", "1f1b", 1), ("dp_pp", "gpipe", 2), ("fsdp_pp", "1f1b", 1),
                 ("pp_tp", "1f1b", 1), ("dp_pp_tp", "1f1b", 1), ("fsdp_pp_tp", "1f1b", 1)]


def pipeline_section(base: dict) -> None:
    """Pipeline presets and schedules beside dp at the same batch: step, compile, memory."""
    from bench.report import append_section, table
    from minigpt.pipeline import bubble_fraction
    from minigpt.sharding import default_microbatches

    stages = {"pp": 8, "dp_pp": 2, "fsdp_pp": 2, "pp_tp": 4, "dp_pp_tp": 2, "fsdp_pp_tp": 2}
    specs = [{**base, "label": "dp", "preset": "dp", "devices": 8}]
    for name, plan, repeats in PIPELINE_RUNS:
        m = default_microbatches(stages[name])
        label = f"{name} {plan}" + (f" R={repeats}" if repeats > 1 else "") + f" (M={m})"
        specs.append({**base, "label": label, "preset": name, "devices": 8,
                      "pipeline_microbatches": m, "pipeline_schedule": plan,
                      "pipeline_repeats": repeats})
    results = [run(s) for s in specs]
    dp = results[0]
    def bubble(s):
        if s["preset"] == "dp":
            return ""
        fraction = bubble_fraction(stages[s["preset"]], s["pipeline_microbatches"],
                                   s["pipeline_repeats"])
        return f"{fraction:.1%}"

    rows = [(s["label"], f"{r['step_s']:.3f}", f"{r['step_s'] / dp['step_s']:.2f}x",
             f"{r['compile_s']:.1f}", mib(r["peak_bytes"]), mib(r["state_bytes"]), bubble(s))
            for s, r in zip(specs, results)]
    body = table(["preset and schedule", "step (s)", "vs dp", "compile (s)",
                  "peak memory/device (MiB)", "params + optimizer/device (MiB)",
                  "bubble (formula)"], rows)
    append_section("pipeline presets and schedules beside dp, minigpt on 8 simulated devices", [
        "model `minigpt` (8 layers), batch 32 x 256 tokens, AdamW, dropout 0.1, float32; "
        "pipeline microbatches M = 2 x stages (the default); circular R = 2 on `dp_pp` "
        "(2 stages of 2 chunks of 2 layers)",
        "the embedding runs on the first stage as each microbatch enters, the head and loss "
        "on all stages, 1/S of the positions each, as each microbatch leaves the last",
        "caveat: the 8 simulated devices are threads sharing 2 cores; a stage with nothing to "
        "do at a tick skips its work (a conditional), so its core serves the other stages and "
        "the bubble costs little time here; on real devices each stage has its own compute "
        "and the bubble is the formula's",
    ], body)


def bubble_section(base: dict) -> None:
    """Step time under `pp` against M for each schedule, fitted by a line: the intercept is
    the bubble's cost if the formula holds. A 16-layer model with a 512-token vocabulary (2
    layers per stage, or 2 chunks of 1 for the circular schedule) keeps the head small."""
    import numpy as np

    from bench.report import append_section, table
    from minigpt.pipeline import bubble_fraction

    counts, S = (8, 16, 32), 8
    rows, fits = [], []
    for plan, repeats in (("gpipe", 1), ("1f1b", 1), ("gpipe", 2)):
        label = "circular R=2" if repeats > 1 else plan
        runs = [run({**base, "label": f"pp {label} M={m}", "preset": "pp", "devices": 8,
                     "batch": 2 * m, "pipeline_microbatches": m, "pipeline_schedule": plan,
                     "pipeline_repeats": repeats,
                     "overrides": {"vocab_size": 512, "num_layers": 16}})
                for m in counts]
        times = np.array([r["step_s"] for r in runs])
        slope, intercept = np.polyfit(counts, times, 1)  # time = intercept + slope * M
        fits.append(f"{label}: step = {intercept:.3f} s + {slope:.4f} s x M")
        rows += [(label, m, f"{t:.3f}", f"{intercept + slope * m:.3f}",
                  f"{max(intercept, 0) / (intercept + slope * m):.1%}",
                  f"{bubble_fraction(S, m, repeats):.1%}") for m, t in zip(counts, times)]
    body = table(["schedule", "M", "step (s)", "fit (s)", "measured bubble", "formula"], rows)
    body += ["", "fits: " + "; ".join(fits)]
    append_section("pipeline bubble: pp step time against microbatches, per schedule", [
        "model `minigpt` with 16 layers (width 256) and a 512-token vocabulary, 8 stages on 8 "
        "simulated devices, 2 sequences x 256 tokens per microbatch, batch 2 x M",
        "measured bubble = intercept / step time; formula = (S - 1) / (R M + S - 1)",
    ], body)


def stash_section(base: dict) -> None:
    """Temporary memory of the compiled train step against M at a fixed microbatch size:
    GPipe keeps every microbatch's stage input, 1F1B at most 2S - 1 of them."""
    from bench.report import append_section, table

    rows = []
    for plan in ("gpipe", "1f1b"):
        for m in (8, 16, 32):
            r = run({**base, "label": f"pp_tp {plan} M={m}", "preset": "pp_tp", "devices": 8,
                     "batch": 2 * m, "repeats": 1, "pipeline_microbatches": m,
                     "pipeline_schedule": plan, "overrides": {"vocab_size": 512}})
            rows.append((plan, m, mib(r["temp_bytes"]), f"{r['step_s']:.3f}"))
    body = table(["schedule", "M", "temp memory/device (MiB)", "step (s)"], rows)
    stage_input = 2 * 256 * 256 * 4 / 2**20
    append_section("pipeline memory: compiled step's temporaries against microbatches", [
        "model `minigpt` (8 layers, width 256) with a 512-token vocabulary under `pp_tp` (4 "
        "stages of tensor-parallel pairs), 2 sequences x 256 tokens per microbatch, batch 2 x M",
        f"one stage input (a microbatch's [2, 256, 256] float32 activations) is "
        f"{stage_input:.2f} MiB; temp memory from the compiled step's memory analysis",
    ], body)


if __name__ == "__main__":
    main()
