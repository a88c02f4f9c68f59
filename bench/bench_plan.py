"""The planner against XLA and against the clock, on 8 simulated CPU devices.

`grid` (memory): for a grid of cases (every family of the zoo and two imported shapes, every
family of presets, remat, LoRA, bfloat16, gradient accumulation, pipeline microbatches and
schedules, both context strategies, the accelerator kernels), the planned total per device
beside what XLA allocates for the real train step, compiled for the simulated devices
(`minigpt.plan.compiled`: arguments + outputs - aliased + temporaries), and their ratio.

`speed` (ranking): for `minigpt` and `llama-15m` under dp, fsdp, dp_tp, fsdp_tp and dp_pp, the
planner's estimated step time beside the measured one (the median of timed steps after a warm-up,
each configuration in a fresh process), and the Spearman correlation of the two rankings.

    python bench/bench_plan.py grid                  # about 20 minutes on a 2-core machine
    python bench/bench_plan.py grid --cases 0-9      # a slice of the grid
    python bench/bench_plan.py speed                 # about 10 minutes

Both append a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEVICES = 8
MIB = 2**20

# Two imported shapes, as their config.json files on the Hub say (no weights needed to plan).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "vocab_size": 128256, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16"}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": True, "vocab_size": 151936, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"}
IMPORTED = {"Llama-3.2-1B": LLAMA_3_2_1B, "Qwen2.5-0.5B": QWEN2_5_0_5B}

# (model, preset, batch, sequence, --set overrides)
GRID = [
    ("minigpt", "dp", 32, 256, {}), ("minigpt", "fsdp", 32, 256, {}),
    ("minigpt", "tp", 32, 256, {}), ("minigpt", "dp_tp", 32, 256, {}),
    ("minigpt", "fsdp_tp", 32, 256, {}), ("minigpt", "pp", 32, 256, {}),
    ("minigpt", "dp_pp", 32, 256, {}), ("minigpt", "fsdp_pp", 32, 256, {}),
    ("minigpt", "cp", 32, 256, {}), ("minigpt", "dp_cp", 32, 256, {}),
    ("minigpt", "fsdp_cp", 32, 256, {}), ("minigpt", "cp_tp", 32, 256, {}),
    ("minigpt", "fsdp", 32, 256, {"model.remat": "true"}),
    ("minigpt", "dp", 32, 256, {"train.lora_rank": "8"}),
    ("minigpt", "dp", 32, 256, {"model.dtype": "bfloat16"}),
    ("minigpt", "fsdp_cp", 32, 256, {"train.context_strategy": "all_gather"}),
    ("minigpt-tiny8", "pp", 32, 128, {"train.pipeline_microbatches": "16",
                                      "train.pipeline_schedule": "gpipe"}),
    ("llama-15m", "dp", 32, 256, {}), ("llama-15m", "fsdp", 32, 256, {}),
    ("llama-15m", "dp_tp", 32, 256, {}), ("llama-15m", "fsdp_tp", 32, 256, {}),
    ("llama-15m", "dp_pp", 32, 256, {}), ("llama-15m", "fsdp_cp", 32, 256, {}),
    ("llama-15m", "fsdp_cp_tp", 32, 256, {}),
    ("llama-15m", "dp_tp", 32, 256, {"model.remat": "true"}),
    ("llama-15m", "fsdp", 32, 256, {"train.lora_rank": "8"}),
    ("llama-15m", "fsdp", 32, 256, {"train.microbatches": "4"}),
    ("llama-15m", "dp_pp", 32, 256, {"train.pipeline_microbatches": "8",
                                     "train.pipeline_schedule": "gpipe"}),
    ("llama-15m", "dp_pp", 32, 256, {"train.pipeline_microbatches": "4",
                                     "train.pipeline_repeats": "2"}),
    ("llama-15m", "cp", 8, 256, {}),
    ("llama-15m", "cp", 8, 256, {"train.context_strategy": "all_gather"}),
    ("llama-15m", "dp", 32, 256, {"model.kernels": "reference"}),
    ("gpt2-mini", "fsdp", 16, 256, {}), ("gpt2-mini", "dp_tp", 16, 256, {}),
    ("gpt2-mini", "tp", 16, 256, {}), ("gpt2-mini", "pp_tp", 16, 256, {}),
    ("gpt2-mini", "dp_pp_tp", 16, 256, {}), ("gpt2-mini", "fsdp_pp_tp", 16, 256, {}),
    ("moe-cpu", "dp", 16, 256, {}), ("moe-cpu", "fsdp", 16, 256, {}),
    ("moe-cpu", "ep", 16, 256, {}), ("moe-cpu", "fsdp_ep", 16, 256, {}),
    ("moe-tiny", "ep", 32, 128, {}),
    ("Llama-3.2-1B", "fsdp", 8, 512, {}),
    ("Llama-3.2-1B", "fsdp_tp", 8, 512, {"model.remat": "true"}),
    ("Llama-3.2-1B", "fsdp", 8, 512, {"train.lora_rank": "8"}),
    ("Qwen2.5-0.5B", "dp_tp", 8, 256, {}),
]
SPEED_MODELS = ("minigpt", "llama-15m")
SPEED_PRESETS = ("dp", "fsdp", "dp_tp", "fsdp_tp", "dp_pp")


def configs(model: str, batch: int, seq: int, overrides: dict[str, str], folder: Path):
    """The model and training configs of a case, an imported shape read from its config.json
    the way `python -m minigpt.plan --hf` reads it."""
    from minigpt.config import TrainConfig
    from minigpt.plan.cli import hf_config
    from minigpt.runs.overrides import parse_overrides

    if model in IMPORTED:
        path = folder / model / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(IMPORTED[model]))
        model_cfg = hf_config(path.parent)
    else:
        from minigpt.models import get_config

        model_cfg = get_config(model)
    from minigpt.models import replaced

    changes = parse_overrides([f"{k}={v}" for k, v in overrides.items()])
    return (replaced(model_cfg, **changes["model"]),
            TrainConfig(model=model, batch_size=batch, seq_len=seq, **changes["train"]))


def grid(indices: list[int]) -> list[dict]:
    """Plan and compile each case of the grid in this process (8 simulated devices)."""
    from minigpt import plan
    from minigpt.plan.compiled import compile_step
    from minigpt.runs import resolved

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i in indices:
            model, name, batch, seq, overrides = GRID[i]
            model_cfg, train_cfg = configs(model, batch, seq, overrides, Path(folder))
            start = time.perf_counter()
            estimate = plan.estimate(model_cfg, train_cfg, name, DEVICES)
            planned = time.perf_counter() - start
            on = dataclasses.replace(train_cfg, preset=name)
            compiled = compile_step(model_cfg, train_cfg, resolved.layout(model_cfg, on))
            rows.append({"case": i, "model": model, "preset": name, "batch": batch,
                         "seq": seq, "settings": overrides, "plan": estimate.total,
                         "phase": estimate.memory.phase, "compiled": compiled.total,
                         "plan_seconds": planned})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def speed_worker(spec: dict) -> dict:
    """Estimate and time one (model, preset) in this process."""
    import jax
    import numpy as np

    import minigpt.optim.lr_schedule as lr_schedule
    import minigpt.optim.state as adapters
    import minigpt.optim.steps as steps
    from bench.report import timed
    from minigpt import plan, sharding
    from minigpt.config import TrainConfig
    from minigpt.models import get_config

    model_cfg = get_config(spec["model"])
    train_cfg = TrainConfig(model=spec["model"], batch_size=spec["batch"], seq_len=spec["seq"],
                            document_mask=False)
    estimate = plan.estimate(model_cfg, train_cfg, spec["preset"], DEVICES)
    layout = sharding.Layout.make(spec["preset"])
    model, optimizer = sharding.create_sharded(lambda: adapters.build(model_cfg, train_cfg),
                                               layout)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_cfg.vocab_size, (spec["batch"], spec["seq"] + 1), np.int32)
    with layout.replace(pipeline=estimate.pipeline).active():
        batch = sharding.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                   layout.batch_sharding())
        rates, key = lr_schedule.lr_schedule(train_cfg), jax.random.key(0)
        seconds, _ = timed(lambda: steps.train_step(model, optimizer, batch, key, rates),
                           spec["steps"])
    return {**spec, "measured": statistics.median(seconds)}


def estimated(rows: list[dict]) -> list[dict]:
    """The planner's estimates for the timed configurations, all in this process: one
    measurement of the machine's peak and bandwidth for every preset, as a plan makes them."""
    from minigpt import plan
    from minigpt.config import TrainConfig
    from minigpt.models import get_config

    device = plan.device("cpu", "float32", DEVICES)
    out = []
    for row in rows:
        model_cfg = get_config(row["model"])
        train_cfg = TrainConfig(model=row["model"], batch_size=row["batch"], seq_len=row["seq"],
                                document_mask=False)
        speed = plan.estimate(model_cfg, train_cfg, row["preset"], DEVICES,
                              device=device).speed
        out.append({**row, "estimated": speed.seconds, "compute": speed.compute,
                    "memory": speed.memory, "communication": speed.communication,
                    "device": device.describe()})
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (no ties expected)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0] * len(x)
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def speed(batch: int, seq: int, steps: int) -> list[dict]:
    """Each (model, preset) estimated and timed in a fresh process with 8 simulated devices."""
    rows = []
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    for model in SPEED_MODELS:
        for name in SPEED_PRESETS:
            spec = {"model": model, "preset": name, "batch": batch, "seq": seq,
                    "steps": steps}
            out = subprocess.run([sys.executable, __file__, "worker", json.dumps(spec)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return estimated(rows)


def report_grid(rows: list[dict]) -> None:
    from bench.report import append_section, table

    ratios = [r["plan"] / r["compiled"] for r in rows]
    inside = sum(0.85 <= q <= 1.15 for q in ratios)
    body = table(["model", "preset", "batch x seq", "settings", "plan MiB", "compiled MiB",
                  "plan / compiled"],
                 [[r["model"], r["preset"], f"{r['batch']} x {r['seq']}",
                   " ".join(f"{k}={v}" for k, v in r["settings"].items()) or "-",
                   f"{r['plan'] / MIB:,.1f}", f"{r['compiled'] / MIB:,.1f}", f"{q:.3f}"]
                  for r, q in zip(rows, ratios)])
    append_section(
        "the planner against XLA's memory analysis, 8 simulated devices",
        [f"{len(rows)} cases: the planned total per device (no compile) beside the compiled "
         f"train step's arguments + outputs - aliased + temporaries",
         f"within 15%: {inside} of {len(rows)}; ratios from {min(ratios):.3f} to "
         f"{max(ratios):.3f}; planning took {max(r['plan_seconds'] for r in rows):.2f} s at "
         f"most per case"], body)


def report_speed(rows: list[dict]) -> None:
    from bench.report import append_section, table

    lines = []
    for model in SPEED_MODELS:
        mine = [r for r in rows if r["model"] == model]
        rho = spearman([r["estimated"] for r in mine], [r["measured"] for r in mine])
        lines.append(f"{model}: Spearman {rho:.2f} over {', '.join(r['preset'] for r in mine)}")
    body = table(["model", "preset", "estimated s", "measured s (median)", "compute s",
                  "memory s", "communication s"],
                 [[r["model"], r["preset"], f"{r['estimated']:.3f}", f"{r['measured']:.3f}",
                   f"{r['compute']:.3f}", f"{r['memory']:.3f}", f"{r['communication']:.3f}"]
                  for r in rows])
    append_section(
        "the planner's speed ranking against measured steps, 8 simulated devices",
        [f"batch {rows[0]['batch']} x {rows[0]['seq']}, {rows[0]['steps']} timed steps after a "
         f"warm-up, each configuration in a fresh process; {rows[0]['device']}", *lines], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["grid", "speed", "worker"])
    parser.add_argument("spec", nargs="?", help="(worker) the configuration as JSON")
    parser.add_argument("--cases", default="", help="grid cases to run, e.g. 0-9 (default all)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.what == "worker":
        print(json.dumps(speed_worker(json.loads(args.spec))))
        return
    from minigpt.runtime import set_simulated_devices

    set_simulated_devices(DEVICES)
    if args.what == "speed":
        report_speed(speed(args.batch, args.seq, args.steps))
        return
    first, _, last = args.cases.partition("-")
    indices = (list(range(int(first), int(last or first) + 1)) if args.cases
               else list(range(len(GRID))))
    report_grid(grid(indices))


if __name__ == "__main__":
    main()
