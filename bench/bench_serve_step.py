"""The decoding engine's decode program alone, by how its layers run
(`minigpt.decoding.programs.HOWS`) and by its row count: 16 slots of 160 positions, every slot
prefilled, then the program of b rows (1, 4, 16) for 1 and 8 steps a call, the fastest of 5
calls each, and the time the first call took (compiling). Prints one line per model, way and
row count; the figures behind `programs.default_how` and the engine's row counts.

    python bench/bench_serve_step.py [--models smol-135m stories-cpu]
        [--hows "per layer" scanned unrolled] [--rows 1 4 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_serve import MAX_LEN, model_config  # noqa: E402


def main() -> None:
    from flax import nnx

    from minigpt.decoding import Request
    from minigpt.decoding.programs import HOWS, Programs
    from minigpt.models import build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smol-135m", "stories-cpu"])
    parser.add_argument("--hows", nargs="+", default=list(HOWS), choices=HOWS)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    for name in args.models:
        model = build_model(model_config(name), rngs=nnx.Rngs(0))
        for how in args.hows:
            programs = Programs(model, args.slots, MAX_LEN, how=how)
            cache, slots = programs.empty()
            requests = [Request([1 + i, 2, 3], MAX_LEN - 8) for i in range(args.slots)]
            prefill = ("prefill", args.slots, programs.lengths[0], False)
            cache, slots, _, _ = programs.run(prefill, programs.prefill_args(
                cache, slots, list(range(args.slots)), [r.prompt for r in requests],
                args.slots, programs.lengths[0], [0] * args.slots,
                [r.max_new for r in requests], [()] * args.slots, requests, 0))
            for b in args.rows:
                decode = ("decode", b, False, 0)
                began = time.perf_counter()
                cache, slots, drawn, _ = programs.run(decode, programs.decode_args(
                    cache, slots, list(range(b)), b, 1))
                np.asarray(drawn[0])
                compiling = time.perf_counter() - began
                best = {}
                for count in (1, 8):
                    best[count] = float("inf")
                    for _ in range(5):
                        began = time.perf_counter()
                        cache, slots, drawn, _ = programs.run(decode, programs.decode_args(
                            cache, slots, list(range(b)), b, count))
                        np.asarray(drawn[0])
                        best[count] = min(best[count], (time.perf_counter() - began) / count)
                print(f"{name}, {how}, {b} of {args.slots} rows: first call {compiling:.1f} s; "
                      f"a step {best[1] * 1e3:.2f} ms one a call, {best[8] * 1e3:.2f} ms eight "
                      f"a call", flush=True)
            del programs, cache, slots


if __name__ == "__main__":
    main()
