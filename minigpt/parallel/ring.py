"""Context-parallel attention: causal self-attention over a sequence split across devices.

Under a preset with the rule `seq = "context"` every activation [B, T, ...] is split along T over
a mesh axis of N devices. Everything but attention works position by position and the compiler
partitions it unaided; attention does not: a query needs the keys and values of every earlier
position, most of which live on other devices. This module is that one collective region
(`jax.shard_map`, manual over the sequence's mesh axis only; batch, heads and the other mesh axes
stay automatic), in the strategy `train.context_strategy` puts in the sharding context
(`sharding.ContextParallel`):

- "all_gather": each device gathers every key and value (O(T) of them per device) and attends
  its own queries to them, block by block;
- "ring": the key/value blocks travel round the ring of devices by collective permutes, one hop
  a step, each folded into an online softmax (a running max and sum per query), so a device
  holds its own block and the one arriving, never more. The backward pass, written out as a
  custom VJP, sends the blocks round once more, each carrying its gradient, which grows as it
  visits the devices; a last hop brings every gradient home.

Causal load balancing. Cut in N contiguous pieces, the last device would attend to everything
and the first to its own piece alone, and a ring moves in lockstep, at the pace of the busiest.
So the model runs its positions in the dual-chunk order (`dual_chunk_order`, the permutation as
data): of 2N chunks, device i holds chunks i and 2N-1-i, an early one and a late one. Masks come
from the chunks' global positions; a pair of chunks whose keys all come after its queries is
skipped (`lax.cond`), not masked, so after its own block each device does half a block per step,
every device the same.

Within a pair of chunks the queries go a tile at a time (`minigpt.parallel.blocks`), so no score
array exceeds [tile, T/N] per head and the temporaries grow linearly in T/N. Dimension letters
as in `minigpt.models.layers`; C is the positions of one chunk, G the query heads sharing a
key/value head (N = K G).

Accelerators run this blockwise arithmetic too, not the fused kernels (`models.attention`): a ring
needs each block's log-sum-exp forward and a backward taking the global one, which neither cuDNN's
kernel (via `jax.nn.dot_product_attention`) nor Splash's public one offers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from minigpt import sharding
from minigpt.config import CONTEXT_STRATEGIES, ConfigError
from minigpt.parallel.blocks import fold_chunk, grad_chunk


@dataclasses.dataclass(frozen=True)
class Ring:
    """The layout a trace attends over: the mesh axis the sequence is split over, its size N,
    and how attention runs on it."""

    axis: str
    devices: int
    strategy: str = "ring"
    balanced: bool = True

    @property
    def pieces(self) -> int:
        """Chunks per device: 2 in the dual-chunk order, else 1."""
        return 2 if self.balanced else 1

    def chunks(self, device):
        """The chunks device `device` holds (indices among the N x pieces equal chunks of the
        sequence), in the order it holds them; `device` may be traced."""
        return (device, 2 * self.devices - 1 - device) if self.balanced else (device,)


def active_ring() -> Ring | None:
    """The ring the active rules and settings describe, or None where `seq` is not split."""
    ways = sharding.active_ways("seq")
    if ways == 1:
        return None
    settings = sharding.active().context_parallel
    return Ring(sharding.sequence_axis(), ways, settings.strategy, settings.balanced)


def check_length(T: int, devices: int, balanced: bool) -> None:
    """Refuse a sequence length that does not cut into equal chunks, 2 per device balanced."""
    chunks = devices * (2 if balanced else 1)
    if T % chunks:
        raise ConfigError(f"a sequence of {T} positions split over {devices} devices must cut "
                          f"into {chunks} equal chunks" + (" (2 per device: causal load "
                          "balancing)" if balanced else "") + f": choose a multiple of {chunks}")


def dual_chunk_order(T: int, devices: int) -> np.ndarray:
    """The positions 0..T-1 in dual-chunk order [T]: cut into 2N chunks, device i's share (the
    i-th N-th of the result) is chunk i followed by chunk 2N-1-i."""
    check_length(T, devices, balanced=True)
    chunks = np.arange(T).reshape(2 * devices, T // (2 * devices))
    return np.concatenate([chunks[[i, 2 * devices - 1 - i]].reshape(-1)
                           for i in range(devices)])


def sequence_order(T: int) -> np.ndarray | None:
    """The order the model runs a sequence's T positions in under the active context: the
    dual-chunk order where the rules split `seq` with load balancing, else None (as given)."""
    ring = active_ring()
    if ring is None or not ring.balanced:
        return None
    return dual_chunk_order(T, ring.devices)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, attn=None) -> jax.Array:
    """Causal self-attention, q [B, T, N, H], k and v [B, T, K, H], over a sequence the active
    rules split along T, in the order `sequence_order(T)` gives; as the context's strategy says.
    `attn` is the layer's `minigpt.models.masks.AttentionInputs` (in the same order): with
    document ids a query sees its own document's keys only (a document may span devices: the
    ids travel with the keys), with a window only the keys within it (the positions travel
    too).
    """
    ring = active_ring()
    if ring is None:
        raise ConfigError("context-parallel attention runs where the rules split `seq`")
    if ring.strategy not in CONTEXT_STRATEGIES:
        raise ConfigError(f"unknown train.context_strategy {ring.strategy!r}: choose one of "
                          f"{', '.join(CONTEXT_STRATEGIES)}")
    check_length(q.shape[1], ring.devices, ring.balanced)
    segments = None if attn is None else attn.segment_ids
    windowed = attn is not None and attn.windowed
    positions = attn.positions if windowed else None
    window = jnp.asarray(attn.window, jnp.int32) if windowed else None
    return _attention(ring, q, k, v, segments, positions, window)


# The collective region and its VJP ---------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(ring: Ring, q, k, v, segments, positions, window):
    return _attention_fwd(ring, q, k, v, segments, positions, window)[0]


def _attention_fwd(ring: Ring, q, k, v, segments, positions, window):
    seq = jax.P(None, ring.axis)
    out, lse = jax.shard_map(functools.partial(_forward, ring), in_specs=(seq,) * 5 + (jax.P(),),
                             out_specs=(seq, seq), axis_names={ring.axis})(
        q, k, v, segments, positions, window)
    return out, (q, k, v, segments, positions, window, out, lse)


def _attention_bwd(ring: Ring, residuals, g):
    seq = jax.P(None, ring.axis)
    specs = (seq,) * 5 + (jax.P(),) + (seq,) * 3
    grads = jax.shard_map(functools.partial(_backward, ring), in_specs=specs,
                          out_specs=(seq, seq, seq), axis_names={ring.axis})(*residuals, g)
    return (*grads, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _hop(ring: Ring, tree):
    """Every device's blocks to the next device round the ring."""
    n = ring.devices
    return jax.lax.ppermute(tree, ring.axis, [(d, (d + 1) % n) for d in range(n)])


def _pieces(x: jax.Array, count: int, kv_heads: int | None = None) -> list[jax.Array]:
    """A device's [B, T, ...] as its `count` chunks [B, C, ...]; queries [B, T, N, H] grouped
    by key/value head as [B, C, K, G, H]."""
    B, T = x.shape[:2]
    if kv_heads is not None:
        x = x.reshape(B, T, kv_heads, x.shape[2] // kv_heads, x.shape[3])
    return list(jnp.split(x, count, axis=1))


def _visit(ring: Ring, update, state, i, j=None):
    """Apply `update(state, a, b, diag)` for every pair (device i's query chunk a, device j's
    key chunk b) in which some query sees some key. Device i's own block (j None) has its pairs
    known in advance: a chunk against itself on the diagonal, a later chunk against an earlier
    one fully. Another device's chunks never share a position with i's: each pair runs under
    `lax.cond`, skipped where every key comes after every query."""
    P = ring.pieces
    for a in range(P):
        for b in range(P):
            if j is None:
                if a >= b:  # a device's second chunk comes later in the sequence
                    state = update(state, a, b, a == b)
                continue
            sees = ring.chunks(i)[a] > ring.chunks(j)[b]
            state = jax.lax.cond(sees, lambda s, a=a, b=b: update(s, a, b, False),
                                 lambda s: s, state)
    return state


def _ring_tour(ring: Ring, step, carry, moving):
    """`carry, moving = step(carry, moving, j)` for the blocks of the other N - 1 devices,
    j = i-1, i-2, ...: `moving` (a block, and its gradient) hops on round the ring before each
    step. Returns the carry and what the device holds at the end (device i+1's)."""
    i, n = jax.lax.axis_index(ring.axis), ring.devices

    def body(state, s):
        carry, moving = state
        return step(carry, _hop(ring, moving), (i - s) % n), None

    (carry, moving), _ = jax.lax.scan(body, (carry, moving), jnp.arange(1, n))
    return carry, moving


def _gathered_tour(ring: Ring, step, carry, block, d_block=None):
    """The all-gather strategy's tour: every device's block (a tuple of arrays) gathered once,
    then `carry, d_block = step(carry, (block_j, d_block_j), j)` for j = i-1, i-2, ... as
    `_ring_tour`. With `d_block` (the backward pass: gradients of the block's first arrays),
    the gradients of the other devices' blocks accumulate in a whole-sequence buffer, reduced
    and scattered back to their devices at the end, and added to this device's own `d_block`."""
    i, n = jax.lax.axis_index(ring.axis), ring.devices
    whole = jax.lax.all_gather(block, ring.axis, axis=1, tiled=True)  # [B, T_all, ...]
    local = jax.tree.leaves(block)[0].shape[1]
    # Gradients for the blocks' arrays that take them (keys and values; not document ids).
    d_whole = None if d_block is None else sharding.varying_as(
        jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), whole[:len(d_block)]), carry)

    def body(state, s):
        carry, d_whole = state
        j = (i - s) % n

        def cut(w):
            return jax.lax.dynamic_slice_in_dim(w, j * local, local, axis=1)

        def paste(w, d):
            return jax.lax.dynamic_update_slice_in_dim(w, d, j * local, axis=1)

        carry, d_j = step(carry, (jax.tree.map(cut, whole),
                                  None if d_whole is None else jax.tree.map(cut, d_whole)), j)
        return (carry, None if d_whole is None else jax.tree.map(paste, d_whole, d_j)), None

    (carry, d_whole), _ = jax.lax.scan(body, (carry, d_whole), jnp.arange(1, n))
    if d_block is None:
        return carry, None
    return carry, jax.tree.map(
        lambda d, own: jax.lax.psum_scatter(d, ring.axis, scatter_dimension=1, tiled=True) + own,
        d_whole, d_block)


def _mark_pieces(segments, positions, count: int) -> list:
    """A device's document ids and positions [B, T] (each or both None) as its `count` chunks'
    marks: (ids [B, C] or None, positions [B, C] or None) each."""
    ids = [None] * count if segments is None else _pieces(segments, count)
    places = [None] * count if positions is None else _pieces(positions, count)
    return list(zip(ids, places))


def _forward(ring: Ring, q, k, v, segments, positions, window):
    """One device's queries [B, T/N, N, H] against every device's keys (their document ids and
    positions travelling with them): the outputs and the log-sum-exp of each query's scores
    [B, T/N, N] (what the backward pass needs)."""
    B, T, N, H = q.shape
    K, P = k.shape[2], ring.pieces
    queries = _pieces(q * jnp.asarray(H ** -0.5, q.dtype), P, K)  # P x [B, C, K, G, H]
    q_marks = _mark_pieces(segments, positions, P)
    i = jax.lax.axis_index(ring.axis)

    def fold(acc, block, j):
        keys, values = _pieces(block[0], P), _pieces(block[1], P)
        k_marks = _mark_pieces(block[2], block[3], P)

        def update(acc, a, b, diag):
            acc = list(acc)
            acc[a] = fold_chunk(queries[a], keys[b], values[b], acc[a], diag,
                                 q_marks[a], k_marks[b], window)
            return tuple(acc)

        return _visit(ring, update, acc, i, j)

    shape = queries[0].shape[:-1]  # [B, C, K, G]
    empty = tuple((jnp.zeros((*shape, H), jnp.float32), jnp.full(shape, -jnp.inf),
                   jnp.zeros(shape, jnp.float32)) for _ in range(P))
    block = (k, v, segments, positions)
    acc = fold(sharding.varying_as(empty, q), block, None)
    if ring.strategy == "ring":
        acc, _ = _ring_tour(ring, lambda acc, kv, j: (fold(acc, kv, j), kv), acc, block)
    else:
        acc, _ = _gathered_tour(ring, lambda acc, kv, j: (fold(acc, kv[0], j), None), acc,
                                block)
    out = jnp.concatenate([o / total[..., None] for o, _, total in acc], axis=1)  # [B,T,K,G,H]
    lse = jnp.concatenate([m + jnp.log(total) for _, m, total in acc], axis=1)  # [B, T, K, G]
    return out.reshape(B, T, N, H).astype(q.dtype), lse.reshape(B, T, N)


def _backward(ring: Ring, q, k, v, segments, positions, window, out, lse, g):
    """The gradients of one device's share of q, k and v: the key/value blocks (with their
    document ids and positions) make the forward's tour again, each with its gradient."""
    B, T, N, H = q.shape
    K, P = k.shape[2], ring.pieces
    scale = H ** -0.5

    def f32(x):
        return x.astype(jnp.float32)

    queries = _pieces(f32(q) * scale, P, K)
    q_marks = _mark_pieces(segments, positions, P)
    grads = _pieces(f32(g), P, K)
    lses = _pieces(lse.reshape(B, T, K, N // K), P)
    # rowsum(dP * P) = rowsum(dO * O), a sum H long instead of T (as flash attention)
    deltas = _pieces(jnp.sum(f32(g) * f32(out), axis=-1).reshape(B, T, K, N // K), P)
    i = jax.lax.axis_index(ring.axis)

    def visit(d_q, block, d_block, j):
        keys, values = _pieces(f32(block[0]), P), _pieces(f32(block[1]), P)
        k_marks = _mark_pieces(block[2], block[3], P)

        def update(state, a, b, diag):
            d_q, d_keys, d_values = map(list, state)
            dq, d_keys[b], d_values[b] = grad_chunk(
                queries[a], keys[b], values[b], grads[a], lses[a], deltas[a], d_keys[b],
                d_values[b], diag, q_marks[a], k_marks[b], window)
            d_q[a] = d_q[a] + dq
            return tuple(d_q), tuple(d_keys), tuple(d_values)

        state = (d_q, tuple(_pieces(d_block[0], P)), tuple(_pieces(d_block[1], P)))
        d_q, d_keys, d_values = _visit(ring, update, state, i, j)
        return d_q, (jnp.concatenate(d_keys, axis=1), jnp.concatenate(d_values, axis=1))

    zeros = sharding.varying_as((jnp.zeros(k.shape, jnp.float32),) * 2, q)
    d_q = sharding.varying_as(tuple(jnp.zeros_like(x) for x in queries), q)
    block = (k, v, segments, positions)
    d_q, d_own = visit(d_q, block, zeros, None)
    if ring.strategy == "ring":
        def step(d_q, moving, j):
            block, d_block = moving
            d_q, d_block = visit(d_q, block, d_block, j)
            return d_q, (block, d_block)

        d_q, (_, d_block) = _ring_tour(ring, step, d_q, (block, d_own))
        d_k, d_v = _hop(ring, d_block)  # the last hop brings every block's gradient home
    else:
        d_q, (d_k, d_v) = _gathered_tour(
            ring, lambda d_q, pair, j: visit(d_q, pair[0], pair[1], j), d_q, block, d_own)
    d_q = jnp.concatenate(d_q, axis=1).reshape(B, T, N, H) * scale
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)
