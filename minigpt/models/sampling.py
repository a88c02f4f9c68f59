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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import minigpt.models.fp8 as fp8
from minigpt import sharding
from minigpt.models.decoder import DecoderLM
from minigpt.models.execution import backend, compute_dtype, kernel_set
from minigpt.models.layers import Dense, Embedding


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float, top_k: int,
                  top_p: float, bisect_top_k: bool = False) -> jax.Array:
    """Draw one token per row from logits [B, V]; temperature 0 means greedy. `bisect_top_k`
    finds the k-th largest logit with `kth_largest` instead of `jax.lax.top_k` (the same value:
    the same tokens), which XLA's CPU backend runs far faster."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = (kth_largest(logits, top_k) if bisect_top_k
               else jax.lax.top_k(logits, top_k)[0][:, -1])[:, None]  # [B, 1]
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


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest value of each row of x [B, V] (counting repeats, as `jax.lax.top_k`'s
    k-th value), exactly: a bisection over float32's order written as unsigned integers, each
    of its 32 steps a count of the row's values at or above a candidate [B].

    `jax.lax.top_k` sorts on XLA's CPU backend: over GPT-2's 50,304 logits it took 14 ms a row
    at batch 1 and 167-277 ms at batch 16 on a 2-core VM, where this takes 0.7 and 18-24 ms
    (bench/RESULTS.md, 2026-11-27); accelerators keep `top_k`, which they run as a kernel of
    its own, where 32 reductions would be 32 launches.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(0x80000000)
    keys = jnp.where(bits & sign, ~bits, bits | sign)  # ordered as the floats they encode
    lo = jnp.zeros(x.shape[:1], jnp.uint32)  # at least k keys are >= lo, throughout
    hi = jnp.full(x.shape[:1], 0xFFFFFFFF, jnp.uint32)  # and none above hi is the answer

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # the upper middle, without overflow
        enough = jnp.sum(keys >= mid[:, None], axis=-1) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(jnp.where(lo & sign, lo ^ sign, ~lo), jnp.float32)


# Compiled through the sharding-aware jit: a decode traced under one layout's rules (or kernel
# settings) is never reused under another's.
@sharding.jit(static_argnames=("max_new", "cache_len", "temperature", "top_k", "top_p",
                               "stop_ids", "stream"))
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
    bisect_top_k = kernel_set(model.config.kernels) == "cpu"  # see kth_largest
    # The loop body is a trace of its own, which NNX modules must not cross: the weights ride
    # along in the loop state and the body rebuilds the model from them, each projection's and
    # table's already in the dtype its layer computes in. On a CPU each layer's weights are
    # first copied out of the stack, once a call: XLA there copies every slice of a stacked
    # weight that a product reads, at every token (`BlockStack.unstacked`).
    graphdef, weights = nnx.split(model)
    weights = in_compute_dtypes(model, weights)
    layers = None
    if backend() == "cpu":
        layers = nnx.merge(graphdef, weights).blocks.unstacked()
    cache = model.init_cache(B, cache_len, dtype=compute_dtype(model.config.dtype),
                             per_layer=layers is not None)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = model.decode(tokens, positions, cache, layers)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    out = jnp.full((B, max_new), eot_id, jnp.int32)

    def keep_going(state):
        i, _, _, _, done, _, _ = state
        return (i < limit) & ~jnp.all(done)

    def step(state):
        i, last, cache, out, done, weights, layers = state
        token = sample_logits(last, jax.random.fold_in(rng, start + i), temperature=temperature,
                              top_k=top_k, top_p=top_p, bisect_top_k=bisect_top_k)
        token = jnp.where(done, eot_id, token)
        out = out.at[:, i].set(token)
        if stream:
            # Ordered effects are unsupported across devices; the step index lets the host put
            # tokens back in order should they ever arrive out of it.
            jax.debug.callback(stream_tokens, start + i, token)
        done = done | jnp.isin(token, jnp.asarray(stop_ids or (-1,), jnp.int32))
        logits, cache = nnx.merge(graphdef, weights).decode(token[:, None],
                                                            (lengths + i)[:, None], cache, layers)
        return i + 1, logits[:, 0], cache, out, done, weights, layers

    _, _, _, out, _, _, _ = jax.lax.while_loop(keep_going, step,
                                               (0, last, cache, out, done, weights, layers))
    return out


def in_compute_dtypes(model: nnx.Module, weights: nnx.State) -> nnx.State:
    """`weights` (the model's state) with the kernels, biases and tables of its `Dense` and
    `Embedding` layers cast to the dtype each of them computes in, which is what those layers
    cast them to on every call: the same values, so the same tokens.

    Cast once before the decode loop rather than in every step: XLA left the casts of the
    float32 parameters inside the loop (the stacked weights' per-layer slices converted at every
    token), so a bfloat16 decode read the float32 weights, wrote them as bfloat16 and read them
    again for each token. Other parameters (norms' scales and biases, which the norms use in
    float32; adapters) are left as they are.
    """
    dtypes = {(*path, name): layer.dtype for path, layer in nnx.iter_graph(model)
              if isinstance(layer, Dense | Embedding) for name in ("kernel", "bias", "table")}

    def cast(path, variable):
        dtype = dtypes.get(tuple(getattr(key, "key", key) for key in path))
        value = variable.get_value()
        return variable if dtype in (None, value.dtype) else variable.replace(value.astype(dtype))

    return jax.tree_util.tree_map_with_path(cast, weights,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


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
