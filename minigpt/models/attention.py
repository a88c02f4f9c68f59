"""Fused attention: the flash-attention kernels JAX ships for accelerators, in the model's layout.

`minigpt.models.kernels` decides which kernel runs (it alone asks which backend is running); this
module wraps each kernel to the layout the layers use, q [B, T, N, H], k and v [B, S, K, H] with
N a multiple of K (grouped-query heads) and document ids [B, T] (`minigpt.models.masks`), and
says when a kernel will not take a call, by raising `Refused` with the reason, so that the caller
runs XLA's attention instead:

- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's flash attention on
  NVIDIA GPUs. Causality is its own mask type (it skips the blocks above the diagonal), grouped
  heads it takes as they are, documents and a sliding window as a boolean `mask` (JAX hands it
  to cuDNN as an additive bias [B, 1, T, S]). It refuses float32 inputs, head sizes that are
  not a multiple of 8 or exceed 128 (256 from Hopper on), a sequence of odd length with a mask
  while training, and a backend without cuDNN, each by raising while it is traced.
- `splash`: the Splash attention Pallas kernel for TPUs (`jax.experimental.pallas.ops.tpu`):
  causality as a block mask whose empty blocks it skips, documents as segment ids, grouped heads
  as they are; for sequences that cut into its 128-position blocks. A Pallas kernel is not
  partitioned by the compiler, so under a preset that splits the batch or the heads over
  devices each device runs it on its own rows and heads (`parallel.attention_on_each_device`).

Neither is used by the context-parallel ring (`minigpt.parallel.ring` says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minigpt import parallel
from minigpt.models.masks import AttentionInputs

# Splash's query and key blocks (its default block sizes): a sequence must cut into them.
SPLASH_BLOCK = 128

# What JAX raises, while tracing, for a call a fused kernel will not take.
REFUSALS = (ValueError, NotImplementedError, RuntimeError, ImportError)


class Refused(Exception):
    """A fused kernel will not take this call; the message says why."""


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
          causal: bool = True) -> jax.Array:
    """Attention by cuDNN's flash kernel: causal, within what a boolean `mask` [B, 1, T, S]
    allows (documents and a window, `AttentionInputs.mask`; the cached decode's own mask with
    `causal=False`)."""
    try:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                            implementation="cudnn")
    except REFUSALS as error:
        raise Refused(f"{type(error).__name__}: {error}") from None


def splash(q: jax.Array, k: jax.Array, v: jax.Array, attn: AttentionInputs | None = None, *,
           interpret: bool = False) -> jax.Array:
    """Causal attention by the Splash Pallas kernel (within each document, as `attn`'s ids
    say); `interpret` runs it in Pallas' interpreter (any backend, slowly: the tests' way to
    check it on a CPU). A sliding window it refuses: its local mask is built before tracing,
    and a window that changes layer by layer inside a scan is traced data."""
    if attn is not None and attn.windowed:
        raise Refused("a sliding window is traced data here, and Splash builds its masks "
                      "before tracing")
    segments = None if attn is None else attn.segment_ids
    T = q.shape[1]
    if T % SPLASH_BLOCK:
        raise Refused(f"a sequence of {T} positions does not cut into Splash's "
                      f"{SPLASH_BLOCK}-position blocks")
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: F401
    except ImportError as error:
        raise Refused(f"Splash attention is not importable here ({error})") from None
    local = functools.partial(_splash_local, interpret=interpret)
    try:  # a Pallas call is not partitioned by the compiler: each device runs its own share
        return parallel.attention_on_each_device(local, q, k, v, segments)
    except REFUSALS as error:
        raise Refused(f"{type(error).__name__}: {error}") from None


@functools.cache
def _splash_kernel(T: int, heads: int, interpret: bool):
    """The Splash kernel for causal attention over T positions with `heads` query heads
    (built once per shape: it works out which blocks the mask leaves empty)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((T, T))] * heads)
    return sa.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q, k, v, segments=None, *, interpret: bool):
    """Splash on one device's rows and heads: the kernel takes one sequence, heads first
    ([N, T, H] queries, [K, S, H] keys and values), scaled queries; mapped over the rows."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    H = q.shape[-1]
    kernel = _splash_kernel(q.shape[1], q.shape[2], interpret)
    heads_first = (0, 2, 1, 3)  # [B, T, N, H] <-> [B, N, T, H]
    q = (q * jnp.asarray(H ** -0.5, q.dtype)).transpose(heads_first)
    k, v = k.transpose(heads_first), v.transpose(heads_first)
    if segments is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(
            q, k, v, segments)
    return out.transpose(heads_first)
