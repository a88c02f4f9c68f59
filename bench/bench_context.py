"""Context-parallel benchmark: memory per device as the context grows, and step time.

For `llama-tiny` with its context set to T = 1,024 .. 8,192: the compiled train step's memory
analysis (temporaries per device, where attention's scores live) under `dp` and under `cp` with
both strategies (`train.context_strategy`); the same for attention alone (one layer's forward
and backward, the part context parallelism changes), up to twice the longest T; then the step
time of `cp` against `dp` at a context where both fit, in alternating rounds. Every figure comes
from a fresh process on 8 simulated CPU devices. Appends a section to bench/RESULTS.md.

    python bench/bench_context.py                    # T = 1024,2048,4096,8192; time at 1024
    python bench/bench_context.py --seq-lens 1024,2048 --time-at 1024 --rounds 1

Every preset trains a global batch of 8 sequences: `dp` gives each device one whole sequence,
`cp` gives each device an eighth of every sequence. Both hold the same tokens per device and do
the same work per step; what differs is who attends to what. The model's other activations are
the same under both, so the difference in temporaries is attention's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEVICES = 8
BATCH = 8
MODEL = "llama-tiny"
CONFIGS = (("dp", "ring"), ("cp", "ring"), ("cp", "all_gather"))  # the strategy is cp's only
MEMORY = 24 * 2**30  # the 24 GB of the machine the issue names


def worker(spec: dict) -> dict:
    """Compile (and maybe time) one configuration in a process with the devices already set."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.report import timed
    from minigpt import parallel, sharding
    from minigpt.config import TrainConfig
    from minigpt.models import build_model, get_config
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    T = spec["seq_len"]
    cfg = dataclasses.replace(get_config(MODEL), context_len=T)
    how = sharding.ContextParallel(strategy=spec["strategy"])
    layout = sharding.Layout.make(spec["preset"])
    if spec.get("attention"):  # one layer's attention, forward and backward, shapes only
        with layout.replace(context_parallel=how).active():
            split = jax.sharding.NamedSharding(layout.mesh, sharding.logical_to_spec(
                ("batch", "seq", "heads", None)))
            q = jax.ShapeDtypeStruct((BATCH, T, cfg.num_heads, cfg.head_dim), jnp.float32,
                                     sharding=split)
            kv = jax.ShapeDtypeStruct((BATCH, T, cfg.kv_heads, cfg.head_dim), jnp.float32,
                                      sharding=split)
            grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(parallel.causal_attention(q, k, v)),
                                     argnums=(0, 1, 2)))
            memory = grads.lower(q, kv, kv).compile().memory_analysis()
        return {"temp": memory.temp_size_in_bytes}

    train_cfg = TrainConfig(batch_size=BATCH, seq_len=T, context_strategy=spec["strategy"])
    layout = layout.replace(context_parallel=how).checked(
        model=MODEL, num_layers=cfg.num_layers, batch_size=BATCH, seq_len=T)

    def build():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)

    model, optimizer = sharding.create_sharded(build, layout)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, T + 1)).astype(np.int32)
    rng, rates = jax.random.key(0), lr_schedule.lr_schedule(train_cfg)
    with layout.active():
        batch = sharding.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                   layout.batch_sharding())
        start = time.perf_counter()
        compiled = steps.train_step.lower(model, optimizer, batch, rng, rates).compile()
        compile_s = time.perf_counter() - start
        memory = compiled.memory_analysis()
        times = timed(lambda: compiled(model, optimizer, batch, rng, rates),
                      spec["repeats"])[0] if spec["repeats"] else []
    return {"temp": memory.temp_size_in_bytes,
            "resident": (memory.argument_size_in_bytes + memory.output_size_in_bytes
                         - memory.alias_size_in_bytes + memory.temp_size_in_bytes),
            "compile_s": compile_s, "step_s": min(times) if times else None,
            "load": os.getloadavg()[0]}


def label(spec: dict) -> str:
    what = spec["preset"] + (f" {spec['strategy']}" if spec["preset"] == "cp" else "")
    return f"{what}{' attention' if spec.get('attention') else ''} T={spec['seq_len']}"


def run(spec: dict, timeout: float) -> dict | None:
    """One configuration in a fresh process; None where it failed or ran out of time."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"  {label(spec)}: no result in {timeout:.0f} s", flush=True)
        return None
    if out.returncode:
        print(f"  {label(spec)}: failed\n{out.stderr[-2000:]}", flush=True)
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {label(spec)}: temporaries {mib(result['temp'])} MiB per device"
          + (f", {result['step_s']:.3f} s/step" if result.get("step_s") else ""), flush=True)
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def limits(lengths: list[int], dp: list[dict | None], ring: list[dict | None]) -> list[str]:
    """Where `dp` stops fitting in 24 GB while `cp` still trains: measured for the 8 simulated
    devices, which share the machine's memory, and extrapolated for one device with 24 GB of
    its own (a quadratic through dp's last three points, its [T, T] scores; a line through
    ring's last two)."""
    import numpy as np

    lines = []
    over = [(T, r) for T, r in zip(lengths, dp) if r and DEVICES * r["resident"] > MEMORY]
    last = max((T, r) for T, r in zip(lengths, ring) if r) if any(ring) else None
    if over and last:
        T, r = over[0]
        lines.append(f"Measured: the {DEVICES} simulated devices share this machine's memory. "
                     f"`dp` needs {DEVICES} x {r['resident'] / 2**30:,.1f} GiB at T = {T:,}, "
                     f"more than 24 GB; `cp` ring needs {DEVICES} x "
                     f"{last[1]['resident'] / 2**30:,.2f} GiB at T = {last[0]:,}.")

    def crossing(points, degree):
        Ts, sizes = (np.array(v, float) for v in zip(*points[-(degree + 1):]))
        fit = np.polyfit(Ts, sizes, degree)
        fit[-1] -= MEMORY
        roots = [x.real for x in np.roots(fit) if abs(x.imag) < 1e-9 and x.real > Ts[-1]]
        return min(roots) if roots else None

    dp_points = [(T, r["resident"]) for T, r in zip(lengths, dp) if r]
    ring_points = [(T, r["resident"]) for T, r in zip(lengths, ring) if r]
    if len(dp_points) >= 3 and len(ring_points) >= 2:
        at_dp, at_ring = crossing(dp_points, 2), crossing(ring_points, 1)
        lines.append(
            "Extrapolation, not a measurement: on devices with 24 GB each, `dp` would stop "
            f"fitting at about T = {at_dp:,.0f} (quadratic through T = "
            f"{', '.join(str(T) for T, _ in dp_points[-3:])}), `cp` ring at about "
            f"T = {at_ring:,.0f} (linear through T = "
            f"{', '.join(str(T) for T, _ in ring_points[-2:])}), if nothing else changed.")
    return lines


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192")
    parser.add_argument("--time-at", type=int, default=1024,
                        help="the context at which cp's step time is compared with dp's")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timing rounds, the configurations in turn (the best counts)")
    parser.add_argument("--timeout", type=float, default=1500,
                        help="seconds one configuration may take")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    lengths = [int(t) for t in args.seq_lens.split(",")]
    steps = {(p, s, T): run({"preset": p, "strategy": s, "seq_len": T, "repeats": 0},
                            args.timeout) for T in lengths for p, s in CONFIGS}
    attention_lengths = lengths + [2 * lengths[-1]]
    attention = {(s, T): run({"preset": "cp", "strategy": s, "seq_len": T, "attention": True},
                             args.timeout)
                 for T in attention_lengths for s in ("ring", "all_gather")}
    timed: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for p, s in CONFIGS:
            r = run({"preset": p, "strategy": s, "seq_len": args.time_at,
                     "repeats": args.repeats}, args.timeout)
            if r:
                timed.setdefault((p, s), []).append(r)

    def cell(r, key="temp"):
        return mib(r[key]) if r else "-"

    memory_rows = [[f"{T:,}", *(cell(steps[p, s, T]) for p, s in CONFIGS),
                    cell(steps["dp", "ring", T], "resident"),
                    cell(steps["cp", "ring", T], "resident")] for T in lengths]
    attention_rows = [[f"{T:,}", f"{T // DEVICES:,}", cell(attention["ring", T]),
                       cell(attention["all_gather", T])] for T in attention_lengths]
    time_rows = []
    for (p, s), results in timed.items():
        best = min(results, key=lambda r: r["step_s"])
        time_rows.append([p if p == "dp" else f"cp {s}", f"{best['step_s']:.3f}",
                          f"{BATCH * args.time_at / best['step_s']:,.0f}",
                          ", ".join(f"{r['step_s']:.2f}" for r in results),
                          f"{best['load']:.1f}"])
    body = [
        "Train step, per device (MiB; resident = arguments + unaliased outputs + "
        "temporaries):", "",
        *table(["T", "dp temp", "cp ring temp", "cp all-gather temp", "dp resident",
                "cp ring resident"], memory_rows), "",
        "Attention alone under `cp` (one layer, forward and backward), temporaries per device "
        "(MiB):", "",
        *table(["T", "T / N per device", "ring", "all-gather"], attention_rows), "",
        f"Step time at T = {args.time_at:,}: the best of {args.repeats} steps per process, "
        f"{args.rounds} processes per configuration in alternating rounds:", "",
        *table(["preset", "s/step", "tokens/s", "best per round", "load then"], time_rows), "",
        *limits(lengths, [steps["dp", "ring", T] for T in lengths],
                [steps["cp", "ring", T] for T in lengths]),
    ]
    append_section(f"context parallelism, {MODEL}, {DEVICES} simulated devices", [
        f"global batch {BATCH} under every preset: dp one sequence per device, cp an eighth "
        f"of each of the {BATCH} per device: {BATCH} x T / {DEVICES} tokens per device either "
        f"way",
        "memory from the compiled step's memory_analysis(), per device; kernels auto (the CPU "
        "ones); cp in the dual-chunk order, queries in tiles of 128 (minigpt.parallel.ring)"],
        body)


if __name__ == "__main__":
    main()
