"""Group relative policy optimisation (GRPO): advantages, the clipped loss and its step, as
TRL's `GRPOTrainer` (1.16) defines them.

A batch holds completions drawn from the policy (`minigpt.train.grpo` draws them on the
decoding engine): "ids" [B, T + 1] (each prompt and its completion, 0 past the end), "mask"
[B, T + 1] (1 on completion tokens, the end token included), "advantages" [B], "weights"
[B, T + 1] (each completion token's share of the loss, `token_weights`), and where asked
"old" [B, T] (the policy's log-probabilities when it drew them: `num_iterations` > 1) and
"reference" [B, T] (a frozen reference's: `grpo_beta` > 0).

Per completion token, with r = pi / pi_old (1 with gradient when the batch is fresh) and A its
completion's advantage, the loss is -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), plus
beta r (exp(ref - logp) - (ref - logp) - 1) (the k3 estimate of the KL to the reference, times
the ratio: TRL's `use_bias_correction_kl`); it is
summed with the token weights, which make it `loss_type`'s mean: "dapo" over every completion
token of the batch, "grpo" over each completion's tokens then the completions, "dr_grpo" over
the completions times `max_completion_length`. Logits are divided by the sampling
temperature, as TRL divides them.
"""

from __future__ import annotations

import warnings

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

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


def advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """Each completion's advantage [B] from its reward (NaN: unscored) within its group of
    `group` consecutive completions (one prompt's), scaled by the group's standard deviation
    ("group"), the batch's ("batch") or not ("none"); and whether each one's scale was 0."""
    grouped = rewards.reshape(-1, group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: NaN, as in TRL
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
        if scale == "batch":
            std = np.full_like(rewards, nanstd(rewards))
        else:
            std = np.repeat(nanstd(grouped, axis=1), group)
    result = rewards - mean
    if scale != "none":
        result = result / (std + 1e-4)
    return np.nan_to_num(result, nan=0.0), np.isclose(std, 0.0)


def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """The standard deviation leaving NaNs out, with Bessel's correction (TRL's `nanstd`;
    NaN for fewer than two values)."""
    count = np.sum(~np.isnan(x), axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: NaN, as in TRL
        variance = np.nanmean((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis)
        return np.where(count > 1, np.sqrt(variance * count / (count - 1)), np.nan)


def token_weights(mask: np.ndarray, loss_type: str, max_completion: int,
                  microbatches: int) -> np.ndarray:
    """Each completion token's weight in the loss [B, T + 1] (see the module docstring), times
    `microbatches` (accumulation averages their losses)."""
    mask = mask.astype(np.float32)
    if loss_type == "dapo":
        weights = mask / max(mask.sum(), 1.0)
    elif loss_type == "grpo":
        weights = mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0) / len(mask)
    else:  # dr_grpo
        weights = mask / (len(mask) * max_completion)
    return (weights * microbatches).astype(np.float32)


def token_logps(model: DecoderLM, ids: jax.Array, temperature: float
                ) -> tuple[jax.Array, jax.Array]:
    """Each target's log-probability [B, T] under `model` at `temperature`, and the entropy of
    the distribution it was drawn from [B, T]."""
    logits = model(ids[:, :-1]) / temperature  # float32, the padded vocabulary at -inf
    logz = jax.nn.logsumexp(logits, axis=-1)
    logp_all = logits - logz[..., None]
    probs = jnp.exp(logp_all)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp_all, 0.0), axis=-1)
    return target_logits(logits, ids[:, 1:]) - logz, entropy


def _grpo_loss(model, batch, keys, *, epsilon_low, epsilon_high, beta, temperature):
    logps, entropy = token_logps(model, batch["ids"], temperature)
    mask, weights = batch["mask"][:, 1:], batch["weights"][:, 1:]
    old = batch["old"] if "old" in batch else jax.lax.stop_gradient(logps)
    # outside the completions the differences are not read: 0 there, so no exp overflows
    ratio = jnp.exp(jnp.where(mask > 0, logps - old, 0.0))
    adv = batch["advantages"][:, None]
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    count = jnp.maximum(jnp.sum(mask), 1.0)

    def masked_mean(x):
        return jnp.sum(x * mask) / count

    metrics = {"entropy": masked_mean(entropy)}
    if beta:
        delta = jnp.where(mask > 0, batch["reference"] - logps, 0.0)
        kl = (jnp.exp(delta) - delta - 1) * ratio  # TRL's use_bias_correction_kl
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl)
    low = (ratio < 1 - epsilon_low) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    metrics.update({"clip_ratio/low_mean": masked_mean(low), "clip_ratio/high_mean":
                    masked_mean(high), "clip_ratio/region_mean": masked_mean(low | high)})
    loss = jnp.sum(per_token * weights)
    return loss, {"loss": loss, **metrics}


@sharding.jit(static_argnames=("microbatches", "epsilon_low", "epsilon_high", "beta",
                               "temperature"), donate_argnames=("model", "optimizer"))
def grpo_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
              schedule: LRSchedule, *, epsilon_low: float, epsilon_high: float, beta: float,
              temperature: float, microbatches: int = 1) -> dict[str, jax.Array]:
    """One optimizer step on a batch of completions, accumulated over `microbatches` slices."""
    step = optimizer.step[...]
    metrics, grads = loss_and_grads(
        model, batch, None, microbatches, optimizer.wrt,
        loss=lambda m, b, k: _grpo_loss(m, b, k, epsilon_low=epsilon_low,
                                        epsilon_high=epsilon_high, beta=beta,
                                        temperature=temperature))
    optimizer.update(model, grads, schedule=schedule)
    return {**metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}


@sharding.jit(static_argnames=("temperature",))
def policy_logps(model: DecoderLM, ids: jax.Array, *, temperature: float) -> jax.Array:
    """The targets' log-probabilities [B, T] (a rollout's `old` or `reference`)."""
    return token_logps(model, ids, temperature)[0]


# TRL's names of post-training metrics without a "/" in them (those with one are all TRL's).
FLAT_NAMES = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy")


def tensorboard_tags(record: dict) -> dict[str, str]:
    """The TensorBoard tags of a metrics record's post-training metrics (DPO's and GRPO's, by
    TRL's names): "train/<name>", and "eval/<name>" for held-out ones (`eval_<name>`)."""
    tags = {}
    for key in record:
        name = key.removeprefix("eval_")
        if "/" in name or name in FLAT_NAMES:
            tags[key] = f"{'train' if name == key else 'eval'}/{name}"
    return tags
