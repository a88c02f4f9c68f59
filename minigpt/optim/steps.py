"""The compiled steps: loss, one optimizer step, evaluation.

Steps are functions of their arguments alone. Randomness arrives as a key: the dropout key of a
step is the run's key folded with the optimizer's step count, so a resumed run draws exactly the
masks the uninterrupted run would have drawn. A step reads nothing from the host and returns
its metrics as device arrays (scalars, and for a mixture of experts each expert's share of the
assignments as a vector); the trainer decides when to look at them. The loss itself is the
model's (`DecoderLM.loss`, which picks its kernels and, under a pipeline preset, the schedule);
the optimizer is `minigpt.optim.optimizer`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import pipeline, sharding
from minigpt.models import DecoderLM, lora
from minigpt.models.inputs import loss_batch
from minigpt.models.layers import row_keys
from minigpt.optim.lr_schedule import LRSchedule


def _loss_and_metrics(model: DecoderLM, batch, keys):
    return model.loss_and_metrics(batch, keys)


def loss_and_grads(model: DecoderLM, batch, keys, microbatches: int, wrt=nnx.Param,
                   loss=_loss_and_metrics):
    """The metrics of `loss(model, batch, keys)` (a loss and its metrics: by default the
    model's, `DecoderLM.loss_and_metrics`, of a batch `loss_batch` has weighted) and the
    gradients of the loss with respect to the parameters `wrt` picks (the optimizer's: a
    model's adapters, if it has any; its frozen weights get none), accumulated over
    `microbatches` slices of the batch's rows."""
    if microbatches == 1:
        (_, metrics), grads = nnx.value_and_grad(
            loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(model, batch, keys)
        return metrics, grads
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def micro_step(p, micro_batch, micro_keys):
        (_, metrics), grads = jax.value_and_grad(
            lambda p: loss(nnx.merge(graphdef, p, rest), micro_batch, micro_keys),
            has_aux=True)(p)
        return metrics, grads

    def accumulate(carry, micro):
        return jax.tree.map(jnp.add, carry, micro_step(params, *micro)), None

    # Each microbatch takes its rows' keys along, so accumulation draws the masks one big batch
    # would have drawn.
    micros = jax.tree.map(lambda x: pipeline.split_microbatches(x, microbatches), (batch, keys))
    first = jax.tree.map(lambda x: x[0], micros)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         jax.eval_shape(micro_step, params, *first))
    (metrics, grads), _ = jax.lax.scan(accumulate, zeros, micros)
    # Means (floats) are averaged over the microbatches; counts (ints) add up.
    return jax.tree.map(lambda x: x / microbatches if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, (metrics, grads))


def _reported(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """What a step reports of the model's metrics: the cross-entropy as `loss`, the router's
    penalties as they are, each expert's share of the assignments (a vector) and the largest
    share, and (capacity dispatch) the assignments dropped."""
    reported = {"loss": metrics.pop("cross_entropy")}
    tokens = metrics.pop("expert_tokens", None)
    if tokens is not None:
        share = tokens / jnp.maximum(jnp.sum(tokens), 1)
        reported.update(expert_share=share, expert_share_max=jnp.max(share))
    return {**reported, **metrics}


@sharding.jit(static_argnames=("microbatches",), donate_argnames=("model", "optimizer"))
def train_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
               rng: jax.Array, schedule: LRSchedule, *,
               microbatches: int = 1) -> dict[str, jax.Array]:
    """One optimizer step on a global batch at the learning rate `schedule` gives this step,
    accumulated over `microbatches` inside the step (under a pipeline preset each of them runs
    through the stages as the context's pipeline settings say). `loss` is the next-token
    cross-entropy; a mixture of experts minimises it plus `aux_loss` and `z_loss`.

    Row r of the batch draws its dropout masks from fold_in(fold_in(rng, step), r), whatever
    the preset, accumulation or pipeline, so all of them compute the same step.
    """
    step = optimizer.step[...]
    keys = None
    if model.config.dropout > 0 or lora.has_dropout(model):
        keys = row_keys(jax.random.fold_in(rng, step), batch["inputs"].shape[0])
    # weights scaled over the whole batch, before it is cut into microbatches
    metrics, grads = loss_and_grads(model, loss_batch(batch), keys, microbatches, optimizer.wrt)
    optimizer.update(model, grads, schedule=schedule)
    return {**_reported(metrics), "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}


@sharding.jit
def eval_step(model: DecoderLM, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy on a batch, without dropout (the router's penalties of a
    mixture of experts left out: they are for training)."""
    return model.loss_and_metrics(batch)[1]["cross_entropy"]


@sharding.jit
def text_nats_and_bytes(model: DecoderLM, batch: dict[str, jax.Array]
                        ) -> tuple[jax.Array, jax.Array]:
    """The summed cross-entropy (nats) of a batch's text targets, those "text_mask" [B, T]
    marks (trained, and not an end or begin token, which stand for no bytes), without dropout;
    and the UTF-8 bytes that text holds, summed from "text_bytes" [B, T]."""
    text = batch["text_mask"]
    rest = {k: v for k, v in batch.items()
            if k not in ("loss_mask", "weights", "text_mask", "text_bytes")}
    mean = model.loss_and_metrics({**rest, "loss_mask": text})[1]["cross_entropy"]
    return mean * jnp.maximum(jnp.sum(text), 1), jnp.sum(batch["text_bytes"])


def evaluate(model: DecoderLM, batches) -> dict[str, float]:
    """Held-out metrics over an iterable of placed batches, read back once at the end:
    "eval_loss", the mean of `eval_step` (nats per token), and where the batches say which
    targets are text and what bytes they hold ("text_mask", "text_bytes"),
    "eval_bits_per_byte": the text's nats over ln 2 over its bytes, the tokenizer-independent
    score bench/bench_stories.py gives held-out stories."""
    losses, texts = [], []
    for batch in batches:
        losses.append(eval_step(model, {k: v for k, v in batch.items()
                                        if k not in ("text_mask", "text_bytes")}))
        if "text_mask" in batch:
            texts.append(text_nats_and_bytes(model, batch))
    result = {"eval_loss": float(np.mean(jax.device_get(losses)))}
    if texts:
        nats, count = np.sum(jax.device_get(texts), axis=0)
        result["eval_bits_per_byte"] = float(nats) / math.log(2) / max(float(count), 1.0)
    return result


def mean_loss(model: DecoderLM, batches) -> float:
    """The mean of `eval_step` over an iterable of placed batches, read back once at the end."""
    losses = [eval_step(model, batch) for batch in batches]
    return float(np.mean(jax.device_get(losses)))
