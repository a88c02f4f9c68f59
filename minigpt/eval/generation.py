"""Continuations for the harness's `generate_until` requests, stopping where the host says.

A harness request stops at strings (`until`), which only the host can look for: it decodes the
last tokens and searches them. The prompts of a batch are run once into the key/value cache
(prefill), then the devices take a few steps at a time (`STEPS` tokens per row, or fewer where
every row has stopped) and hand the new tokens to the host, which decides which rows are done;
a row stops at the first token after which the host's `stop` says so, exactly as if it were
checked after every token. Compiled programs: one prefill per padded prompt length
(`minigpt.eval.scoring.bucket`) and one step loop, the cache always holding the whole context.

Decoding is greedy, or samples (temperature, top-k, top-p) with a key per batch and step; the
cache and its masking are the model's own (`DecoderLM.decode`), as `minigpt.generate` uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from minigpt import sharding
from minigpt.eval.loading import Evaluated
from minigpt.eval.scoring import bucket
from minigpt.models.execution import compute_dtype
from minigpt.models.sampling import sample_logits

STEPS = 16  # tokens a row takes on the devices between two looks from the host


def generate(evaluated: Evaluated, prompts: Sequence[Sequence[int]], *, max_new: int,
             stop: Callable[[list[int]], bool], batch_size: int,
             sampling: dict | None = None, seed: int = 0, desc: str = "generating",
             progress: bool = True) -> list[list[int]]:
    """The new tokens of each prompt (the token that stopped it included), at most `max_new`:
    a row stops after the first token for which `stop(tokens so far)` is true. Prompts must
    leave room for `max_new` tokens in the context. `sampling`: {"temperature", "top_k",
    "top_p"}, greedy where absent or at temperature 0."""
    context = evaluated.context
    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **(sampling or {})}
    rows = evaluated.ways("batch")
    batch_size = -(-batch_size // rows) * rows
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list = [None] * len(prompts)
    with tqdm(total=len(prompts), desc=desc, disable=not progress, unit="request") as bar, \
            evaluated.active():
        for number, start in enumerate(range(0, len(order), batch_size)):
            chosen = order[start:start + batch_size]
            new = _batch(evaluated.model, [list(prompts[i]) for i in chosen], batch_size,
                         context, max_new, stop, sampling,
                         jax.random.fold_in(jax.random.key(seed), number))
            for i, tokens in zip(chosen, new):
                results[i] = tokens
            bar.update(len(chosen))
    return results


def _batch(model, prompts: list[list[int]], batch_size: int, context: int, max_new: int,
           stop: Callable[[list[int]], bool], sampling: dict, key: jax.Array) -> list[list[int]]:
    """One batch of prompts (padded with empty rows to `batch_size`), run to its end."""
    longest = max(len(p) for p in prompts)
    if longest + max_new > context or min(len(p) for p in prompts) == 0:
        raise ValueError(f"prompts of 1 to {context - max_new} tokens leave room for {max_new} "
                         f"new ones in a context of {context}; got {longest}")
    P = bucket(longest, context)
    tokens = np.zeros((batch_size, P), np.int32)
    lengths = np.ones(batch_size, np.int32)  # padding rows: one token, and done from the start
    for b, prompt in enumerate(prompts):
        tokens[b, :len(prompt)], lengths[b] = prompt, len(prompt)
    done = np.arange(batch_size) >= len(prompts)
    last, cache = _prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), cache_len=context)
    new: list[list[int]] = [[] for _ in prompts]
    produced = 0
    while produced < max_new and not done.all():
        drawn, last, cache = _steps(model, last, cache, jnp.asarray(lengths), key,
                                    jnp.int32(produced), jnp.int32(max_new), jnp.asarray(done),
                                    steps=STEPS, **sampling)
        drawn = np.asarray(drawn)  # [B, STEPS], -1 past the steps taken
        for b in range(len(prompts)):
            for token in drawn[b]:
                if done[b] or token < 0:
                    break
                new[b].append(int(token))
                done[b] = stop(new[b]) or len(new[b]) >= max_new
        produced += STEPS
    return new


@sharding.jit(static_argnames=("cache_len",))
def _prefill(model, tokens: jax.Array, lengths: jax.Array, *, cache_len: int):
    """Run right-padded prompts [B, P] into a fresh cache of `cache_len` positions; the logits
    after each prompt's last token [B, V] and the cache."""
    B, P = tokens.shape
    cache = model.init_cache(B, cache_len, dtype=compute_dtype(model.config.dtype))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = model.decode(tokens, positions, cache)  # [B, P, V]
    return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], cache


@sharding.jit(static_argnames=("steps", "temperature", "top_k", "top_p"),
              donate_argnames=("cache",))
def _steps(model, last: jax.Array, cache, lengths: jax.Array, key: jax.Array,
           produced: jax.Array, limit: jax.Array, done: jax.Array, *, steps: int,
           temperature: float, top_k: int, top_p: float):
    """Up to `steps` tokens per row after `produced` ones, stopping early where every row is
    done or at `limit`; rows done draw -1 and leave the cache as it is."""
    B = last.shape[0]
    out = jnp.full((B, steps), -1, jnp.int32)
    # The loop body is a trace of its own, which NNX modules must not cross: the weights ride
    # along in the loop state and the body rebuilds the model from them.
    graphdef, weights = nnx.split(model)

    def going(state):
        i, _, _, _, weights = state
        return (i < steps) & (produced + i < limit) & ~jnp.all(done)

    def step(state):
        i, last, cache, out, weights = state
        token = sample_logits(last, jax.random.fold_in(key, produced + i),
                              temperature=temperature, top_k=top_k, top_p=top_p)
        out = out.at[:, i].set(jnp.where(done, -1, token))
        position = jnp.minimum(lengths + produced + i, cache[0].shape[-2] - 1)
        logits, cache = nnx.merge(graphdef, weights).decode(token[:, None], position[:, None],
                                                            cache)
        return i + 1, logits[:, 0], cache, out, weights

    _, last, cache, out, _ = jax.lax.while_loop(going, step, (0, last, cache, out, weights))
    return out, last, cache
