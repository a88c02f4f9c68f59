"""Pipeline parallelism: the block stack run as a schedule over the mesh axis of `layers`.

Under a preset with the rule `layers = "stage"`, every stacked block parameter [L, ...] is split
into S slices, one per stage of the `stage` mesh axis. The train step runs the model as a
pipeline, SPMD: the batch is cut into M microbatches (every M-th row, so each device keeps its
own rows), and a loop of ticks executes a schedule's table (`minigpt.pipeline.schedules`): at
each tick every stage may run the forward of one microbatch through one of its chunks of layers
and the backward of another, recomputing the chunk from the input it stashed (`jax.vjp`).
Activations move to the next stage and gradients to the previous one by collective permutes
carried in the loop. The embedding runs on the first stage as a microbatch enters; the output
head and the loss run as a microbatch leaves the last stage, its positions split over all S
stages (a reduce-scatter of the last stage's output, each stage 1/S of the head's work, and an
all-gather of the gradient back), so no stage computes the head for the whole batch.

The gradients are written out by hand, inside the loop, rather than left to autodiff: that is
what lets 1F1B interleave forwards and backwards in one program, and what keeps a stage's stash
to the inputs its schedule says are alive. To autodiff the result is one function with a custom
VJP (`loss`): its forward runs the loop and returns the gradients with the loss; evaluation,
which needs no gradients, runs the forwards alone.

Only `stage` is manual inside the loop (`jax.shard_map` over that one axis); every other mesh
axis (data, fsdp, model) keeps its automatic sharding, so pipeline presets compose with the
others. This module knows the mesh through `minigpt.sharding` only; models hand it an embedding,
a chunk of layers and a head as functions and never name a mesh axis.
"""

from __future__ import annotations

from minigpt.pipeline.executor import join_microbatches, loss, split_microbatches, zeros_like
from minigpt.pipeline.layer_order import (
    LayerOrder,
    circular_positions,
    positions_in_use,
    reorder_layers,
)
from minigpt.pipeline.schedules import Schedule, bubble_fraction, describe, table

__all__ = ["LayerOrder", "Schedule", "bubble_fraction", "circular_positions", "describe",
           "join_microbatches", "loss", "positions_in_use", "reorder_layers",
           "split_microbatches", "table", "zeros_like"]
