"""The compiled decode loop: prefill a batch of prompts into the key/value cache, then sample one
token per row per step, each new token costing one position of compute (`minigpt.generate`
runs it window by window and turns tokens into text).

Batches of prompts of different lengths are right-padded; row b writes its new tokens at its own
positions len_b, len_b + 1, ..., and a key is visible to a query only at or before the query's
position, so padding is never attended to. The whole loop is one `while_loop`; a row stops at
any of its stop tokens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import minigpt.models.fp8 as fp8
from minigpt.models.decoder import DecoderLM
from minigpt.models.execution import compute_dtype


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float, top_k: int,
                  top_p: float) -> jax.Array:
    """Draw one token per row from logits [B, V]; temperature 0 means greedy."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        # Keep the smallest set of tokens whose probability reaches top_p: a token stays if the
        # mass of the tokens strictly more likely than it is below top_p.
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("max_new", "cache_len", "temperature", "top_k",
                                             "top_p", "stop_ids", "stream"))
def decode(model: DecoderLM, tokens: jax.Array, lengths: jax.Array, rng: jax.Array,
           limit: jax.Array, start: jax.Array, done: jax.Array, *, max_new: int, cache_len: int,
           temperature: float, top_k: int, top_p: float, stop_ids: tuple[int, ...],
           stream: bool):
    """Prefill right-padded prompts [B, P] and sample up to `limit` (<= max_new) tokens per row;
    a row is done after any of `stop_ids`, and rows done give the first of them (-1 without
    any). New token i of this call is token `start + i` of the story: its key is
    fold_in(rng, start + i), so where a story's windows begin changes no draw. Its products
    are plain ones whatever `model.fp8` says (`fp8.suspended`: one token a row is bound by
    reading the weights, which FP8 would quantize afresh every step)."""
    with fp8.suspended():
        return _decode(model, tokens, lengths, rng, limit, start, done, max_new=max_new,
                       cache_len=cache_len, temperature=temperature, top_k=top_k, top_p=top_p,
                       stop_ids=stop_ids, stream=stream)


def _decode(model, tokens, lengths, rng, limit, start, done, *, max_new, cache_len,
            temperature, top_k, top_p, stop_ids, stream):
    eot_id = stop_ids[0] if stop_ids else -1
    B, P = tokens.shape
    cache = model.init_cache(B, cache_len, dtype=compute_dtype(model.config.dtype))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = model.decode(tokens, positions, cache)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    out = jnp.full((B, max_new), eot_id, jnp.int32)
    # The loop body is a trace of its own, which NNX modules must not cross: the weights ride
    # along in the loop state and the body rebuilds the model from them.
    graphdef, weights = nnx.split(model)

    def keep_going(state):
        i, _, _, _, done, _ = state
        return (i < limit) & ~jnp.all(done)

    def step(state):
        i, last, cache, out, done, weights = state
        token = sample_logits(last, jax.random.fold_in(rng, start + i), temperature=temperature,
                              top_k=top_k, top_p=top_p)
        token = jnp.where(done, eot_id, token)
        out = out.at[:, i].set(token)
        if stream:
            # Ordered effects are unsupported across devices; the step index lets the host put
            # tokens back in order should they ever arrive out of it.
            jax.debug.callback(stream_tokens, start + i, token)
        done = done | jnp.isin(token, jnp.asarray(stop_ids or (-1,), jnp.int32))
        logits, cache = nnx.merge(graphdef, weights).decode(token[:, None],
                                                            (lengths + i)[:, None], cache)
        return i + 1, logits[:, 0], cache, out, done, weights

    _, _, _, out, _, _ = jax.lax.while_loop(keep_going, step,
                                            (0, last, cache, out, done, weights))
    return out


def to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, also when other processes of a multi-process job hold parts."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class _StreamRouter:
    """Forwards each decode step's tokens to the current generation's callback, in step order.

    The compiled decode loop holds this one object, so a cached compilation reaches the callback
    of whichever call is running now rather than the callback of the call that compiled it.
    """

    def __init__(self):
        self.target: Callable[[np.ndarray], None] | None = None
        self.next, self.waiting = 0, {}

    @contextlib.contextmanager
    def to(self, target: Callable[[np.ndarray], None]):
        self.target, self.next, self.waiting = target, 0, {}
        try:
            yield
        finally:
            self.target = None

    def __call__(self, index, tokens) -> None:
        self.waiting[int(index)] = np.asarray(tokens)
        while self.next in self.waiting:
            tokens = self.waiting.pop(self.next)
            if self.target is not None:
                self.target(tokens)
            self.next += 1


stream_tokens = _StreamRouter()
