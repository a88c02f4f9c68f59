"""The loop that runs a pipeline schedule's table over the stages, and its place in autodiff.

`loss` hands the pipeline an embedding, a chunk of layers and a head as functions; `_run` is
one tick per loop body, inside `jax.shard_map` over the stage axis alone: each stage runs the
forward of one microbatch through one of its chunks and the backward of another, recomputing
the chunk from the input it stashed (`jax.vjp`), the head runs as a microbatch leaves the last
stage (its positions shared out over every stage), and activations and gradients move between
stages by collective permutes carried in the loop. See the package docstring for why the
gradients are written out here rather than left to autodiff.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt import sharding
from minigpt.pipeline.schedules import Schedule, table


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so that each device keeps its own rows
    of every microbatch when the batch dimension is sharded (no data moves between devices)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def join_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _joined(state, other):
    """Two NNX states (or trees of them) as one."""
    return nnx.merge_state(state, other) if other else state


def zeros_like(tree):
    """Zeros shaped like every array of a tree (a state keeps its Variables and metadata)."""
    return jax.tree.map(jnp.zeros_like, tree)


def _run(plan: Schedule, fns, axis: str, rest, blocks, inputs, frozen, *, grads: bool,
         activation_axes: tuple[str, ...]):
    """Execute the table `plan` on this stage (inside shard_map over the stage axis); returns
    the loss summed over every position (the stages' penalties included), with `grads` the
    gradients of the rest and of this stage's share of the stack (float32, summed), and the
    stages' statistics summed.

    It is long because one tick is one loop body: forward, head, backward, then what moves
    between the stages; the steps read best together, in the order they run.
    """
    embed_fn, stage_of, head_fn = fns
    frozen_rest, frozen_blocks = frozen
    S, M, R = plan.stages, plan.microbatches, plan.repeats
    s = jax.lax.axis_index(axis)
    here = jax.lax.pcast(jnp.zeros(()), (axis,), to="varying")

    def settled(tree):
        """Typed as differing from stage to stage, and laid out as the rules say (parameters
        by their logical axes, activations and their buffers as `activation_axes`): a loop's
        carry and the two branches of a `cond` must agree on both."""
        def one(x):
            if isinstance(x, nnx.Variable):
                return sharding.lay_out(x)
            extra = x.ndim - len(activation_axes)
            return sharding.constrain(x, (None,) * extra + activation_axes) if extra >= 0 else x

        laid = jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return sharding.varying_as(laid, here)

    def cond(pred, on, off):
        return jax.lax.cond(pred, lambda: settled(on()), lambda: settled(off()))

    def f32(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32), tree)

    # Each stage differentiates its own copy of the replicated parameters, so their gradients
    # stay partial sums, added up over the stages once at the end (not at every use).
    rest, frozen_rest = settled(rest), settled(frozen_rest)
    c = jax.tree.leaves(blocks)[0].shape[0] // R  # layers per chunk
    xs = jax.tree.map(lambda a: split_microbatches(a, M), inputs)
    T = inputs["targets"].shape[1]
    at = {name: jnp.asarray(getattr(plan, name)) for name in (
        "fwd_mb", "fwd_round", "fwd_src", "fwd_stash", "bwd_mb", "bwd_round", "bwd_stash",
        "bwd_src", "recv_fwd", "recv_bwd", "head_mb", "head_slot")}

    def micro(m):
        return jax.tree.map(lambda a: a[jnp.maximum(m, 0)], xs)

    def chunk(r):
        r = jnp.maximum(r, 0)
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, r * c, c), blocks)

    def first_layer(r):
        return (jnp.maximum(r, 0) * S + s) * c

    # The pieces read the frozen parameters beside the others, and differentiate none of them.
    def embed(rest, mb):
        return embed_fn(_joined(rest, frozen_rest), mb)

    def head(rest, y, targets, weights):
        return head_fn(_joined(rest, frozen_rest), y, targets, weights)

    def stage_fn(p, r, x, mb):
        """Chunk r of the stack: its trainable parameters p, and its frozen ones."""
        r = jnp.maximum(r, 0)
        held = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, r * c, c), frozen_blocks)
        return stage_of(_joined(p, held), x, mb, first_layer(r))

    act = jax.eval_shape(embed, rest, micro(0))  # [b, T, D]: what moves between stages

    def zeros(shape_of=act, dtype=None):
        return jnp.zeros(shape_of.shape, dtype or shape_of.dtype)

    stat_shapes = jax.eval_shape(lambda c, m: stage_fn(c, 0, settled(zeros()), m)[2], chunk(0),
                                 micro(0))

    def no_stats():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stat_shapes)

    def pick(buf, slot):
        return buf[jnp.maximum(slot, 0)]

    def put(buf, slot, value, ok):
        i = jnp.maximum(slot, 0)
        return buf.at[i].set(jnp.where(ok, value, buf[i]))

    def tick(carry, t):
        """Time step t at stage s: a forward, maybe the head, maybe a backward; long because the
        three read and write the same seven carried buffers; apart, each would pass them all."""
        inbox, ginbox, stash, d_rest, d_blocks, loss, stats = carry
        # Forward of one microbatch's chunk, its input from the embedding or the inbox; the
        # chunk's penalty joins the loss, its statistics the sums.
        fm, fr, src = at["fwd_mb"][t, s], at["fwd_round"][t, s], at["fwd_src"][t, s]
        mb = micro(fm)
        x = cond((fm >= 0) & (src < 0), lambda: embed(rest, mb), lambda: pick(inbox, src))
        y, penalty, stat = cond(fm >= 0, lambda: stage_fn(chunk(fr), fr, x, mb),
                                lambda: (zeros(), jnp.zeros((), jnp.float32),
                                         no_stats()))
        loss, stats = loss + penalty, jax.tree.map(jnp.add, stats, stat)
        stash = put(stash, at["fwd_stash"][t, s], x, fm >= 0)
        # The head, on 1/S of the positions each, for a microbatch whose last chunk just ended.
        hm = at["head_mb"][t]

        def head_part():
            ys = jax.lax.psum_scatter(jnp.where(s == S - 1, y, 0), axis, scatter_dimension=1,
                                      tiled=True)  # [b, T/S, D]: this stage's positions
            targets, weights = (
                None if a is None else jax.lax.dynamic_slice_in_dim(a, s * (T // S), T // S,
                                                                    axis=1)
                for a in (micro(hm)["targets"], micro(hm).get("weights")))
            if not grads:
                return head(rest, ys, targets, weights), f32(zeros_like(rest)), zeros()
            value, pull = jax.vjp(lambda r_, y_: head(r_, y_, targets, weights), rest, ys)
            d_r, d_ys = pull(settled(jnp.ones((), value.dtype)))
            d_y = jax.lax.all_gather(d_ys, axis, axis=1, tiled=True)
            return value, f32(d_r), d_y.astype(act.dtype)

        h_loss, d_rest_h, d_y = cond(hm >= 0, head_part, lambda: (
            jnp.zeros((), jnp.float32), f32(zeros_like(rest)), zeros()))
        loss, d_rest = loss + h_loss, jax.tree.map(jnp.add, d_rest, d_rest_h)
        if grads:
            ginbox = put(ginbox, at["head_slot"][t], d_y, (hm >= 0) & (s == S - 1))
            # Backward of an earlier microbatch's chunk, recomputed from its stashed input.
            bm, br = at["bwd_mb"][t, s], at["bwd_round"][t, s]
            mbb = micro(bm)

            def back():
                x_b, g = pick(stash, at["bwd_stash"][t, s]), pick(ginbox, at["bwd_src"][t, s])
                (_, penalty), pull = jax.vjp(
                    lambda p, x_: stage_fn(p, br, x_, mbb)[:2], chunk(br), x_b)
                d_p, d_x = pull((g, jnp.ones_like(penalty)))  # the penalty joins the loss as is

                def into_embedding():
                    _, pull_e = jax.vjp(lambda r_: embed(r_, mbb), rest)
                    return f32(pull_e(d_x)[0])

                d_e = cond((br == 0) & (s == 0), into_embedding, lambda: f32(zeros_like(rest)))
                return f32(d_p), d_x, d_e

            d_p, d_x, d_e = cond(bm >= 0, back, lambda: (
                f32(zeros_like(chunk(0))), zeros(), f32(zeros_like(rest))))
            br = jnp.maximum(br, 0)
            d_blocks = jax.tree.map(
                lambda acc, d: jax.lax.dynamic_update_slice_in_dim(
                    acc, jax.lax.dynamic_slice_in_dim(acc, br * c, c) + d, br * c, 0),
                d_blocks, d_p)
            d_rest = jax.tree.map(jnp.add, d_rest, d_e)
            # The gradient of this chunk's input goes back to the stage before.
            g_in = jax.lax.ppermute(d_x, axis, [(i, (i - 1) % S) for i in range(S)])
            ginbox = put(ginbox, at["recv_bwd"][t, s], g_in, at["recv_bwd"][t, s] >= 0)
        # The output goes on to the next stage (from the last, round the ring: circular).
        y_in = jax.lax.ppermute(y, axis, [(i, (i + 1) % S) for i in range(S)])
        inbox = put(inbox, at["recv_fwd"][t, s], y_in, at["recv_fwd"][t, s] >= 0)
        return settled((inbox, ginbox, stash, d_rest, d_blocks, loss, stats)), None

    def buffer(n):
        return jnp.zeros((n, *act.shape), act.dtype)

    init = settled((buffer(plan.inbox_size), buffer(plan.grad_inbox_size if grads else 1),
                    buffer(plan.stash_size if grads else 1), f32(zeros_like(rest)),
                    f32(zeros_like(blocks)), jnp.zeros((), jnp.float32),
                    no_stats()))
    (_, _, _, d_rest, d_blocks, loss, stats), _ = jax.lax.scan(tick, init,
                                                               jnp.arange(plan.ticks))
    return (jax.lax.psum(loss, axis), jax.lax.psum(d_rest, axis), d_blocks,
            jax.lax.psum(stats, axis))


def loss(embed: Callable, stage: Callable, head: Callable, rest, blocks, inputs, *,
         frozen: tuple = (), activation_axes: tuple[str, ...] = ("batch", "seq", "embed")):
    """Mean loss over every token of `inputs`, the model run as the context's pipeline says,
    and the stages' statistics summed over every microbatch: (loss, statistics).

    `rest` holds the parameters outside the block stack (replicated over the stages), `blocks`
    the stacked [layers, ...] ones (split over them); `inputs` is a dict of [B, ...] arrays with
    "targets" [B, T] among them (others may be None). The model comes as three functions:
    `embed(rest, mb) -> x [b, T, D]` for microbatch `mb` (`inputs` cut to its rows), `stage(chunk,
    x, mb, first_layer) -> (x, penalty, statistics)` for a chunk of the stacked parameters
    whose first layer is `first_layer` (a penalty: a float32 scalar the loss adds, summed over
    positions as the head's; statistics: a tree of arrays, summed, no gradient), and
    `head(rest, y, targets, weights) -> the loss summed over those positions` for outputs
    y [b, t, D] of some positions, their targets [b, t] and the targets' weights in the loss
    [b, t] (`inputs["weights"]` cut alike; None where `inputs` has none). `frozen` (frozen
    rest, frozen blocks), laid out as `rest` and `blocks` are, holds parameters the pieces
    read but that take no gradient (a model's frozen base beside its adapters): the functions
    see them joined with the others.

    Differentiable: the forward computes every gradient with the loss (the schedule's
    backwards), the VJP scales them.
    """
    axis = sharding.pipeline_axis()
    plan = table(sharding.active().pipeline, sharding.active_ways("layers"))
    fns = (embed, stage, head)

    frozen = frozen or (nnx.State({}), nnx.State({}))

    def staged(grads, rest, blocks, inputs, frozen):
        def run(*args):
            # `axis` is manual in here: the pieces lay nothing out over it.
            with sharding.running(rules=sharding.without_axis(sharding.active().rules, axis)):
                return _run(plan if grads else plan.forward_only(), fns, axis, *args,
                            grads=grads, activation_axes=activation_axes)

        specs = (jax.P(), jax.P(axis), jax.P(), (jax.P(), jax.P(axis)))
        return jax.shard_map(run, in_specs=specs,
                             out_specs=(jax.P(), jax.P(), jax.P(axis), jax.P()),
                             axis_names={axis})(rest, blocks, inputs, frozen)

    count = inputs["targets"].size

    @jax.custom_vjp
    def value(rest, blocks, inputs, frozen):
        total, _, _, stats = staged(False, rest, blocks, inputs, frozen)
        return total / count, stats

    def forward(rest, blocks, inputs, frozen):
        total, d_rest, d_blocks, stats = staged(True, rest, blocks, inputs, frozen)
        return (total / count, stats), (d_rest, d_blocks, inputs)

    def backward(res, g):
        d_rest, d_blocks, inputs = res
        scale = g[0] / count  # the statistics carry no gradient, nor the frozen parameters
        return (jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), d_rest, rest),
                jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), d_blocks, blocks),
                jax.tree.map(lambda _: None, inputs), None)

    value.defvjp(forward, backward)
    return value(rest, blocks, inputs, frozen)
