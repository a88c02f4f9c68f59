"""Generation speed: the KV-cache decoder against re-running the whole context for every token.

The baseline is the tutorial's method made as fast as it can be: each new token pads the sequence
to the full context, runs the (jitted) model on all of it, and picks the next token on the host.
The cached decoder processes the prompt once and then one position per token, in one compiled
loop. Both decode greedily from the same prompt, 200 new tokens, no early stop, on the `minigpt`
configuration (randomly initialised: speed does not depend on the weights).

    python bench/bench_generate.py [--new-tokens 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import append_section, table  # noqa: E402
from minigpt.generate import generate_tokens  # noqa: E402
from minigpt.models import build_model, get_config  # noqa: E402

PROMPT = [7454, 2402, 257, 640]  # "Once upon a time" in GPT-2 tokens


forward = nnx.jit(lambda m, x: m(x))


def recompute(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The tutorial's way: the full padded context through the model for every token."""
    context = model.config.context_len
    rows = [list(p) for p in prompts]
    for _ in range(new_tokens):
        x = np.zeros((len(rows), context), np.int32)
        for i, row in enumerate(rows):
            x[i, :len(row)] = row
        logits = np.asarray(forward(model, jnp.asarray(x)))
        for i, row in enumerate(rows):
            row.append(int(np.argmax(logits[i, len(row) - 1])))
    return [row[len(p):] for row, p in zip(rows, prompts)]


def best_time(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minigpt")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = get_config(args.model)
    if len(PROMPT) + args.new_tokens > cfg.context_len:
        # Past the context the cached decoder goes on in windows (minigpt.generate); this
        # comparison stays inside one.
        parser.error(f"--new-tokens {args.new_tokens} and the {len(PROMPT)}-token prompt do not "
                     f"fit {args.model}'s context of {cfg.context_len}")
    model = build_model(cfg, rngs=nnx.Rngs(0))
    rows = []
    for batch in (1, 8):
        prompts = [PROMPT] * batch
        t_cache = best_time(lambda p=prompts: generate_tokens(
            model, p, max_new_tokens=args.new_tokens, temperature=0.0), args.repeats)
        forward(model, jnp.zeros((batch, cfg.context_len), jnp.int32))  # compile
        start = time.perf_counter()
        slow = recompute(model, prompts, args.new_tokens)
        t_full = time.perf_counter() - start
        fast = generate_tokens(model, prompts, max_new_tokens=args.new_tokens, temperature=0.0)
        assert fast == slow, "the cached decoder disagrees with full recompute"
        tokens = batch * args.new_tokens
        rows.append((batch, f"{tokens / t_full:,.0f}", f"{tokens / t_cache:,.0f}",
                     f"{t_full / t_cache:.1f}x"))
    append_section(f"generation, {args.model}", [
        f"{args.new_tokens} new tokens after a {len(PROMPT)}-token prompt, greedy, no early "
        f"stop; {jax.devices()[0].device_kind}, 1 device; compilation excluded; best of "
        f"{args.repeats} runs (cached), one run (recompute)",
        "both decoders produce identical tokens (checked before timing)",
    ], table(["batch", "full recompute tokens/s", "KV cache tokens/s", "speed-up"], rows))


if __name__ == "__main__":
    main()
