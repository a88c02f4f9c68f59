"""Expert dispatch: each token to the experts its router chose and back, wherever they live.

`dropless` runs a mixture of experts' feed-forward without dropping a token: the (token, expert)
assignments are sorted by expert and the experts run as grouped products over the sorted rows
(the kernel is the caller's: `minigpt.models.kernels`), then the results return to their tokens,
weighted by the router. Each row is computed on its own, so the numbers do not depend on how the
batch is split. How it runs follows the active rules:

- tokens split over mesh axes (the `batch` and `seq` rules): one `jax.shard_map` region, manual
  over those axes, in which every device sorts and computes its own tokens (a sort over a split
  axis is what the compiler cannot partition: it would gather every token everywhere);
- experts split too (the `expert` rule, on axes that also split the tokens: presets `ep`,
  `fsdp_ep`): the rows travel to their experts' devices and back by two all-to-alls, each
  device running only its own experts (`sharding.Experts(move="tokens")`, the default). The
  alternative, gathering every expert's weights to every device as FSDP does (`move="weights"`,
  in the context the preset's rules travel in), is what the compiler does with the program
  written without collectives; bench/RESULTS.md measures both;
- inside another manual region (a pipeline stage: JAX cannot nest `shard_map` there), or where
  the batch does not divide among the devices (decoding one sequence), the program is left to
  the compiler, which gathers what it needs: the same numbers, less parallel.

Static shapes need a bound on what one device sends another: the all-to-all buffers hold
`SLACK` times an even share, and a step whose router sends more than that to one device's
experts gathers the weights instead (both branches compute the same numbers, so nothing is
dropped whatever the router does). `move_rows` is the row permutation every step here is made
of, with a gradient XLA's CPU backend runs fast. `expert_layout` and `token_layout` lay out the
capacity dispatch's buffers [B, E, C, D] (minigpt.models.moe), where the compiler infers the
all-to-all itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from minigpt import sharding

# The rows one device may send another in a step, as a multiple of an even share (M / X): what
# the all-to-all buffers hold. Beyond it a step gathers the experts' weights instead.
SLACK = 2

ExpertFFN = Callable[..., jax.Array]  # (rows [M, D], group sizes [G], *weights) -> [M, D]
ACTIVATIONS = ("batch", "seq", "embed")


def expert_axes() -> tuple[str, ...]:
    """The mesh axes the active rules split the experts over (none outside a preset)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not sharding.active().rules:
        return ()
    return tuple(a for a in sharding.mesh_axes_in(sharding.logical_to_spec(("expert",))[0])
                 if mesh.shape[a] > 1)


def dropless(x: jax.Array, experts: jax.Array, weights: jax.Array,
             params: tuple[jax.Array, ...], ffn: ExpertFFN) -> jax.Array:
    """sum_k weights[..., k] * expert_{experts[..., k]}(x) for x [B, T, D], experts and weights
    [B, T, k]; `params` are the experts' stacked weights, [E, ...] each, and `ffn` runs rows
    sorted by expert through them (`kernels.expert_ffn`). Returns [B, T, D]."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not sharding.active().rules:
        return _grouped(x, experts, weights, params, ffn)
    if mesh.manual_axes:  # replicated over the other axes: XLA fails to partition it there
        whole = [sharding.constrain(a, (None,) * a.ndim) for a in (x, experts, weights, *params)]
        return sharding.constrain(_grouped(*whole[:3], tuple(whole[3:]), ffn), ACTIVATIONS)
    spec = sharding.logical_to_spec(("batch", "seq", None))
    token_axes = tuple(a for entry in spec for a in sharding.mesh_axes_in(entry))
    ways = [sharding.ways(mesh, entry) for entry in spec[:2]]
    if not token_axes or x.shape[0] % ways[0] or x.shape[1] % ways[1]:
        return _grouped(x, experts, weights, params, ffn)
    split = expert_axes()
    travel = (sharding.active().experts.move == "tokens" and split
              and set(split) <= set(token_axes))
    axis = (split[0] if len(split) == 1 else split) if travel else None
    expert_spec = jax.P(axis) if travel else jax.P()

    def local(x, experts, weights, *params):
        B, T, D = x.shape
        rows = (x.reshape(B * T, D), experts.reshape(B * T, -1), weights.reshape(B * T, -1))
        if travel:
            return _all_to_all(*rows, params, ffn, axis, token_axes).reshape(B, T, D)
        return _grouped(*rows, params, ffn).reshape(B, T, D)

    return jax.shard_map(local, in_specs=(spec, spec, spec, *[expert_spec] * len(params)),
                         out_specs=spec, axis_names=set(token_axes))(
        x, experts, weights, *params)


@jax.custom_vjp
def move_rows(x: jax.Array, to: jax.Array, back: jax.Array) -> jax.Array:
    """x[to]: rows of x [N, ...] moved to new places, each taken at most once; an entry of `to`
    outside 0..N-1 gives a row of zeros. `back` [N] says where each row of x went (outside the
    output's rows: nowhere). The gradient is then a gather too (dy[back]), where autodiff would
    scatter-add, which XLA's CPU backend runs row by row (several times slower here)."""
    return _taken(x, to)


def _taken(x, index):
    inside = (index >= 0) & (index < x.shape[0])
    rows = x[jnp.where(inside, index, 0)]
    return jnp.where(inside.reshape(-1, *(1,) * (x.ndim - 1)), rows, 0)


def _move_rows_fwd(x, to, back):
    return _taken(x, to), back


def _move_rows_bwd(back, dy):
    return _taken(dy, back), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order` (rows[order][inverse] == rows)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _sorted_by_expert(x, experts, num_experts):
    """The rows of every (token, choice) assignment sorted by expert (stable: in token order
    within an expert), the order that sorts them and its inverse, and the rows each expert
    takes [E]."""
    k = experts.shape[-1]
    flat = experts.reshape(-1)  # [n k]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    unsort = inverse(order)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return move_rows(jnp.repeat(x, k, axis=0), order, unsort), order, unsort, sizes


def _combine(y_sorted, order, unsort, weights):
    """Each assignment's result back in token order, weighted and summed over the k choices."""
    n, k = weights.shape
    y = move_rows(y_sorted, unsort, order).reshape(n, k, -1)  # [n, k, D]
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def _grouped(x, experts, weights, params, ffn):
    """Dropless dispatch of the tokens at hand ([..., D], any leading shape) to experts all held
    here."""
    shape = x.shape
    x, experts, weights = (x.reshape(-1, shape[-1]), experts.reshape(-1, experts.shape[-1]),
                           weights.reshape(-1, weights.shape[-1]))
    rows, order, unsort, sizes = _sorted_by_expert(x, experts, params[0].shape[0])
    return _combine(ffn(rows, sizes, *params), order, unsort, weights).reshape(shape)


def _all_to_all(x, experts, weights, params, ffn, axis, manual):
    """Dropless dispatch of this device's tokens x [n, D] to experts split over mesh `axis`
    (this device holds params [E/X, ...], the experts X * its index onwards): the rows travel to
    their experts' devices, are computed there and come back. `manual`: every mesh axis the
    region is manual over.

    Each device sends every other a block of `cap` rows, its first few real (the counts go
    first, so the receiver knows): SLACK times an even share, the most the all-to-alls move.
    Where some device owes another more than that (a router sending most of a batch to one
    device's experts), the step gathers the experts' weights instead, everywhere alike: the same
    numbers, nothing dropped.
    """
    n, D = x.shape
    local = params[0].shape[0]
    X = jax.lax.axis_size(axis)
    M = n * experts.shape[-1]
    cap = min(M, -(-SLACK * M // X))
    rows, order, unsort, sizes = _sorted_by_expert(x, experts, X * local)  # [M, D] by expert
    per_device = jnp.sum(sizes.reshape(X, local), axis=1)  # rows owed to each device
    crowded = jax.lax.pmax(jnp.any(per_device > cap).astype(jnp.int32), tuple(manual))

    def travel():
        return _travel(rows, sizes.reshape(X, local), params, ffn, axis, cap)

    def gather():
        whole = [jax.lax.all_gather(p, axis, tiled=True) for p in params]
        return ffn(rows, sizes, *whole)

    y = jax.lax.cond(crowded > 0, gather, travel)  # [M, D]: each sorted row's result
    return _combine(y, order, unsort, weights)  # [n, D]


def _travel(rows, send_sizes, params, ffn, axis, cap):
    """Rows sorted by expert [M, D] to their experts' devices, through them, and back; each
    device owes each other at most `cap` rows (send_sizes [X, E/X]: for each device's each
    expert)."""
    M, D = rows.shape
    X = send_sizes.shape[0]
    recv_sizes = jax.lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)  # [X, E/X]: from each
    per_device = jnp.sum(send_sizes, axis=1)
    first = jnp.cumsum(per_device) - per_device  # where each device's rows start in `rows`
    r, c = jnp.arange(M, dtype=jnp.int32), jnp.arange(cap, dtype=jnp.int32)
    # The outbox slot [X cap] each sorted row takes, and the row each slot holds (-1: none).
    # (jnp.searchsorted fails to trace in a region manual over some axes only, JAX 0.10.)
    device = jnp.minimum(jnp.sum(jnp.cumsum(per_device)[None, :] <= r[:, None], axis=1), X - 1)
    slot = device * cap + r - first[device]  # [M]
    held = jnp.where(c < per_device[:, None], first[:, None] + c, -1).reshape(X * cap)
    outbox = move_rows(rows, held, slot).reshape(X, cap, D)
    inbox = jax.lax.all_to_all(outbox, axis, 0, 0, tiled=True)  # [X, cap, D]: from each
    # What arrived, sorted by local expert (unused rows last, in no group).
    ends = jnp.cumsum(recv_sizes, axis=1)  # [X, E/X]
    expert_of = jnp.sum(ends[:, None, :] <= c[None, :, None], axis=-1)  # [X, cap]
    arrived = jnp.argsort(expert_of.reshape(-1), stable=True).astype(jnp.int32)
    unarrived = inverse(arrived)
    y = ffn(move_rows(inbox.reshape(X * cap, D), arrived, unarrived),
            jnp.sum(recv_sizes, axis=0), *params)
    outbox = move_rows(y, unarrived, arrived).reshape(X, cap, D)
    back = jax.lax.all_to_all(outbox, axis, 0, 0, tiled=True)  # [X, cap, D]: from each
    return move_rows(back.reshape(X * cap, D), slot, held)  # [M, D]


def expert_layout(buffer: jax.Array) -> jax.Array:
    """A capacity buffer [B, E, C, D] laid out by expert where the rules split the experts
    (the batch keeps the axes the experts do not take): the compiler moves the rows to their
    experts' devices by an all-to-all. Elsewhere it keeps the batch's layout."""
    split = expert_axes()
    if not split or jax.sharding.get_abstract_mesh().manual_axes:
        return sharding.constrain(buffer, ("batch", None, None, None))
    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in sharding.mesh_axes_in(sharding.logical_to_spec(("batch",))[0])
                  if a not in split)
    if buffer.shape[0] % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    return jax.lax.with_sharding_constraint(buffer, jax.P(batch or None, split, None, None))


def token_layout(buffer: jax.Array) -> jax.Array:
    """A capacity buffer [B, E, C, D] back in the batch's layout (the all-to-all back)."""
    return sharding.constrain(buffer, ("batch", None, None, None))
