"""What XLA allocates for the real train step: the check behind `python -m minigpt.plan --compile`.

The step is the trainer's own (`minigpt.train.steps.train_step`), lowered and compiled for the
devices present (or simulated) with the model and optimizer as the trainer creates them, but
abstract: every array a `jax.ShapeDtypeStruct` with the sharding `sharding.create_sharded` would
give it, so nothing is allocated however large the model. The compiled program's
`memory_analysis()` gives, per device, its arguments (weights, optimizer state, the batch), its
outputs, the bytes the outputs share with donated arguments (the step updates the weights and
optimizer state in place) and its temporaries; their sum without the shared bytes is what a
device needs to run the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import minigpt.train.adapters as adapters
import minigpt.train.lr_schedule as lr_schedule
import minigpt.train.steps as steps
from minigpt import sharding
from minigpt.config import ModelConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Compiled:
    """`memory_analysis()` of the compiled step, bytes per device."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def compile_step(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset,
                 settings: sharding.Pipeline) -> Compiled:
    """Lower and compile the train step under `preset` on the devices present (`settings`:
    the pipeline as `sharding.check_layout` resolved it) and read what it allocates."""
    mesh = sharding.make_mesh(preset)
    abstract = nnx.eval_shape(lambda: adapters.build(model_cfg, train_cfg))
    graphdef, state = nnx.split(abstract)
    shardings = sharding.state_shardings(preset, mesh, state)
    placed = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          state, shardings)
    model, optimizer = nnx.merge(graphdef, placed)
    seq_len = train_cfg.seq_len or model_cfg.context_len
    rows = sharding.batch_sharding(preset, mesh)
    # As the trainer's batches are: with documents kept apart, their ids, positions and the
    # loss mask beside the tokens (`minigpt.data.documents`).
    keys = ("inputs", "targets") + (("segment_ids", "positions", "loss_mask")
                                    if train_cfg.document_mask else ())
    batch = {k: jax.ShapeDtypeStruct((train_cfg.batch_size, seq_len), jnp.int32, sharding=rows)
             for k in keys}
    how = sharding.ContextParallel(strategy=train_cfg.context_strategy)
    with sharding.use_preset(preset, mesh, settings, context_parallel=how):
        lowered = steps.train_step.lower(model, optimizer, batch, jax.random.key(0),
                                         lr_schedule.lr_schedule(train_cfg),
                                         microbatches=train_cfg.microbatches)
        analysis = lowered.compile().memory_analysis()
    return Compiled(arguments=analysis.argument_size_in_bytes,
                    outputs=analysis.output_size_in_bytes,
                    aliased=analysis.alias_size_in_bytes,
                    temporaries=analysis.temp_size_in_bytes)
