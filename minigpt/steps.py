"""The compiled steps: loss, one optimizer step, evaluation; and the optimizer itself.

Steps are functions of their arguments alone. Randomness arrives as a key: the dropout key of a
step is the run's key folded with the optimizer's step count, so a resumed run draws exactly the
masks the uninterrupted run would have drawn. A step reads nothing from the host and returns
its metrics as device scalars; the trainer decides when to look at them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import kernels, pipeline, sharding
from minigpt.config import TrainConfig
from minigpt.models import DecoderLM
from minigpt.models.layers import DECAYED_PARAMETERS, row_keys
from minigpt.schedule import LRSchedule


def decays(path: tuple) -> bool:
    """Whether weight decay applies to the parameter at this pytree path: weight matrices and
    embedding tables (the layers name them `kernel` and `table`) decay, biases and norm scales
    never, whatever their shape (a head bias is [heads, head_dim]; a stacked norm scale is
    [layers, embed])."""
    name = next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
    return name in DECAYED_PARAMETERS


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """AdamW after global-norm clipping; matrices and tables decay, biases and norm scales do
    not (`decays`). The learning rate is not part of it: each update is given the run's
    `LRSchedule` (`optimizer.update(model, grads, schedule=...)`)."""
    return _adamw(cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip)


def scale_by_schedule_given() -> optax.GradientTransformationExtraArgs:
    """Multiply updates by -schedule(step), the schedule arriving with each update.

    Its state is optax's own `ScaleByScheduleState` (the step count), the state
    `optax.adamw(schedule)` keeps, so checkpoints of runs that compiled their schedule into the
    optimizer restore into this one unchanged.
    """
    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, schedule: LRSchedule, **extra):
        del params, extra
        rate = schedule(state.count)
        updates = jax.tree.map(lambda g: jnp.asarray(-rate, g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


@functools.cache
def _adamw(b1: float, b2: float, weight_decay: float,
           clip: float) -> optax.GradientTransformationExtraArgs:
    # Cached: the optimizer object is part of what a compiled step is keyed on, so equal
    # settings must give the identical object to reuse a compilation.
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)

    adamw = optax.chain(  # optax.adamw, its learning rate given at each update
        optax.scale_by_adam(b1=b1, b2=b2),
        optax.add_decayed_weights(weight_decay, decay_mask),
        scale_by_schedule_given(),
    )
    return optax.chain(optax.clip_by_global_norm(clip), adamw)


def loss_fn(model: DecoderLM, batch: dict[str, jax.Array],
            dropout_keys: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy of a batch {"inputs", "targets"} (int [B, T] each), with
    dropout when keys (one per row) are given. Under a pipeline preset the model runs as the
    context's pipeline schedule says."""
    if sharding.active_ways("layers") > 1:
        return model.pipelined_loss(batch, dropout_keys)
    x = model.features(batch["inputs"], dropout_key=dropout_keys)  # [B, T, D]
    return kernels.get(model.config.kernels).cross_entropy(model, x, batch["targets"])


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
