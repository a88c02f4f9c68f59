"""The arithmetic of one pair of chunks in context-parallel attention (`minigpt.parallel.ring`):
a query chunk's online softmax folding in a block of keys and values, and that pair's share of
the gradients, each run over tiles of TILE queries so that no score array exceeds [TILE, C] per
head and the temporaries grow linearly in the chunk length C. Dimension letters as in
`minigpt.models.layers`; G is the query heads sharing a key/value head (N = K G).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Queries per tile: the [TILE, C] scores of a tile stay in cache for small heads and keep the
# temporaries linear in the chunk length C.
TILE = 128


# The block arithmetic ----------------------------------------------------------------------


def _tile(C: int) -> int:
    """The longest tile of at most TILE queries that divides a chunk of C."""
    return max(t for t in range(1, min(C, TILE) + 1) if C % t == 0)


def _scores(q, k, start, diag: bool, q_segments=None, k_segments=None):
    """Scores [B, t, K, G, S] (float32) of queries q [B, t, K, G, H] at offsets start.. of their
    chunk against keys k [B, S, K, H]; on the diagonal (the same chunk), a query sees the keys
    at its own offset and before; with document ids [B, t] and [B, S], only its document's."""
    s = jnp.einsum("btkgh,bskh->btkgs", q, k, preferred_element_type=jnp.float32)
    if diag:
        visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(q.shape[1])[:, None]
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]  # [B, t, S]
        s = jnp.where(same[:, :, None, None, :], s, -jnp.inf)
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


def fold_chunk(q, k, v, acc, diag: bool, q_segments=None, k_segments=None):
    """Fold keys and values k, v [B, S, K, H] into the online softmax of queries q
    [B, C, K, G, H]: acc holds the unnormalised output o [B, C, K, G, H], the running max m and
    sum l [B, C, K, G] (float32); diag: q and k are the same chunk (causal mask); document ids
    q_segments [B, C] and k_segments [B, S] mask keys of other documents."""
    def one(inputs, start):
        qt, (o, m, total), qs = inputs
        s = _scores(qt, k, start, diag, qs, k_segments)
        top = jnp.maximum(m, jnp.max(s, axis=-1))
        # Without documents `top` is finite: every query has seen a key by now (its own
        # chunk's come first). With them a query may have seen none yet; it shifts by 0 then,
        # and its output and sum stay 0 until a key of its document comes.
        shift = top if qs is None else jnp.where(jnp.isfinite(top), top, 0.0)
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        o = o * rescale[..., None] + jnp.einsum("btkgs,bskh->btkgh", p.astype(v.dtype), v,
                                                preferred_element_type=jnp.float32)
        return o, top, total * rescale + jnp.sum(p, axis=-1)

    return _by_tiles(one, (q, acc, q_segments), q.shape[1])


def grad_chunk(q, k, v, g, lse, delta, d_k, d_v, diag: bool, q_segments=None,
                k_segments=None):
    """One pair's share of the gradients (float32): d q [B, C, K, G, H] for the (scaled)
    queries, and d_k, d_v [B, S, K, H] with the pair's share added. g is the output's gradient,
    lse and delta [B, C, K, G] the forward's log-sum-exp and rowsum(g * output)."""
    def one(carry, inputs, start):
        d_k, d_v = carry
        qt, gt, lt, dt, qs = inputs
        p = jnp.exp(_scores(qt, k, start, diag, qs, k_segments) - lt[..., None])  # [B,t,K,G,S]
        d_v = d_v + jnp.einsum("btkgs,btkgh->bskh", p, gt)
        d_s = p * (jnp.einsum("btkgh,bskh->btkgs", gt, v) - dt[..., None])
        d_k = d_k + jnp.einsum("btkgs,btkgh->bskh", d_s, qt)
        return (d_k, d_v), jnp.einsum("btkgs,bskh->btkgh", d_s, k)

    (d_k, d_v), d_q = _by_tiles(one, (q, g, lse, delta, q_segments), q.shape[1],
                                carry=(d_k, d_v))
    return d_q, d_k, d_v
