"""The next-token loss: plain cross-entropy over logits, and a fused, chunked form of it.

The fused form is what `minigpt.models.kernels.CpuKernels` runs. The cross-entropy over a 50k
vocabulary dominates a small model's step; the fused pass never stores the [B, T, V] logits and
forms each chunk's gradient while its logits are at hand (chunks sized by the vocabulary). With
a small vocabulary it keeps those gradients and pulls them back through the head in whole-batch
products, which XLA runs on every core. The tests compare its loss and gradients with the plain
form's on each architecture and preset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt import sharding


def cross_entropy(logits: jax.Array, targets: jax.Array,
                  weights: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy; logits [B, T, V] float32 (padding at -inf), targets [B, T] int:
    log-sum-exp of a row minus its target's logit, each position's term times its weight
    [B, T] where given (`minigpt.models.inputs.loss_batch`)."""
    nats = jax.nn.logsumexp(logits, axis=-1) - target_logits(logits, targets)
    return jnp.mean(nats if weights is None else nats * weights)


def target_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits[..., targets] as a masked sum over the vocabulary rather than a gather: XLA
    partitions the sum wherever the vocabulary is split, and it crashes partitioning the gather
    inside a pipeline stage that splits it over two other mesh axes (a 3-D preset)."""
    hit = jnp.arange(logits.shape[-1]) == targets[..., None]
    return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def placeholders(state):
    """A function making scalar stand-ins for a state's arrays (of the same dtypes), to rebuild
    a module around code that never reads that state: the output head without the block stack.
    Made inside each trace that needs them, so no traced value is closed over."""
    dtypes = jax.tree.map(lambda a: a.dtype, state)
    return lambda: jax.tree.map(lambda dtype: jnp.zeros((), dtype), dtypes)


# Tokens per chunk of the fused loss, by vocabulary (measured, bench/RESULTS.md): for GPT-2's
# 50k, [512, V] float32 logits (about 100 MB) are cheap to revisit and make efficient matmuls;
# for a small vocabulary (TinyStories' 4,096) chunks of 128 tokens, whose 2 MB of logits stay in
# cache, made the step 7% faster than 512.
LOSS_CHUNK_TOKENS = 512
SMALL_VOCAB, SMALL_VOCAB_CHUNK_TOKENS = 8192, 128
# With a small vocabulary the chunks' logit gradients are kept, up to this many (256 MB of
# float32), and pulled back through the head in two whole-batch products after the loop: the
# per-chunk product for the features' gradient, [128, V] x [V, D], ran on one core at half the
# rate of the whole-batch one (bench/RESULTS.md, 2026-11-24).
HOISTED_LOGITS = 1 << 26


def _chunk_len(batch: int, seq: int, vocab: int) -> int:
    """The longest sequence chunk c dividing seq with batch * c at most the vocabulary's
    chunk size (>= 1)."""
    most = SMALL_VOCAB_CHUNK_TOKENS if vocab <= SMALL_VOCAB else LOSS_CHUNK_TOKENS
    return max([c for c in range(1, seq + 1) if seq % c == 0 and batch * c <= most] or [1])


def fused_cross_entropy(model: nnx.Module, x: jax.Array, targets: jax.Array,
                        weights: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of the model's output head applied to features x [B, T, D], each
    position's term times its weight [B, T] where given.

    Equal to cross_entropy(model.logits(x), targets, weights), but never holds the [B, T, V]
    logits:
    the head runs chunk by chunk along the sequence, and each chunk's gradient (softmax minus
    the one-hot target) is formed while its logits are at hand. That is three matmuls per
    chunk, as plain autodiff needs, and two passes over the logits instead of about six. Chunks
    split the sequence, not the batch, so batch sharding holds. With a small vocabulary the
    logit gradients are kept and the two pull-back matmuls run once over the whole batch.
    """
    # Only the parameters the head uses go through the loss; the block stack, which it never
    # touches, is left out (no zero gradients for it to carry through the loop).
    graphdef, blocks, state = nnx.split(model, nnx.PathContains("blocks"), ...)
    stand_in = placeholders(blocks)

    def chunk_logits(state, xc):
        return nnx.merge(graphdef, stand_in(), state).logits(xc)  # [R, V]

    B, T, _ = x.shape
    vocab = model.config.padded_vocab
    hoist = vocab <= SMALL_VOCAB and B * T * vocab <= HOISTED_LOGITS
    # Each device's rows: its share of the batch and, where the sequence is split (context
    # parallelism), of the positions; chunks of B Ss c tokens in all, as B c without the split.
    shards = (sharding.active_ways("batch"), sharding.active_ways("seq"))
    if T % shards[1] or B % shards[0]:
        shards = (shards[0], 1)
    c = _chunk_len(B * shards[1], T // shards[1], vocab)
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    return _fused_ce(chunk_logits, T // shards[1] // c, shards, hoist, state, x, targets,
                     weights.astype(jnp.float32))


# The loss's rows are split over the devices that split the batch and those that split the
# sequence: (batch shard, sequence shard) pairs, in the mesh's order.
ROWS = ("batch", "seq")


def _rows(x: jax.Array, shards: tuple[int, int], chunks: int) -> jax.Array:
    """[B, T, ...] as [n, S, R, ...]: n chunks, each of c positions from each of the Ss pieces
    the sequence is split into, its rows grouped by the S = Sb Ss devices holding them."""
    (Sb, Ss), (B, T), rest = shards, x.shape[:2], x.shape[2:]
    x = jnp.moveaxis(x.reshape(B, Ss, chunks, T // (Ss * chunks), *rest), 2, 0)  # [n,B,Ss,c]
    if Ss > 1:  # by batch shard, then by sequence shard
        x = jnp.swapaxes(x.reshape(chunks, Sb, B // Sb, *x.shape[2:]), 2, 3)
    return x.reshape(chunks, Sb * Ss, -1, *rest)


def _unrows(xs: jax.Array, B: int, shards: tuple[int, int]) -> jax.Array:
    """The inverse of `_rows`: [n, S, R, ...] -> [B, T, ...]."""
    (Sb, Ss), n, rest = shards, xs.shape[0], xs.shape[3:]
    c = xs.shape[1] * xs.shape[2] // (B * Ss)
    if Ss > 1:
        xs = jnp.swapaxes(xs.reshape(n, Sb, Ss, B // Sb, c, *rest), 2, 3)
    x = jnp.moveaxis(xs.reshape(n, B, Ss, c, *rest), 0, 2)  # [B, Ss, n, c, ...]
    return x.reshape(B, Ss * n * c, *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused_ce(chunk_logits, chunks, shards, hoist, state, x, targets, weights):
    return _fused_ce_fwd(chunk_logits, chunks, shards, hoist, state, x, targets, weights)[0]


def _loss_and_d_logits(logits, targets, weights):
    """Weighted, summed cross-entropy of rows of logits [R, V] (weights [R]) and its gradient,
    (softmax minus one-hot) times each row's weight."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
    # Exponentials once, kept: the compiler would otherwise compute them twice, for the
    # normaliser and for the softmax, and exp is the costliest elementwise op here.
    e = jax.lax.optimization_barrier(jnp.exp(logits - top))  # [R, V]
    total = jnp.sum(e, axis=-1, keepdims=True)  # [R, 1]
    w = weights[:, None]  # [R, 1]: folded into the factors the rows are scaled by anyway
    loss = jnp.sum(w * (top + jnp.log(total) - target_logits(logits, targets)[:, None]))
    hit = jnp.arange(logits.shape[-1]) == targets[:, None]
    return loss, e * (w / total) - jnp.where(hit, w, 0.0)


def _fused_ce_fwd(chunk_logits, chunks, shards, hoist, state, x, targets, weights):
    B, T, D = x.shape
    S = shards[0] * shards[1]
    # [n, S, R, D]: each chunk flattened to rows (so the head's matmuls are plain 2-D) and
    # grouped by the S devices holding them (`_rows`). Each shard accumulates its own partial
    # parameter gradient in the loop; they are summed once at the end, instead of one
    # all-reduce per chunk.
    xs = sharding.constrain(_rows(x, shards, chunks), (None, ROWS, None, None))
    ts = sharding.constrain(_rows(targets, shards, chunks), (None, ROWS, None))
    ws = sharding.constrain(_rows(weights, shards, chunks), (None, ROWS, None))
    losses = sharding.constrain(jnp.zeros((S,), jnp.float32), (ROWS,))

    if hoist:
        def one_chunk(losses, inputs):
            loss_s, d_logits = jax.vmap(lambda xc, tc, wc: _loss_and_d_logits(
                chunk_logits(state, xc), tc, wc))(*inputs)
            return losses + loss_s, d_logits

        carry = sharding.varying_as(losses, state, x)
        loss, d_logits = jax.lax.scan(one_chunk, carry, (xs, ts, ws))  # d_logits [n,S,R,V]
        def every_chunk(state, xs):
            return jax.vmap(jax.vmap(lambda xc: chunk_logits(state, xc)))(xs)

        d_state, d_xs = jax.vjp(every_chunk, state, xs)[1](d_logits)
        loss = jnp.sum(loss)
    else:
        def shard_chunk(state, xc, tc, wc):
            logits, pull_back = jax.vjp(chunk_logits, state, xc)  # [R, V]
            loss, d_logits = _loss_and_d_logits(logits, tc, wc)
            return loss, *pull_back(d_logits)

        def one_chunk(carry, inputs):
            loss_s, d_state_s, d_xc = jax.vmap(shard_chunk, in_axes=(None, 0, 0, 0))(state,
                                                                                    *inputs)
            return jax.tree.map(jnp.add, carry, (loss_s, d_state_s)), d_xc

        def per_shard_zeros(var):
            axes = var.get_metadata().get("out_sharding") or (None,) * var.ndim
            zeros = jnp.zeros((S, *var.shape), var.dtype)
            return var.replace(sharding.constrain(zeros, (ROWS, *axes)))

        zeros = jax.tree.map(per_shard_zeros, state,
                             is_leaf=lambda v: isinstance(v, nnx.Variable))
        # Inside a pipeline stage (shard_map) the sums vary from stage to stage as their terms do.
        carry = sharding.varying_as((losses, zeros), state, x)
        (loss, d_state), d_xs = jax.lax.scan(one_chunk, carry, (xs, ts, ws))
        loss, d_state = jax.tree.map(lambda d: jnp.sum(d, axis=0), (loss, d_state))
    d_x = _unrows(d_xs, B, shards)
    count = B * T
    return loss / count, (d_state, d_x, count)


def _fused_ce_bwd(chunk_logits, chunks, shards, hoist, residuals, g):
    d_state, d_x, count = residuals
    scale = g / count
    return (jax.tree.map(lambda d: d * scale, d_state), (d_x * scale).astype(d_x.dtype), None,
            None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)
