"""The compiled steps: loss, one optimizer step, evaluation.

Steps are functions of their arguments alone. Randomness arrives as a key: the dropout key of a
step is the run's key folded with the optimizer's step count, so a resumed run draws exactly the
masks the uninterrupted run would have drawn. A step reads nothing from the host and returns
its metrics as device scalars; the trainer decides when to look at them. The loss itself is the
model's (`DecoderLM.loss`, which picks its kernels and, under a pipeline preset, the schedule);
the optimizer is `minigpt.train.optimizer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import pipeline, sharding
from minigpt.models import DecoderLM
from minigpt.models.layers import row_keys
from minigpt.train.lr_schedule import LRSchedule


def loss_fn(model: DecoderLM, batch: dict[str, jax.Array],
            dropout_keys: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy of a batch {"inputs", "targets"} (int [B, T] each), with
    dropout when keys (one per row) are given: the model's own loss (`DecoderLM.loss`)."""
    return model.loss(batch, dropout_keys)


def _loss_and_grads(model: DecoderLM, batch, keys, microbatches: int):
    if microbatches == 1:
        return nnx.value_and_grad(loss_fn)(model, batch, keys)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def accumulate(carry, micro):
        micro_batch, micro_keys = micro
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p, rest), micro_batch, micro_keys))(params)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    # Each microbatch takes its rows' keys along, so accumulation draws the masks one big batch
    # would have drawn.
    micros = jax.tree.map(lambda x: pipeline.split_microbatches(x, microbatches), (batch, keys))
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, micros)
    return jax.tree.map(lambda x: x / microbatches, (loss, grads))


@sharding.jit(static_argnames=("microbatches",), donate_argnames=("model", "optimizer"))
def train_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
               rng: jax.Array, schedule: LRSchedule, *,
               microbatches: int = 1) -> dict[str, jax.Array]:
    """One optimizer step on a global batch at the learning rate `schedule` gives this step,
    accumulated over `microbatches` inside the step (under a pipeline preset each of them runs
    through the stages as the context's pipeline settings say).

    Row r of the batch draws its dropout masks from fold_in(fold_in(rng, step), r), whatever
    the preset, accumulation or pipeline, so all of them compute the same step.
    """
    step = optimizer.step[...]
    keys = None
    if model.config.dropout > 0:
        keys = row_keys(jax.random.fold_in(rng, step), batch["inputs"].shape[0])
    loss, grads = _loss_and_grads(model, batch, keys, microbatches)
    optimizer.update(model, grads, schedule=schedule)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}


@sharding.jit
def eval_step(model: DecoderLM, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean loss on a batch, without dropout."""
    return loss_fn(model, batch)


def mean_loss(model: DecoderLM, batches) -> float:
    """The mean of `eval_step` over an iterable of placed batches, read back once at the end."""
    losses = [eval_step(model, batch) for batch in batches]
    return float(np.mean(jax.device_get(losses)))
