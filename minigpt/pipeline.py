"""Pipeline parallelism: the block stack run as a GPipe schedule over the mesh axis of `layers`.

Under a preset with the rule `layers = "stage"`, every stacked block parameter [L, ...] is split
into S contiguous slices of L/S layers, one per stage of the `stage` mesh axis. `gpipe` runs the
stack as a pipeline, SPMD: the batch is cut into M microbatches; at iteration t stage 0 takes
microbatch t, every stage applies its own layers to what it holds, and hands the result to the
next stage with a collective permute. After M + S - 1 iterations the last stage has every
microbatch's output. Stage s is idle for the first s iterations and the last S - 1 - s, so a
fraction (S - 1) / (M + S - 1) of the schedule is bubble.

The backward pass is autodiff through the loop (permutes run backwards), which is the GPipe
schedule: all forwards, then all backwards. Each iteration is rematerialised, so a stage keeps
only its input per iteration, not its layers' activations. One-forward-one-backward schedules
(1F1B) need stages that run different programs at the same time, which SPMD cannot express;
that takes a multi-program runtime such as JaxPP.

Only `stage` is manual inside the pipeline (`jax.shard_map` over that one axis); every other mesh
axis (data, fsdp, model) keeps its automatic sharding, so pipeline presets compose with the
others. This module knows the mesh through `minigpt.sharding` only; models call `gpipe` with a
stage function and never name a mesh axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minigpt import sharding


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so that each device keeps its own rows
    of every microbatch when the batch dimension is sharded (no data moves between devices)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def join_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a GPipe schedule each stage spends idle: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def describe(stages: int, num_layers: int, settings: sharding.Pipeline, *,
             sequences: int) -> str:
    """One line saying how the stack runs: stages, microbatches of `sequences`, the bubble."""
    M = settings.microbatches
    return (f"pipeline: {stages} stages of {num_layers // stages} layers, {M} microbatches of "
            f"{sequences // M} sequences; bubble (S - 1) / (M + S - 1) = "
            f"{bubble_fraction(stages, M):.1%} of each step")


def gpipe(stage_fn: Callable[..., jax.Array], params: Any, x: jax.Array, extras: Any, *,
          microbatches: int) -> jax.Array:
    """Apply the stages in order to x [B, ...] as a GPipe pipeline; returns [B, ...].

    `stage_fn(params, x, extras, stage)` applies one stage: `params` are this stage's slices of
    the stacked parameters (leading axis L/S), `x` a microbatch [B/M, ...], `extras` the same
    microbatch's rows of every array in `extras` (positions, dropout keys; None for none) and
    `stage` the stage's index.
    """
    axis = sharding.pipeline_axis()
    S, M = jax.sharding.get_abstract_mesh().shape[axis], microbatches
    xs = split_microbatches(x, M)  # [M, B/M, ...]
    extras = jax.tree.map(lambda e: split_microbatches(e, M), extras)
    run = jax.checkpoint(stage_fn)  # per iteration: keep the stage's input, recompute the rest

    def per_stage(params, xs, extras):
        stage = jax.lax.axis_index(axis)

        def iteration(carry, t):
            held, outs = carry
            m = jnp.clip(t - stage, 0, M - 1)  # the microbatch this stage works on now
            inp = jnp.where(stage == 0, xs[jnp.minimum(t, M - 1)], held)
            out = run(params, inp, jax.tree.map(lambda e: e[m], extras), stage)
            done = (stage == S - 1) & (t >= stage) & (t - stage < M)
            outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(done, out, outs[m]), m, 0)
            held = jax.lax.ppermute(out, axis, [(i, i + 1) for i in range(S - 1)])
            return (held, outs), None

        init = jax.lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), (axis,), to="varying")
        (_, outs), _ = jax.lax.scan(iteration, init, jnp.arange(M + S - 1))
        # Only the last stage holds the outputs; the sum hands them to every stage.
        return jax.lax.psum(jnp.where(stage == S - 1, outs, jnp.zeros_like(outs)), axis)

    staged = jax.shard_map(per_stage, in_specs=(jax.P(axis), jax.P(), jax.P()),
                           out_specs=jax.P(), axis_names={axis})
    return join_microbatches(staged(params, xs, extras))
