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

from minigpt import sharding
from minigpt.config import TrainConfig
from minigpt.models import DecoderLM


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
    return LRSchedule(peak=cfg.lr, floor=cfg.lr * cfg.min_lr_ratio, warmup=cfg.warmup_steps,
                      decay_end=cfg.decay_steps or cfg.steps)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; matrices decay, biases and norm scales do not."""
    return _adamw(lr_schedule(cfg), cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip)


@functools.cache
def _adamw(schedule: LRSchedule, b1: float, b2: float, weight_decay: float,
           clip: float) -> optax.GradientTransformation:
    # Cached: the optimizer object is part of what a compiled step is keyed on, so equal
    # settings must give the identical object to reuse a compilation.
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits [B, T, V] float32, targets [B, T] int."""
    log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    return jnp.mean(log_z - target_logit)


# Tokens per chunk of the fused loss: [chunk, V] float32 logits stay around 100 MB for GPT-2's
# vocabulary, small enough to be cheap to revisit, large enough for efficient matmuls.
LOSS_CHUNK_TOKENS = 512


def _chunk_len(batch: int, seq: int) -> int:
    """The longest sequence chunk c dividing seq with batch * c <= LOSS_CHUNK_TOKENS (>= 1)."""
    return max([c for c in range(1, seq + 1) if seq % c == 0 and batch * c <= LOSS_CHUNK_TOKENS]
               or [1])


def fused_cross_entropy(model: DecoderLM, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of the model's output head applied to features x [B, T, D].

    Equal to cross_entropy(model.logits(x), targets), but never holds the [B, T, V] logits:
    the head runs chunk by chunk along the sequence, and each chunk's gradient (softmax minus
    the one-hot target, pulled back through the head) is formed while its logits are at hand.
    That is three matmuls per chunk, as plain autodiff needs, and two passes over the logits
    instead of about six. Chunks split the sequence, not the batch, so batch sharding holds.
    """
    graphdef, state = nnx.split(model)

    def chunk_logits(state, xc):
        return nnx.merge(graphdef, state).logits(xc)  # [R, V]

    B, T, _ = x.shape
    return _fused_ce(chunk_logits, T // _chunk_len(B, T), sharding.active_batch_shards(),
                     state, x, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_ce(chunk_logits, chunks, shards, state, x, targets):
    return _fused_ce_fwd(chunk_logits, chunks, shards, state, x, targets)[0]


def _fused_ce_fwd(chunk_logits, chunks, shards, state, x, targets):
    B, T, D = x.shape
    c, S = T // chunks, shards
    # [n, S, B*c/S, D]: each chunk flattened to rows (so the head's matmuls are plain 2-D) and
    # grouped by batch shard S. Each shard accumulates its own partial parameter gradient in
    # the loop; they are summed once at the end, instead of one all-reduce per chunk.
    xs = jnp.swapaxes(x.reshape(B, chunks, c, D), 0, 1).reshape(chunks, S, B * c // S, D)
    ts = jnp.swapaxes(targets.reshape(B, chunks, c), 0, 1).reshape(chunks, S, B * c // S)
    xs = sharding.constrain(xs, (None, "batch", None, None))
    ts = sharding.constrain(ts, (None, "batch", None))

    def shard_chunk(state, xc, tc):
        logits, pull_back = jax.vjp(chunk_logits, state, xc)  # [R, V]
        top = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
        # Exponentials once, kept: the compiler would otherwise compute them twice, for the
        # normaliser and for the softmax, and exp is the costliest elementwise op here.
        e = jax.lax.optimization_barrier(jnp.exp(logits - top))  # [R, V]
        total = jnp.sum(e, axis=-1, keepdims=True)  # [R, 1]
        target_logit = jnp.take_along_axis(logits, tc[:, None], axis=-1)  # [R, 1]
        loss = jnp.sum(top + jnp.log(total) - target_logit)
        d_logits = e / total - jax.nn.one_hot(tc, logits.shape[-1])
        d_state, d_xc = pull_back(d_logits)
        return loss, d_state, d_xc

    def one_chunk(carry, inputs):
        loss_s, d_state_s, d_xc = jax.vmap(shard_chunk, in_axes=(None, 0, 0))(state, *inputs)
        return jax.tree.map(jnp.add, carry, (loss_s, d_state_s)), d_xc

    def per_shard_zeros(var):
        axes = var.get_metadata().get("out_sharding") or (None,) * var.ndim
        zeros = jnp.zeros((S, *var.shape), var.dtype)
        return var.replace(sharding.constrain(zeros, ("batch", *axes)))

    zeros = jax.tree.map(per_shard_zeros, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    losses = sharding.constrain(jnp.zeros((S,), jnp.float32), ("batch",))
    (loss, d_state), d_xs = jax.lax.scan(one_chunk, (losses, zeros), (xs, ts))
    loss, d_state = jax.tree.map(lambda d: jnp.sum(d, axis=0), (loss, d_state))
    d_x = jnp.swapaxes(d_xs.reshape(chunks, B, c, D), 0, 1).reshape(B, T, D)
    count = B * T
    return loss / count, (d_state, d_x, count)


def _fused_ce_bwd(chunk_logits, chunks, shards, residuals, g):
    d_state, d_x, count = residuals
    scale = g / count
    return (jax.tree.map(lambda d: d * scale, d_state), (d_x * scale).astype(d_x.dtype), None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def loss_fn(model: DecoderLM, batch: dict[str, jax.Array],
            dropout_key: jax.Array | None = None) -> jax.Array:
    x = model.features(batch["inputs"], dropout_key=dropout_key)  # [B, T, D]
    return fused_cross_entropy(model, x, batch["targets"])


def _split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so that each device keeps its own rows
    of every microbatch when the batch dimension is sharded (no data moves between devices)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def _loss_and_grads(model: DecoderLM, batch, key, microbatches: int):
    if microbatches == 1:
        return nnx.value_and_grad(loss_fn)(model, batch, key)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_loss(params, micro, micro_key):
        return loss_fn(nnx.merge(graphdef, params, rest), micro, micro_key)

    def accumulate(carry, xs):
        micro, index = xs
        micro_key = None if key is None else jax.random.fold_in(key, index)
        loss, grads = jax.value_and_grad(micro_loss)(params, micro, micro_key)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    micros = jax.tree.map(lambda x: _split_microbatches(x, microbatches), batch)
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, (micros, jnp.arange(microbatches)))
    return jax.tree.map(lambda x: x / microbatches, (loss, grads))


@functools.partial(nnx.jit, static_argnames=("microbatches", "schedule"),
                   donate_argnames=("model", "optimizer"))
def train_step(model: DecoderLM, optimizer: nnx.Optimizer, batch: dict[str, jax.Array],
               rng: jax.Array, *, microbatches: int = 1,
               schedule: optax.Schedule | None = None) -> dict[str, jax.Array]:
    """One optimizer step on a global batch, accumulated over `microbatches` inside the step."""
    step = optimizer.step[...]
    key = jax.random.fold_in(rng, step) if model.config.dropout > 0 else None
    loss, grads = _loss_and_grads(model, batch, key, microbatches)
    optimizer.update(model, grads)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    if schedule is not None:
        metrics["lr"] = schedule(step)
    return metrics


@nnx.jit
def eval_step(model: DecoderLM, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean loss on a batch, without dropout."""
    return loss_fn(model, batch)
