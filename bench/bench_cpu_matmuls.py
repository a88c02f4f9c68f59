"""The matrix products of the `stories-cpu` step, one at a time: GFLOP/s and cores used.

At llama2.c's shape (bench/bench_llama2c.py) minigpt's step spends its time in matrix products.
This script times each kind the step runs, compiled alone by XLA on one CPU device, and reports
how many of the machine's cores it kept busy (process CPU time over wall time), beside PyTorch's
`matmul` on the same shapes where torch is installed. The projections are plain 2-D products
[B*T, D] x [D, F]; attention's are batched over sequences and heads, one small product per
(sequence, head) pair, and a head is only 32 features wide.

    python bench/bench_cpu_matmuls.py               # about a minute; appends to RESULTS.md
    python bench/bench_cpu_matmuls.py --no-record
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.report import append_section, table  # noqa: E402

# (what, batch, m, k, n): the step's products at batch 8, context 256, width 128, 4 heads of
# 32, SwiGLU 384, vocabulary 4,096 (loss chunks of 128 tokens), attention blocks of 64 queries.
SHAPES = [
    ("query/key/value/out projection", 1, 2048, 128, 128),
    ("gate/up projection", 1, 2048, 128, 384),
    ("down projection", 1, 2048, 384, 128),
    ("weight gradient, gate/up", 1, 128, 2048, 384),
    ("output head, one loss chunk", 1, 128, 128, 4096),
    ("attention scores, last query block", 32, 64, 32, 256),
    ("attention scores x values, last block", 32, 64, 256, 32),
    ("attention, key gradient", 32, 256, 64, 32),
    ("attention scores, whole sequence", 32, 256, 32, 256),
]


def measure(f, args, flops: float, seconds: float) -> tuple[float, float]:
    """(GFLOP/s, cores busy) of calling f(*args) repeatedly for about `seconds`."""
    f(*args)
    reps = max(5, int(seconds * 30e9 / flops))
    cpu0, wall0 = os.times(), time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    if hasattr(out, "block_until_ready"):
        out.block_until_ready()
    wall, cpu1 = time.perf_counter() - wall0, os.times()
    busy = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return flops * reps / wall / 1e9, busy / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args()
    try:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    rows = []
    for what, batch, m, k, n in SHAPES:
        a = rng.standard_normal((batch, m, k), dtype=np.float32)
        b = rng.standard_normal((batch, k, n), dtype=np.float32)
        flops = 2.0 * batch * m * k * n
        if batch == 1:
            a, b = a[0], b[0]
            product = jax.jit(jnp.matmul)
        else:
            product = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
        rate, cores = measure(product, (jnp.asarray(a), jnp.asarray(b)), flops, args.seconds)
        shape = f"{batch} x [{m}, {k}] x [{k}, {n}]" if batch > 1 else f"[{m}, {k}] x [{k}, {n}]"
        row = [what, shape, f"{rate:.1f}", f"{cores:.2f}"]
        if torch is not None:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            t_rate, t_cores = measure(torch.matmul, (ta, tb), flops, args.seconds)
            row += [f"{t_rate:.1f}", f"{t_cores:.2f}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    header = ["product", "shape", "XLA GFLOP/s", "XLA cores busy"]
    if torch is not None:
        header += ["torch GFLOP/s", "torch cores busy"]
    lines = table(header, rows)
    if args.no_record:
        print("\n".join(lines))
    else:
        append_section(
            "matrix products of the stories-cpu step, one CPU device",
            [f"jax {jax.__version__}" + (f", torch {torch.__version__}" if torch else "")
             + f"; float32; {os.cpu_count()} cores",
             "each product compiled alone and called repeatedly; cores busy = process CPU time "
             "/ wall time"],
            lines)


if __name__ == "__main__":
    main()
