"""The serving engine's compiled programs: one decode step for every slot, and a prefill per
prompt-length bucket.

The engine keeps a fixed number of decode slots. Their key/value cache is one pair of arrays
[L, S, C, K, H] (layers, slots, positions, KV heads, head features), and what each slot decodes
next lives on the device beside it (`SlotState`: its last token, its position, its sampling
settings and random key), so a step needs nothing from the host and its outputs feed the next
step directly: the host reads step k's tokens while step k+1 runs. A prefill runs one prompt,
right-padded to its bucket, into a cache of the bucket's length, writes those rows into its
slot's and draws the first token. Both draw tokens the same way (`draw.choose`), each slot
with its own settings.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import minigpt.models.kernels as kernels
from minigpt.models import DecoderLM
from minigpt.serve.draw import TOP, choose


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What each slot decodes next, one entry per slot [S] (keys [S, 2]): its last token and
    the position it goes in, its sampling settings, its random key and how many tokens it has
    drawn (the index folded into the key)."""

    token: jax.Array
    position: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    key: jax.Array
    count: jax.Array

    @staticmethod
    def empty(slots: int) -> SlotState:
        return SlotState(token=jnp.zeros(slots, jnp.int32), position=jnp.zeros(slots, jnp.int32),
                         temperature=jnp.zeros(slots, jnp.float32),
                         top_p=jnp.ones(slots, jnp.float32),
                         key=jnp.zeros((slots, 2), jnp.uint32), count=jnp.zeros(slots, jnp.int32))


def seed_key(seed: int) -> np.ndarray:
    """A request's seed as the raw key data a slot keeps (threefry: two uint32 words)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed % 2**32)), np.uint32)


def cache_dtype(model: DecoderLM):
    return kernels.compute_dtype(model.config.dtype)


def decode_step(graphdef, weights, cache, slots: SlotState, active, want, *, length: int):
    """One token for every slot: each runs its last token at its position against its cache
    rows and draws the next (`active` [S]: the slots that hold a request; `want`: what any of
    them asks to know of its tokens, as `draw.choose` takes it). A slot's position stops at
    the cache's last row (`length` - 1), so an idle slot never writes outside it. Returns
    (cache, slots, drawn)."""
    model = nnx.merge(graphdef, weights)
    logits, cache = model.decode(slots.token[:, None], slots.position[:, None], cache)
    drawn = choose(logits[:, 0], slots.temperature, slots.top_p, slots.key, slots.count,
                   active, want)
    slots = dataclasses.replace(slots, token=drawn[0],
                                position=jnp.minimum(slots.position + 1, length - 1),
                                count=slots.count + 1)
    return cache, slots, drawn


def prefill(graphdef, weights, cache, slots: SlotState, slot, tokens, length, temperature,
            top_p, key, want, *, prompt_logprobs: bool):
    """Run one prompt, tokens [1, P] right-padded (its first `length` real), into slot `slot`:
    its keys and values fill that slot's first P cache rows (rows past `length` are overwritten
    before any query can see them: a key is visible only at or before its query's position),
    and its first token is drawn from the last real position's logits. With `prompt_logprobs`,
    also every prompt token's log-probability given the ones before it [P - 1] and each
    position's TOP alternatives [P, TOP]. Returns (cache, slots, drawn, prompt or None)."""
    model = nnx.merge(graphdef, weights)
    P = tokens.shape[1]
    rows = model.init_cache(1, P, dtype=cache_dtype(model))
    positions = jnp.arange(P, dtype=jnp.int32)[None]
    logits, rows = model.decode(tokens, positions, rows)  # [1, P, V]
    last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, keepdims=True)  # [1, V]
    drawn = choose(last, temperature[None], top_p[None], key[None], jnp.zeros(1, jnp.int32),
                   jnp.ones(1, bool), want)
    cache = tuple(jax.lax.dynamic_update_slice(c, r.astype(c.dtype), (0, slot, 0, 0, 0))
                  for c, r in zip(cache, rows))
    slots = SlotState(token=slots.token.at[slot].set(drawn[0][0]),
                      position=slots.position.at[slot].set(length),
                      temperature=slots.temperature.at[slot].set(temperature),
                      top_p=slots.top_p.at[slot].set(top_p), key=slots.key.at[slot].set(key),
                      count=slots.count.at[slot].set(1))
    prompt = None
    if prompt_logprobs:
        logprobs = jax.nn.log_softmax(logits[0], axis=-1)  # [P, V]
        given = jnp.take_along_axis(logprobs[:-1], tokens[0, 1:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
        prompt = (given, top_ids.astype(jnp.int32), top_logprobs)
    return cache, slots, drawn, prompt


class Programs:
    """The compiled programs for one model and one cache shape: `step` (compiled once) and
    `prefill(bucket, prompt_logprobs)` (compiled once per bucket and flag; `compiled` lists
    them, for the log and /health). The cache and slot state are donated: each call hands
    back the ones to use next."""

    def __init__(self, model: DecoderLM, slots: int, length: int, *, smallest: int = 32):
        self.graphdef, self.weights = nnx.split(model)
        self.slots, self.length = slots, length
        self.buckets = buckets(length, smallest)
        self.compiled: list[str] = []
        self._step = jax.jit(functools.partial(decode_step, self.graphdef, length=length),
                             donate_argnums=(1, 2))
        self._prefills: dict[tuple[int, bool], object] = {}
        self._empty = jax.jit(lambda: model.init_cache(slots, length,
                                                       dtype=cache_dtype(model)))

    def empty(self):
        """A fresh cache [L, S, C, K, H] x 2 and slot state."""
        return self._empty(), SlotState.empty(self.slots)

    def step(self, cache, slots: SlotState, active: np.ndarray, want: int):
        return self._step(self.weights, cache, slots, jnp.asarray(active), jnp.int32(want))

    def prefill(self, cache, slots: SlotState, slot: int, prompt: list[int], *,
                temperature: float, top_p: float, key: np.ndarray, want: int,
                prompt_logprobs: bool):
        """Prefill `prompt` into `slot`, right-padded to its bucket (`bucket_for`)."""
        P = next(b for b in self.buckets if b >= len(prompt))
        tokens = np.zeros((1, P), np.int32)
        tokens[0, :len(prompt)] = prompt
        fn = self._prefills.get((P, prompt_logprobs))
        if fn is None:
            fn = self._prefills[P, prompt_logprobs] = jax.jit(
                functools.partial(prefill, self.graphdef, prompt_logprobs=prompt_logprobs),
                donate_argnums=(1, 2))
            self.compiled.append(f"prefill {P}" + (" with prompt logprobs" if prompt_logprobs
                                                   else ""))
        return fn(self.weights, cache, slots, jnp.int32(slot), jnp.asarray(tokens),
                  jnp.int32(len(prompt)), jnp.float32(temperature), jnp.float32(top_p),
                  jnp.asarray(key), jnp.int32(want))


def buckets(length: int, smallest: int = 32) -> list[int]:
    """The prompt lengths prefill compiles for: powers of two from `smallest`, and `length`
    itself (a bounded count, log2(length / smallest) + 1 at most)."""
    sizes, size = [], smallest
    while size < length:
        sizes.append(size)
        size *= 2
    return [*sizes, length]
