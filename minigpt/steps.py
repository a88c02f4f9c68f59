"""The compiled steps: loss, one optimizer step, evaluation; and the optimizer itself.

Steps are functions of their arguments alone. Randomness arrives as a key: the dropout key of a
step is the run's key folded with the optimizer's step count, so a resumed run draws exactly the
masks the uninterrupted run would have drawn. A step reads nothing from the host and returns
its metrics as device scalars; the trainer decides when to look at them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from minigpt import kernels, pipeline
from minigpt.config import TrainConfig, warmup_for
from minigpt.models import DecoderLM
from minigpt.models.layers import DECAYED_PARAMETERS, row_keys


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up to `peak`, cosine decay to `floor` at step `decay_end`, constant after.

    Warm-up starts at peak / warmup rather than 0, so the first step already learns. A frozen
    dataclass rather than a closure: equal schedules compare equal, so runs with the same
    hyperparameters share one compiled train step.
    """

    peak: float
    floor: float
    warmup: int
    decay_end: int

    def __call__(self, step):
        step = jnp.asarray(step, jnp.float32)
        warm = self.peak * (step + 1) / max(self.warmup, 1)
        progress = jnp.clip((step - self.warmup) / max(self.decay_end - self.warmup, 1), 0.0, 1.0)
        cosine = self.floor + (self.peak - self.floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < self.warmup, warm, cosine)


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    return LRSchedule(peak=cfg.lr, floor=cfg.lr * cfg.min_lr_ratio, warmup=warmup_for(cfg),
                      decay_end=cfg.decay_steps or cfg.steps)


def decays(path: tuple) -> bool:
    """Whether weight decay applies to the parameter at this pytree path: weight matrices and
    embedding tables (the layers name them `kernel` and `table`) decay, biases and norm scales
    never, whatever their shape (a head bias is [heads, head_dim]; a stacked norm scale is
    [layers, embed])."""
    name = next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
    return name in DECAYED_PARAMETERS


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; matrices and tables decay, biases and norm scales do
    not (`decays`)."""
    return _adamw(lr_schedule(cfg), cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip)


@functools.cache
def _adamw(schedule: LRSchedule, b1: float, b2: float, weight_decay: float,
           clip: float) -> optax.GradientTransformation:
    # Cached: the optimizer object is part of what a compiled step is keyed on, so equal
    # settings must give the identical object to reuse a compilation.
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)

    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


def loss_fn(model: DecoderLM, batch: dict[str, jax.Array], dropout_keys: jax.Array | None = None,
            pipeline_microbatches: int = 0) -> jax.Array:
    """Mean next-token cross-entropy of a batch {"inputs", "targets"} (int [B, T] each), with
    dropout when keys (one per row) are given."""
    x = model.features(batch["inputs"], dropout_key=dropout_keys,
                       pipeline_microbatches=pipeline_microbatches)  # [B, T, D]
    return kernels.get(model.config.kernels).cross_entropy(model, x, batch["targets"])


def _loss_and_grads(model: DecoderLM, batch, keys, microbatches: int, pipeline_microbatches: int):
    if microbatches == 1:
        return nnx.value_and_grad(loss_fn)(model, batch, keys, pipeline_microbatches)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def accumulate(carry, micro):
        micro_batch, micro_keys = micro
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p, rest), micro_batch, micro_keys,
                              pipeline_microbatches))(params)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    # Each microbatch takes its rows' keys along, so accumulation draws the masks one big batch
    # would have drawn.
    micros = jax.tree.map(lambda x: pipeline.split_microbatches(x, microbatches), (batch, keys))
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, micros)
    return jax.tree.map(lambda x: x / microbatches, (loss, grads))


@functools.partial(nnx.jit, static_argnames=("microbatches", "pipeline_microbatches", "schedule"),
                   donate_argnames=("model", "optimizer"))
def train_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
               rng: jax.Array, *, microbatches: int = 1, pipeline_microbatches: int = 0,
               schedule: optax.Schedule | None = None) -> dict[str, jax.Array]:
    """One optimizer step on a global batch, accumulated over `microbatches` inside the step
    (and, under a pipeline preset, run through the stages in `pipeline_microbatches` pieces).

    Row r of the batch draws its dropout masks from fold_in(fold_in(rng, step), r), whatever
    the preset, accumulation or pipeline, so all of them compute the same step.
    """
    step = optimizer.step[...]
    keys = None
    if model.config.dropout > 0:
        keys = row_keys(jax.random.fold_in(rng, step), batch["inputs"].shape[0])
    loss, grads = _loss_and_grads(model, batch, keys, microbatches, pipeline_microbatches)
    optimizer.update(model, grads)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    if schedule is not None:
        metrics["lr"] = schedule(step)
    return metrics


@functools.partial(nnx.jit, static_argnames=("pipeline_microbatches",))
def eval_step(model: DecoderLM, batch: dict[str, jax.Array], *,
              pipeline_microbatches: int = 0) -> jax.Array:
    """Mean loss on a batch, without dropout."""
    return loss_fn(model, batch, None, pipeline_microbatches)
