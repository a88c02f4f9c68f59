"""What XLA allocates for the real train step: the check behind `python -m minigpt.plan --compile`.

The step is the trainer's own (`minigpt.optim.steps.train_step`), lowered and compiled for the
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

import minigpt.optim.lr_schedule as lr_schedule
import minigpt.optim.state as adapters
import minigpt.optim.steps as steps
from minigpt import sharding
from minigpt.config import ModelConfig, TrainConfig
from minigpt.runs import resolved


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


def compile_step(model_cfg: ModelConfig, train_cfg: TrainConfig,
                 layout: sharding.Layout) -> Compiled:
    """Lower and compile the train step under the run's `layout` (`resolved.layout`) on the
    devices present and read what it allocates."""
    model, optimizer = sharding.abstract_sharded(lambda: adapters.build(model_cfg, train_cfg),
                                                 layout)
    seq_len = resolved.seq_len(model_cfg, train_cfg)
    rows = layout.batch_sharding()
    # As the trainer's batches are: with documents kept apart, their ids, positions and the
    # loss mask beside the tokens (`minigpt.data.documents`).
    keys = ("inputs", "targets") + (("segment_ids", "positions", "loss_mask")
                                    if train_cfg.document_mask else ())
    batch = {k: jax.ShapeDtypeStruct((train_cfg.batch_size, seq_len), jnp.int32, sharding=rows)
             for k in keys}
    with layout.active():
        lowered = steps.train_step.lower(model, optimizer, batch, jax.random.key(0),
                                         lr_schedule.lr_schedule(train_cfg),
                                         microbatches=train_cfg.microbatches)
        analysis = lowered.compile().memory_analysis()
    return Compiled(arguments=analysis.argument_size_in_bytes,
                    outputs=analysis.output_size_in_bytes,
                    aliased=analysis.alias_size_in_bytes,
                    temporaries=analysis.temp_size_in_bytes)
