"""The arithmetic of one pair of chunks in context-parallel attention (`minigpt.parallel.ring`):
a query chunk's online softmax folding in a block of keys and values, and that pair's share of
the gradients, each run over tiles of queries (`ContextParallel.tile` of the active context,
128 unless set) so that no score array exceeds [tile, C] per head and the temporaries grow
linearly in the chunk length C. Dimension letters as in `minigpt.models.layers`; G is the
query heads sharing a key/value head (N = K G).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minigpt import sharding

# The block arithmetic ----------------------------------------------------------------------


def _tile(C: int) -> int:
    """The longest tile of at most `ContextParallel.tile` queries that divides a chunk of C:
    read from the context the step was compiled under, so another tile compiles anew."""
    most = sharding.active().context_parallel.tile
    return max(t for t in range(1, min(C, most) + 1) if C % t == 0)


def _scores(q, k, start, diag: bool, q_marks=(None, None), k_marks=(None, None), window=None):
    """Scores [B, t, K, G, S] (float32) of queries q [B, t, K, G, H] at offsets start.. of their
    chunk against keys k [B, S, K, H]; on the diagonal (the same chunk), a query sees the keys
    at its own offset and before; with document ids ([B, t] and [B, S], the marks' first),
    only its document's; with positions (their second) and a `window`, only those in it."""
    s = jnp.einsum("btkgh,bskh->btkgs", q, k, preferred_element_type=jnp.float32)
    if diag:
        visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(q.shape[1])[:, None]
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    (q_segments, q_positions), (k_segments, k_positions) = q_marks, k_marks
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]  # [B, t, S]
        s = jnp.where(same[:, :, None, None, :], s, -jnp.inf)
    if q_positions is not None:  # as `minigpt.models.masks.within_window`: q - k < W
        near = (q_positions[:, :, None] - k_positions[:, None, :] < window) | (window <= 0)
        s = jnp.where(near[:, :, None, None, :], s, -jnp.inf)  # [B, t, S] -> scores' shape
    return s


def _by_tiles(fn, xs, C: int, carry=None):
    """Run fn over tiles of the chunk axis (1) of every array in xs, in order: a `lax.scan`
    with `carry`, or a `lax.map` without; tiles' results joined back along the chunk axis."""
    t = _tile(C)

    def split(x):  # [B, C, ...] -> [C/t, B, t, ...]
        return jnp.swapaxes(x.reshape(x.shape[0], C // t, t, *x.shape[2:]), 0, 1)

    def join(x):
        return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], C, *x.shape[3:])

    tiles = (jax.tree.map(split, xs), jnp.arange(C // t) * t)
    if carry is None:
        return jax.tree.map(join, jax.lax.map(lambda a: fn(*a), tiles))
    carry, out = jax.lax.scan(lambda c, a: fn(c, *a), carry, tiles)
    return carry, jax.tree.map(join, out)


def fold_chunk(q, k, v, acc, diag: bool, q_marks=(None, None), k_marks=(None, None),
               window=None):
    """Fold keys and values k, v [B, S, K, H] into the online softmax of queries q
    [B, C, K, G, H]: acc holds the unnormalised output o [B, C, K, G, H], the running max m and
    sum l [B, C, K, G] (float32); diag: q and k are the same chunk (causal mask); the marks
    (document ids [B, C] and [B, S], and positions where a `window` applies) mask keys of
    other documents and outside the window."""
    def one(inputs, start):
        qt, (o, m, total), qm = inputs
        s = _scores(qt, k, start, diag, qm, k_marks, window)
        top = jnp.maximum(m, jnp.max(s, axis=-1))
        # Without documents or a window `top` is finite: every query has seen a key by now
        # (its own chunk's come first). With them a query may have seen none yet; it shifts by
        # 0 then, and its output and sum stay 0 until a key it may see comes.
        masked = qm[0] is not None or qm[1] is not None
        shift = jnp.where(jnp.isfinite(top), top, 0.0) if masked else top
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        o = o * rescale[..., None] + jnp.einsum("btkgs,bskh->btkgh", p.astype(v.dtype), v,
                                                preferred_element_type=jnp.float32)
        return o, top, total * rescale + jnp.sum(p, axis=-1)

    return _by_tiles(one, (q, acc, q_marks), q.shape[1])


def grad_chunk(q, k, v, g, lse, delta, d_k, d_v, diag: bool, q_marks=(None, None),
               k_marks=(None, None), window=None):
    """One pair's share of the gradients (float32): d q [B, C, K, G, H] for the (scaled)
    queries, and d_k, d_v [B, S, K, H] with the pair's share added. g is the output's gradient,
    lse and delta [B, C, K, G] the forward's log-sum-exp and rowsum(g * output)."""
    def one(carry, inputs, start):
        d_k, d_v = carry
        qt, gt, lt, dt, qm = inputs
        p = jnp.exp(_scores(qt, k, start, diag, qm, k_marks, window)
                    - lt[..., None])  # [B,t,K,G,S]
        d_v = d_v + jnp.einsum("btkgs,btkgh->bskh", p, gt)
        d_s = p * (jnp.einsum("btkgh,bskh->btkgs", gt, v) - dt[..., None])
        d_k = d_k + jnp.einsum("btkgs,btkgh->bskh", d_s, qt)
        return (d_k, d_v), jnp.einsum("btkgs,bskh->btkgh", d_s, k)

    (d_k, d_v), d_q = _by_tiles(one, (q, g, lse, delta, q_marks), q.shape[1],
                                carry=(d_k, d_v))
    return d_q, d_k, d_v
