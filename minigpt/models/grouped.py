"""The grouped products of a mixture of experts, shaped for XLA's CPU backend.

`jax.lax.ragged_dot`, the plain form (`ReferenceKernels.expert_ffn`), runs on a CPU as one
product of every row with every expert's weights, the other experts' rows masked: E times the
work. Here the rows, already sorted by expert, are laid out in blocks of one expert each (every
group padded to whole blocks) and a loop runs each block's SwiGLU with its expert's weights,
skipping the blocks past the last group, with the backward pass written out. The tests compare
it with `ragged_dot`, value and gradients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minigpt import sharding
from minigpt.parallel.experts import move_rows


def _expert_block(rows: int, groups: int) -> int:
    """Rows per block: a power of two from 8 to 256, small enough that padding each group to
    whole blocks adds at most about a quarter to the rows."""
    return int(min(256, max(8, 2 ** math.floor(math.log2(max(1, rows // (4 * groups)))))))


def blocked_expert_ffn(x, group_sizes, w_gate, w_up, w_down):
    """ReferenceKernels.expert_ffn as a loop over blocks of rows of one expert each: every group
    padded to whole blocks of b rows (at most M / b + G blocks), each block a SwiGLU with its
    expert's weights; blocks past the last group are skipped."""
    M, D = x.shape
    G = group_sizes.shape[0]
    b = _expert_block(M, G)
    NB = -(-M // b) + G
    padded = (group_sizes + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    end = jnp.cumsum(group_sizes)
    start, padded_start = end - group_sizes, padded_end - padded
    slot = jnp.arange(NB * b)
    slot_group = _count_at_most(padded_end, slot)  # G past the last group
    g = jnp.minimum(slot_group, G - 1)
    source = start[g] + slot - padded_start[g]  # the row each padded slot holds
    source = jnp.where((slot_group < G) & (source < end[g]), source, -1)
    row = jnp.arange(M)
    row_group = jnp.minimum(_count_at_most(end, row), G - 1)
    dest = jnp.where(row < end[-1], padded_start[row_group] + row - start[row_group], -1)
    xp = move_rows(x, source, dest)  # [NB b, D]
    blocks = (g.reshape(NB, b)[:, 0], slot_group.reshape(NB, b)[:, 0] < G)  # expert, in use
    # Inside shard_map, weights the devices share are typed as differing like the rows before
    # the custom gradient, whose partial sums autodiff then adds up over the devices.
    weights = sharding.varying_as((w_gate, w_up, w_down), xp)
    yp = _expert_blocks(xp.reshape(NB, b, D), *blocks, *weights)  # [NB, b, D]
    return move_rows(yp.reshape(NB * b, D), dest, source)  # [M, D]


def _count_at_most(edges: jax.Array, values: jax.Array) -> jax.Array:
    """How many of the ascending `edges` [G] are <= each of `values` [N]: searchsorted(side=
    "right") written as a comparison, which also traces inside a shard_map region manual over
    some mesh axes and automatic over others (jnp.searchsorted fails there in JAX 0.10)."""
    return jnp.sum(edges[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


@jax.custom_vjp
def _expert_blocks(xp, expert, used, w_gate, w_up, w_down):
    """SwiGLU of each block xp[n] [b, D] with expert[n]'s weights (zeros where not `used`), with
    the backward pass written out: left to autodiff, the loop's weight gradients were summed
    over every expert at every block."""
    return _expert_blocks_fwd(xp, expert, used, w_gate, w_up, w_down)[0]


def _expert_blocks_fwd(xp, expert, used, w_gate, w_up, w_down):
    _, b, _ = xp.shape
    F = w_gate.shape[-1]

    def block(_, inputs):
        xb, e, on = inputs

        def run():
            gate, up = xb @ w_gate[e], xb @ w_up[e]  # [b, F]
            return (jax.nn.silu(gate) * up) @ w_down[e], gate, up

        # Inside shard_map both branches vary over the axes the computed one does.
        zeros = sharding.varying_as((jnp.zeros_like(xb), jnp.zeros((b, F), xb.dtype),
                                     jnp.zeros((b, F), xb.dtype)), xb, w_gate, w_up, w_down)
        return None, jax.lax.cond(on, run, lambda: zeros)

    _, (y, gate, up) = jax.lax.scan(block, None, (xp, expert, used))
    return y, (xp, expert, used, w_gate, w_up, w_down, gate, up)


def _expert_blocks_bwd(residuals, dy):
    xp, expert, used, w_gate, w_up, w_down, gate, up = residuals

    def block(grads, inputs):
        xb, dyb, e, on, a, u = inputs

        def run():
            sig = jax.nn.sigmoid(a)
            h = a * sig * u
            dh = dyb @ w_down[e].T
            d_up = dh * a * sig
            d_gate = dh * u * sig * (1 + a * (1 - sig))  # silu'(z) = s(z) (1 + z (1 - s(z)))
            dx = d_gate @ w_gate[e].T + d_up @ w_up[e].T
            f32 = jnp.float32
            added = (xb.T.astype(f32) @ d_gate.astype(f32), xb.T.astype(f32) @ d_up.astype(f32),
                     h.T.astype(f32) @ dyb.astype(f32))
            return dx, tuple(acc.at[e].add(d) for acc, d in zip(grads, added))

        skip = sharding.varying_as(jnp.zeros_like(xb), xb, dyb, w_gate, w_up, w_down)
        dx, grads = jax.lax.cond(on, run, lambda: (skip, grads))
        return grads, dx

    zeros = sharding.varying_as(tuple(jnp.zeros(w.shape, jnp.float32)
                                      for w in (w_gate, w_up, w_down)), xp, dy, w_gate)
    grads, dx = jax.lax.scan(block, zeros, (xp, dy, expert, used, gate, up))
    d_w = tuple(d.astype(w.dtype) for d, w in zip(grads, (w_gate, w_up, w_down)))
    return (dx, None, None, *d_w)


_expert_blocks.defvjp(_expert_blocks_fwd, _expert_blocks_bwd)
