"""Mixture-of-experts benchmark: `moe-cpu` against the dense `llama-cpu`, which uses the same
parameters per token, under `dp` and `ep` on 8 simulated CPU devices.

    python bench/bench_moe.py                # about 15 minutes on 2 cores
    python bench/bench_moe.py --rounds 5 --repeats 5

Each configuration runs in a fresh process (the device count is fixed when JAX starts): one
AdamW train step compiled, one warm-up step, then the best of `--repeats` timed steps, at batch
32 x 256 tokens. On a shared machine one process can land on a busy minute: every configuration
runs once per round, each round starting one configuration later, and the table keeps each
one's best round. Beside the two models under both presets it times what decided the defaults:
under `ep`, the tokens travelling to their experts by all-to-all against every expert's weights
gathered to every device (`minigpt.sharding.Experts`, in the context the preset enters); the
grouped products as XLA's CPU backend runs `jax.lax.ragged_dot` (`model.kernels=reference`)
against the CPU kernel; and the capacity dispatch (factor 1.25), whose all-to-all the
compiler infers.

    python bench/bench_moe.py --balance RUN [RUN ...]

reads trained runs' metrics.jsonl instead (a 10-minute TinyStories run of bench/bench_stories.py,
say) and records how balanced the router stayed: the largest expert share and the router's
load-balancing loss through each run.
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

BATCH = 32


def worker(spec: dict) -> dict:
    """Time one configuration; runs in a fresh process with 8 simulated devices."""
    import jax
    import numpy as np
    from flax import nnx

    from bench.report import timed
    from minigpt import sharding
    from minigpt.config import TrainConfig
    from minigpt.models import build_model, count_params, get_config, replaced
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    cfg = replaced(get_config(spec["model"]), **spec.get("overrides", {}))
    train_cfg = TrainConfig(batch_size=BATCH)
    T = cfg.context_len

    def build():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, T + 1)).astype(np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    preset = sharding.load_preset(spec["preset"])
    mesh = sharding.make_mesh(preset)
    model, optimizer = sharding.create_sharded(build, sharding.Layout(preset, mesh))
    rng, rates = jax.random.key(0), lr_schedule.lr_schedule(train_cfg)
    how = sharding.Experts(move=spec.get("move", "tokens"))
    with sharding.Layout(preset, mesh, experts=how).active():
        batch = sharding.put_batch(host_batch, sharding.Layout(preset, mesh).batch_sharding())
        start = time.perf_counter()
        compiled = steps.train_step.lower(model, optimizer, batch, rng, rates).compile()
        compile_s = time.perf_counter() - start
        text = compiled.as_text()
        times, reported = timed(lambda: steps.train_step(model, optimizer, batch, rng, rates),
                                spec["repeats"])
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    step_s = min(times)
    return {"step_s": step_s, "compile_s": compile_s, "tokens_per_s": BATCH * T / step_s,
            "params": count_params(abstract, cfg),
            "active": count_params(abstract, cfg, active=True),
            "all_to_all": sum(" all-to-all(" in line for line in text.splitlines()),
            "all_gather": sum(" all-gather(" in line for line in text.splitlines()),
            "largest_share": float(reported.get("expert_share_max", 0.0)),
            "dropped": int(reported.get("dropped_tokens", 0))}


def run(spec: dict) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"worker failed for {spec}:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {spec['label']}: {result['step_s']:.3f} s/step, {result['tokens_per_s']:,.0f} "
          f"tokens/s, compile {result['compile_s']:.1f} s", flush=True)
    return result


def balance(runs: list[str]) -> None:
    """Append the router's balance through each run (its metrics.jsonl) to RESULTS.md."""
    from bench.report import append_section, table
    from minigpt.train.metrics import read_metrics

    rows = []
    for run in runs:
        records = [r for r in read_metrics(Path(run) / "metrics.jsonl") if "expert_share" in r]
        if not records:
            sys.exit(f"{run}: no expert shares in its metrics.jsonl (not a mixture of experts?)")
        last = records[-1]["step"]
        marks = sorted({max(1, round(last * f)) for f in (0.01, 0.1, 0.25, 0.5, 0.75, 1.0)})
        for step in marks:
            r = min(records, key=lambda r: abs(r["step"] - step))
            rows.append((Path(run).name, r["step"], f"{r['expert_share_max']:.3f}",
                         f"{min(r['expert_share']):.3f}", f"{r['aux_loss']:.4f}",
                         f"{r['loss']:.3f}"))
    append_section("mixture of experts: the router's balance through training", [
        "largest and smallest expert share of the assignments (summed over the layers) at "
        "steps through each run, with the weighted load-balancing loss (its minimum, for an "
        "even router, is the coefficient times k) and the training cross-entropy; an even "
        "share is 1/E = 0.125 for 8 experts",
    ], table(["run", "step", "largest share", "smallest share", "aux loss", "loss"], rows))


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration")
    parser.add_argument("--balance", nargs="+", metavar="RUN",
                        help="record the router's balance through trained runs instead")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.balance:
        balance(args.balance)
        return
    base = {"repeats": args.repeats}
    specs = [
        {**base, "label": "llama-cpu, dp", "model": "llama-cpu", "preset": "dp"},
        {**base, "label": "moe-cpu, dp", "model": "moe-cpu", "preset": "dp"},
        {**base, "label": "llama-cpu, ep", "model": "llama-cpu", "preset": "ep"},
        {**base, "label": "moe-cpu, ep (tokens by all-to-all)", "model": "moe-cpu",
         "preset": "ep"},
        {**base, "label": "moe-cpu, ep (experts' weights gathered)", "model": "moe-cpu",
         "preset": "ep", "move": "weights"},
        {**base, "label": "moe-cpu, dp, ragged_dot (kernels=reference)", "model": "moe-cpu",
         "preset": "dp", "overrides": {"kernels": "reference"}},
        {**base, "label": "moe-cpu, dp, capacity 1.25", "model": "moe-cpu", "preset": "dp",
         "overrides": {"moe_capacity_factor": 1.25}},
        {**base, "label": "moe-cpu, ep, capacity 1.25", "model": "moe-cpu", "preset": "ep",
         "overrides": {"moe_capacity_factor": 1.25}},
    ]
    best: dict[int, dict] = {}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}", flush=True)
        for i in [(j + round_) % len(specs) for j in range(len(specs))]:
            result = run(specs[i])
            if i not in best or result["step_s"] < best[i]["step_s"]:
                best[i] = result
    results = [best[i] for i in range(len(specs))]
    dense = results[0]
    body = table(
        ["configuration", "params", "active/token", "step (s)", "tokens/s", "vs llama-cpu dp",
         "compile (s)", "all-to-alls", "all-gathers", "largest share", "dropped"],
        [(s["label"], f"{r['params']:,}", f"{r['active']:,}", f"{r['step_s']:.3f}",
          f"{r['tokens_per_s']:,.0f}", f"{dense['step_s'] / r['step_s']:.2f}x",
          f"{r['compile_s']:.1f}", r["all_to_all"], r["all_gather"],
          f"{r['largest_share']:.3f}" if r["largest_share"] else "-",
          r["dropped"] if "capacity" in s["label"] else "-")
         for s, r in zip(specs, results)])
    append_section("mixture of experts: moe-cpu against llama-cpu, 8 simulated devices", [
        f"batch {BATCH} x 256 tokens, AdamW, float32, dropless routing unless a capacity "
        f"factor is given; moe-cpu: llama-cpu with each feed-forward made 8 SwiGLU experts of "
        f"half its width, 2 per token (the same parameters per token, plus a router)",
        f"best of {args.repeats} steps after one warm-up step, each configuration in a fresh "
        f"process, the best of {args.rounds} rounds (each round starting one configuration "
        f"later); compile = lowering and compiling the first step (of that round); "
        f"collectives counted in the compiled step; largest share = the most-used expert's "
        f"share of the assignments at the last timed step (random tokens, an untrained "
        f"router)",
    ], body)


if __name__ == "__main__":
    main()
