"""Direct preference optimisation (DPO): its loss, its step and the reference it is measured by.

A batch holds pairs (`minigpt.data.preferences`): "ids" and "completion" [B, 2, T + 1] (the
chosen sequence, then the rejected one) and "reference" [B, 2], the reference model's summed
log-probabilities of each reply. A reply's log-probability is the sum over its tokens of the
policy's log p(token | everything before it), the end token included, as TRL's `DPOTrainer`
sums it; with r = beta (log pi - log pi_ref) of each reply, the loss is the mean over pairs of
-log sigmoid(r_chosen - r_rejected) (TRL's default, "sigmoid"). Dropout is off, as TRL turns it
off. The step reports TRL's metric names, computed from the batch before the update.

The reference's log-probabilities are computed once, before the first step, by the same
program (`sequence_logps`) on the reference's weights (the run's own at step 0, or another
run's), so training holds no second copy of the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import sharding
from minigpt.models import DecoderLM
from minigpt.models.loss import target_logits
from minigpt.optim.lr_schedule import LRSchedule
from minigpt.optim.steps import loss_and_grads

# The metrics a step reports beside its loss, by TRL's names.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def _rows(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs, targets and the targets' reply mask [2B, T] of a batch of pairs: pair i's chosen
    sequence is row 2i, its rejected one row 2i + 1 (a device keeps its own pairs' rows)."""
    ids, completion = batch["ids"], batch["completion"]
    ids = ids.reshape(-1, ids.shape[-1])
    completion = completion.reshape(-1, completion.shape[-1])
    return ids[:, :-1], ids[:, 1:], completion[:, 1:].astype(jnp.float32)


def sequence_logps(model: DecoderLM, batch: dict[str, jax.Array]) -> jax.Array:
    """Each reply's summed log-probability under `model` [B, 2], in float32."""
    inputs, targets, mask = _rows(batch)
    logits = model(inputs)  # [2B, T, V] float32, the padded vocabulary at -inf
    token = target_logits(logits, targets) - jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(token * mask, axis=-1).reshape(-1, 2)


def dpo_metrics(logps: jax.Array, reference: jax.Array, beta: float) -> dict[str, jax.Array]:
    """The loss and TRL's metrics of a batch from its policy and reference log-probabilities
    [B, 2] (chosen, rejected)."""
    rewards = beta * (logps - reference)  # [B, 2]
    margin = rewards[:, 0] - rewards[:, 1]
    return {"loss": jnp.mean(-jax.nn.log_sigmoid(margin)),
            "rewards/chosen": jnp.mean(rewards[:, 0]),
            "rewards/rejected": jnp.mean(rewards[:, 1]),
            "rewards/accuracies": jnp.mean((margin > 0).astype(jnp.float32)),
            "rewards/margins": jnp.mean(margin),
            "logps/chosen": jnp.mean(logps[:, 0]), "logps/rejected": jnp.mean(logps[:, 1])}


def _dpo_loss(model: DecoderLM, batch: dict[str, jax.Array], keys, *, beta: float):
    metrics = dpo_metrics(sequence_logps(model, batch), batch["reference"], beta)
    return metrics["loss"], metrics


@sharding.jit(static_argnames=("microbatches", "beta"), donate_argnames=("model", "optimizer"))
def dpo_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
             rng: jax.Array, schedule: LRSchedule, *, beta: float,
             microbatches: int = 1) -> dict[str, jax.Array]:
    """One optimizer step on a batch of pairs, accumulated over `microbatches` slices of its
    pairs (each a mean over its pairs, the metrics their mean, as TRL accumulates them)."""
    step = optimizer.step[...]
    metrics, grads = loss_and_grads(model, batch, None, microbatches, optimizer.wrt,
                                    loss=lambda m, b, k: _dpo_loss(m, b, k, beta=beta))
    optimizer.update(model, grads, schedule=schedule)
    return {**metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}


@sharding.jit
def _logps_step(model: DecoderLM, batch: dict[str, jax.Array]) -> jax.Array:
    return sequence_logps(model, batch)


def pair_logps(model: DecoderLM, rows: dict[str, np.ndarray], batch_size: int,
               put) -> np.ndarray:
    """The summed log-probabilities [N, 2] of every pair of a split's `rows` (`ids`,
    `completion`) under `model`, `batch_size` pairs at a time (the last batch filled up with
    the first pairs, whose figures are dropped), each batch placed by `put`."""
    count = len(rows["ids"])
    out = []
    for start in range(0, count, batch_size):
        take = np.arange(start, start + batch_size) % count
        out.append(_logps_step(model, put({k: rows[k][take] for k in ("ids", "completion")})))
    return np.concatenate(jax.device_get(out))[:count]


def evaluate(logps: np.ndarray, reference: np.ndarray, beta: float) -> dict[str, float]:
    """Held-out metrics of pairs' policy and reference log-probabilities [N, 2]: TRL's names
    with `eval_` before them (`eval_loss` the DPO loss)."""
    metrics = jax.device_get(dpo_metrics(jnp.asarray(logps), jnp.asarray(reference), beta))
    return {f"eval_{k}": float(v) for k, v in metrics.items()}


def describe(result: dict[str, float]) -> str:
    """Post-training's held-out figures as the log shows them: "DPO loss 0.4123, chosen over
    rejected 0.938, margin 1.520"; GRPO's "reward 0.620 (correct 0.620)"."""
    if "eval_reward" in result:
        each = [f"{k.split('/')[1]} {v:.3f}" for k, v in result.items()
                if k.startswith("eval_rewards/") and k.endswith("/mean")]
        return f"reward {result['eval_reward']:.3f} ({', '.join(each)})"
    return ("DPO loss {eval_loss:.4f}, chosen over rejected {eval_rewards/accuracies:.3f}, "
            "margin {eval_rewards/margins:.3f}".format_map(result))
