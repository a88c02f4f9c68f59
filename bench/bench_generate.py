"""Generation speed: the KV-cache decoder against re-running the whole context for every token.

The baseline is the tutorial's method made as fast as it can be: each new token pads the sequence
to the full context, runs the (jitted) model on all of it, and picks the next token on the host.
The cached decoder processes the prompt once and then one position per token, in one compiled
loop. Both decode greedily from the same prompt, 200 new tokens, no early stop, on the `minigpt`
configuration (randomly initialised: speed does not depend on the weights).

    python bench/bench_generate.py [--new-tokens 200] [--repeats 3]
    python bench/bench_generate.py --model gpt2-small --batches 1 --new-tokens 32 \
        --no-recompute --dtype bfloat16        # where a decoded token's time goes, cached only

`--no-recompute` times the cached decoder alone (recomputing gpt2-small's 1,024-position context
for every token takes minutes on a CPU); `--dtype` sets the model's compute dtype (bfloat16 is
what accelerators decode in); `--no-record` prints the table instead of appending it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import append_section, machine, table  # noqa: E402
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
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--dtype", default="", help="the model's compute dtype (default: its own)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="time the cached decoder alone")
    parser.add_argument("--no-record", action="store_true", help="print, do not append")
    args = parser.parse_args()

    cfg = get_config(args.model)
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    if len(PROMPT) + args.new_tokens > cfg.context_len:
        # Past the context the cached decoder goes on in windows (minigpt.generate); this
        # comparison stays inside one.
        parser.error(f"--new-tokens {args.new_tokens} and the {len(PROMPT)}-token prompt do not "
                     f"fit {args.model}'s context of {cfg.context_len}")
    model = build_model(cfg, rngs=nnx.Rngs(0))
    rows = []
    for batch in map(int, args.batches.split(",")):
        prompts = [PROMPT] * batch
        t_cache = best_time(lambda p=prompts: generate_tokens(
            model, p, max_new_tokens=args.new_tokens, temperature=0.0), args.repeats)
        tokens = batch * args.new_tokens
        if args.no_recompute:
            rows.append((batch, f"{tokens / t_cache:,.1f}",
                         f"{1e3 * t_cache / args.new_tokens:.1f}"))
            continue
        forward(model, jnp.zeros((batch, cfg.context_len), jnp.int32))  # compile
        start = time.perf_counter()
        slow = recompute(model, prompts, args.new_tokens)
        t_full = time.perf_counter() - start
        fast = generate_tokens(model, prompts, max_new_tokens=args.new_tokens, temperature=0.0)
        assert fast == slow, "the cached decoder disagrees with full recompute"
        rows.append((batch, f"{tokens / t_full:,.0f}", f"{tokens / t_cache:,.0f}",
                     f"{t_full / t_cache:.1f}x"))
    details = [f"{args.new_tokens} new tokens after a {len(PROMPT)}-token prompt, greedy, no "
               f"early stop, model.dtype {cfg.dtype}; "
               f"{jax.devices()[0].device_kind}, 1 device; compilation excluded; best of "
               f"{args.repeats} runs (cached)" + ("" if args.no_recompute else
                                                  ", one run (recompute)")]
    if args.no_recompute:
        body = table(["batch", "KV cache tokens/s", "ms per step"], rows)
    else:
        details.append("both decoders produce identical tokens (checked before timing)")
        body = table(["batch", "full recompute tokens/s", "KV cache tokens/s", "speed-up"], rows)
    if args.no_record:
        print("\n".join([f"generation, {args.model}", *details, machine(), *body]))
    else:
        append_section(f"generation, {args.model}", details, body)


if __name__ == "__main__":
    main()
