"""Where an accelerator's train step goes: one zoo model's step timed under variants (layers
scanned or unrolled, batch size, FP8 products, XLA flags) and split into its parts (forward,
forward and backward, the whole step with the optimizer), each after a warm-up call.

    python bench/bench_gpu_step.py --out FILE.json               # on a GPU: gpt2-small, stories-gpu
    python bench/bench_gpu_step.py --out FILE.json --tiny        # the same code on a CPU, tiny

Each XLA-flag variant runs in a process of its own (XLA reads its flags once). The results go
to FILE.json, a line per timing, and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=4, mlp_dim=128)
# (label, model, batch, sequence, model changes): the models whose steps are split
MODELS = {
    "gpu": (("gpt2-small", "gpt2-small", 16, 1024, {}),
            ("stories-gpu", "llama-cpu", 128, 512,  # as recipes/stories-gpu.toml has it
             dict(embed_dim=512, num_layers=8, num_heads=8, num_kv_heads=8, mlp_dim=1408,
                  tie_embeddings=True, qk_norm=True, scan_layers=False))),
    "tiny": (("llama-cpu tiny", "llama-cpu", 2, 64, TINY),),
}
FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def parts(label: str, model: str, batch: int, seq: int, changes: dict, repeats: int) -> list:
    """Forward, forward and backward, and the whole step, of one model as it is configured,
    then the whole step with its layers unrolled (or scanned, if they were unrolled), at twice
    the batch, and with FP8 products."""
    from bench.accelerator_steps import _time_train_step
    from minigpt.models import get_config

    rows = [_timed_parts(label, model, batch, seq, changes, repeats)]
    scanned = changes.get("scan_layers", get_config(model).scan_layers)
    for name, b, extra in (("layers " + ("unrolled" if scanned else "scanned"), batch,
                            {"scan_layers": not scanned}),
                           (f"batch {2 * batch}", 2 * batch, {}),
                           ("FP8 products (model.fp8)", batch, {"fp8": True})):
        run = _time_train_step(model, b, seq, {**changes, **extra}, "auto", "auto", repeats)
        rows.append({"label": f"{label}, {name}", "batch": b, "seq": seq,
                     "step_ms": 1e3 * run["step_s"], "tokens_per_s": run["tokens_per_s"],
                     "tflops": run["flops_per_step"] / run["step_s"] / 1e12,
                     "compile_s": run["compile_s"]})
    return rows


def _timed_parts(label: str, model: str, batch: int, seq: int, changes: dict,
                 repeats: int) -> dict:
    import numpy as np
    from flax import nnx

    from bench.accelerator_steps import _train_step
    from bench.report import timed
    from minigpt.models.flops import flops_per_token

    cfg, place, step, state = _train_step(model, batch, seq, changes, "auto", "auto")
    data = place(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32))
    forward = nnx.jit(lambda m, b: m.loss(b))
    backward = nnx.jit(nnx.value_and_grad(lambda m, b: m.loss(b)))
    found = {"label": label, "batch": batch, "seq": seq}
    for name, call in (("forward_ms", lambda: forward(state, data)),
                       ("forward_backward_ms", lambda: backward(state, data)),
                       ("step_ms", lambda: step(data))):
        began = time.perf_counter()
        times, _ = timed(call, repeats)
        found[name] = 1e3 * statistics.median(times)
        found[name.replace("_ms", "_compile_s")] = (time.perf_counter() - began - sum(times)
                                                    - statistics.median(times))
    flops = flops_per_token(cfg, seq) * batch * seq
    found.update(tokens_per_s=batch * seq / found["step_ms"] * 1e3,
                 tflops=flops / found["step_ms"] / 1e9)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the JSON lines go")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only-flags", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = MODELS["tiny" if args.tiny else "gpu"]
    rows = []
    if args.only_flags is None:
        for label, model, batch, seq, changes in models:
            rows += parts(label, model, batch, seq, changes, args.repeats)
        for flag in FLAGS:
            out = Path(args.out).with_suffix(".flag.json")
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}"}
            done = subprocess.run([sys.executable, __file__, "--out", str(out),
                                   f"--only-flags={flag}", "--repeats", str(args.repeats),
                                   *(["--tiny"] if args.tiny else [])], env=env, check=False)
            if done.returncode == 0:
                rows += json.loads(out.read_text())
            else:
                rows.append({"label": f"{models[0][0]}, {flag}", "error": done.returncode})
    else:
        from bench.accelerator_steps import _time_train_step

        label, model, batch, seq, changes = models[0]
        run = _time_train_step(model, batch, seq, changes, "auto", "auto", args.repeats)
        rows.append({"label": f"{label}, {args.only_flags}", "batch": batch, "seq": seq,
                     "step_ms": 1e3 * run["step_s"], "tokens_per_s": run["tokens_per_s"],
                     "tflops": run["flops_per_step"] / run["step_s"] / 1e12,
                     "compile_s": run["compile_s"]})
    Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.only_flags is None:
        for row in rows:
            print(row["label"], {k: round(v, 2) if isinstance(v, float) else v
                                 for k, v in row.items() if k != "label"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
