"""Where a run keeps its stacked layers while a circular schedule runs them.

Under the circular schedule (R > 1 chunks per stage) stage s runs the chunks s, s + S, s + 2S,
... of the stack, so the [layers, ...] arrays, split over the stages in order, must hold the
layers in the schedule's order (`schedules.layer_order`) for each stage to hold its own chunks.
`circular_positions` says which order a setting needs, the one place that decides it; a run
enters that order once when it starts and leaves it once (to generate) with `LayerOrder`, so no
weights move between stages at any step; checkpoints keep the model's order, so a run moves
between schedules and presets through them; and the model, called under such a context outside
the pipeline (`minigpt.models.decoder.BlockStack`), runs the layers in its own order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import minigpt.pipeline.schedules as schedules
from minigpt import sharding


def circular_positions(settings: sharding.Pipeline, stages: int,
                       num_layers: int) -> np.ndarray | None:
    """The order the stacked arrays hold the layers in under these pipeline settings on
    `stages` stages: the circular schedule's (`schedules.layer_order`), or None where it is
    the model's own (no pipeline, or one chunk per stage)."""
    if stages == 1 or settings.repeats == 1:
        return None
    return schedules.layer_order(num_layers, stages, settings.repeats)


def positions_in_use(num_layers: int) -> np.ndarray | None:
    """`circular_positions` of the active context: what a model called inside it holds."""
    return circular_positions(sharding.active().pipeline, sharding.active_ways("layers"),
                              num_layers)


class LayerOrder:
    """Where a run keeps its stacked layers while it trains: under a circular schedule in the
    schedule's order (`circular_positions`), which the model and optimizer enter once when the
    run starts and leave once when it ends, so no weights move at each step; elsewhere in the
    model's order, and every method does nothing. Checkpoints always hold the model's order."""

    def __init__(self, layout: sharding.Layout, num_layers: int):
        stages = layout.stages if layout.pipeline.microbatches else 1
        self.order = circular_positions(layout.pipeline, stages, num_layers)

    def enter(self, *objects) -> None:
        """Move NNX objects (the model, its optimizer) from the model's order into the run's."""
        if self.order is not None:
            for obj in objects:
                nnx.update(obj, reorder_layers(nnx.state(obj), self.order))

    def leave(self, *objects) -> None:
        """Move NNX objects back into the model's order (to generate, say)."""
        if self.order is not None:
            back = np.argsort(self.order)
            for obj in objects:
                nnx.update(obj, reorder_layers(nnx.state(obj), back))

    def canonical(self, state):
        """A state held in the run's order, as the model's order stores it (for checkpoints)."""
        return state if self.order is None else reorder_layers(state, np.argsort(self.order))


def reorder_layers(state, positions: np.ndarray):
    """An NNX state (parameters or optimizer state) whose stacked arrays, those with a leading
    `layers` axis, hold their layers in `positions` order: position i gets layer positions[i].
    One collective per array, with each array's sharding kept: a run enters or leaves the
    circular order with it once, never per step."""
    index = jnp.asarray(positions)

    def one(var):
        if not isinstance(var, nnx.Variable):
            return var
        axes = var.get_metadata().get("out_sharding") or ()
        if axes[:1] != ("layers",):
            return var
        value = var.get_value()
        moved = jax.jit(lambda a: a[index], out_shardings=value.sharding)(value)
        return var.replace(moved)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


