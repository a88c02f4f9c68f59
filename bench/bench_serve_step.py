"""The serving engine's decode step alone, by how its layers run (`minigpt.serve.steps.HOWS`):
`Programs.step` for 16 slots of 160 positions, 1 and 8 steps a call, the fastest of 5 calls
each, and the time the first call took (compiling). Prints one line per model and way; the
figures behind `steps.default_how`.

    python bench/bench_serve_step.py [--models smol-135m stories-cpu]
        [--hows "per layer" scanned unrolled]
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

    from minigpt.models import build_model
    from minigpt.serve.steps import HOWS, Programs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smol-135m", "stories-cpu"])
    parser.add_argument("--hows", nargs="+", default=list(HOWS), choices=HOWS)
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    for name in args.models:
        model = build_model(model_config(name), rngs=nnx.Rngs(0))
        for how in args.hows:
            programs = Programs(model, args.slots, MAX_LEN, how=how)
            cache, slots = programs.empty()
            active = np.ones(args.slots, bool)
            began = time.perf_counter()
            cache, slots, drawn = programs.step(cache, slots, active, 0, 1)
            np.asarray(drawn[0])
            compiling = time.perf_counter() - began
            best = {}
            for count in (1, 8):
                best[count] = float("inf")
                for _ in range(5):
                    began = time.perf_counter()
                    cache, slots, drawn = programs.step(cache, slots, active, 0, count)
                    np.asarray(drawn[0])
                    best[count] = min(best[count], (time.perf_counter() - began) / count)
            print(f"{name}, {how}: first call {compiling:.1f} s; a step {best[1] * 1e3:.1f} ms "
                  f"one a call, {best[8] * 1e3:.1f} ms eight a call", flush=True)
            del programs, cache, slots


if __name__ == "__main__":
    main()
