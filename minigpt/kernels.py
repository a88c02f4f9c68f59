"""Kernels: the few operations whose fastest form depends on the backend, each beside a plain one.

Five operations of a train step are written twice. `ReferenceKernels` is the plain form a reader
recognises (`jax.nn`, `optax`, autodiff does the rest) and what accelerators run. `CpuKernels`
is tuned for XLA's CPU backend, where profiles of the step showed costs plain code pays:

- row sums (every bias and norm-scale gradient) run about 100x slower than the equivalent
  product with a vector of ones, so those gradients are written out as such products;
- full causal attention materialises [B, N, T, T] scores; attending block by block skips the
  blocks above the diagonal and keeps each block's scores in cache (2-3x faster), and its
  written-out backward pass avoids the softmax's long row sums;
- SwiGLU's gated layer, left to autodiff, wrote its hidden gradient transposed for the weight
  gradients, a strided copy dearer than the matmuls at a small width;
- the cross-entropy over a 50k vocabulary dominates a small model's step; a fused, chunked pass
  never stores the [B, T, V] logits and forms each chunk's gradient while its logits are at hand
  (chunks sized by the vocabulary); with a small vocabulary it keeps those gradients and pulls
  them back through the head in whole-batch products, which XLA runs on every core.

`ModelConfig.kernels` chooses: "reference", "cpu", or "auto" (the default: "cpu" on the CPU
backend, "reference" elsewhere). A model puts its choice in the context its code runs in
(`minigpt.sharding.running`) and its layers ask `active()`. This module is the only place in
minigpt that asks which backend is running. Both forms compute the same function; the tests
compare losses and every gradient of the two on each architecture, so the accelerator path is
checked on a CPU too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt import sharding


def resolve(choice: str) -> str:
    """The kernels "auto" means here: "cpu" on the CPU backend, "reference" elsewhere."""
    if choice == "auto":
        return "cpu" if jax.default_backend() == "cpu" else "reference"
    return choice


def get(choice: str) -> ReferenceKernels:
    """The kernel set for a `ModelConfig.kernels` value ("auto", "reference" or "cpu")."""
    return _KERNELS[resolve(choice)]


def placeholders(state):
    """A function making scalar stand-ins for a state's arrays (of the same dtypes), to rebuild
    a module around code that never reads that state: the output head without the block stack.
    Made inside each trace that needs them, so no traced value is closed over."""
    dtypes = jax.tree.map(lambda a: a.dtype, state)
    return lambda: jax.tree.map(lambda dtype: jnp.zeros((), dtype), dtypes)


def active() -> ReferenceKernels:
    """The kernel set the running model chose (outside any model: "auto")."""
    return get(sharding.active().kernels)


class ReferenceKernels:
    """Plain JAX: what a reader expects, and what accelerators run."""

    name = "reference"

    def normalize(self, x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float,
                  center: bool) -> jax.Array:
        """LayerNorm (center=True) or RMSNorm (center=False) over the last axis, in float32."""
        x32 = x.astype(jnp.float32)
        if center:
            x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale
        return (y if bias is None else y + bias).astype(x.dtype)

    def add_bias(self, y: jax.Array, bias: jax.Array) -> jax.Array:
        """y + bias, broadcasting bias [F] over y [..., F]."""
        return y + bias

    def causal_attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Causal self-attention: q [B, T, N, H], k and v [B, T, K, H], N a multiple of K.

        `jax.nn.dot_product_attention` picks a fused kernel (cuDNN flash attention, ...) where
        the backend has one.
        """
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def gated_activation(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
        """SwiGLU's hidden layer: silu(x @ w_gate) * (x @ w_up), x [B, T, D], w [D, F]."""
        return jax.nn.silu(_project(x, w_gate)) * _project(x, w_up)

    def cross_entropy(self, model: nnx.Module, x: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of `model.logits` on features x [B, T, D]."""
        return cross_entropy(model.logits(x), targets)


def _project(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("btd,df->btf", x, w)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy; logits [B, T, V] float32 (padding at -inf), targets [B, T] int:
    log-sum-exp of a row minus its target's logit."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits(logits, targets))


def target_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits[..., targets] as a masked sum over the vocabulary rather than a gather: XLA
    partitions the sum wherever the vocabulary is split, and it crashes partitioning the gather
    inside a pipeline stage that splits it over two other mesh axes (a 3-D preset)."""
    hit = jnp.arange(logits.shape[-1]) == targets[..., None]
    return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


class CpuKernels(ReferenceKernels):
    """The same functions, shaped for XLA's CPU backend (see the module docstring)."""

    name = "cpu"

    def normalize(self, x, scale, bias, eps, center):
        return _normalize(x, scale, bias, eps, center)

    def add_bias(self, y, bias):
        return _add_bias(y, bias)

    def causal_attention(self, q, k, v):
        T = q.shape[1]
        if T % ATTENTION_BLOCK or T == ATTENTION_BLOCK:
            return super().causal_attention(q, k, v)
        return _blocked_causal_attention(q, k, v)

    def gated_activation(self, x, w_gate, w_up):
        return _gated_activation(x, w_gate, w_up)

    def cross_entropy(self, model, x, targets):
        return fused_cross_entropy(model, x, targets)


# Row sums as products -----------------------------------------------------------------------


def _sum_rows(x: jax.Array) -> jax.Array:
    """Sum x [..., F] over every leading axis, as a matrix-vector product with ones.

    Inside a pipeline stage (a `shard_map` region, where the value varies over the stage axis)
    a plain sum instead: there XLA partitions that product into collectives that deadlock
    when the rows and the features are split over two other mesh axes (`fsdp_pp_tp`)."""
    if jax.typeof(x).manual_axis_type.varying:
        return jnp.sum(x.reshape(-1, x.shape[-1]).astype(jnp.float32), axis=0)
    rows = x.reshape(-1, x.shape[-1])  # [R, F]
    ones = jnp.ones((rows.shape[0],), rows.dtype)
    return jnp.dot(ones, rows, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normalize(x, scale, bias, eps, center):
    """ReferenceKernels.normalize with the backward pass written out: it materialises the
    incoming gradient once and sums the parameter gradients with `_sum_rows`. Left to autodiff,
    XLA's CPU backend fused the elementwise backward chain of every later layer into each of
    these sums and recomputed it, a cost that grew with depth."""
    return _normalize_fwd(x, scale, bias, eps, center)[0]


def _normalize_fwd(x, scale, bias, eps, center):
    x32 = x.astype(jnp.float32)
    if center:
        x32 = x32 - x32.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)  # [..., 1]
    normed = x32 * rstd
    y = normed * scale if bias is None else normed * scale + bias
    return y.astype(x.dtype), (normed, rstd, scale, bias, jnp.zeros((), x.dtype))


def _normalize_bwd(eps, center, residuals, g):
    normed, rstd, scale, bias, like_x = residuals  # like_x: a scalar of x's dtype
    g = jax.lax.optimization_barrier(g.astype(jnp.float32))
    d_scale = _sum_rows(g * normed).astype(scale.dtype)
    d_bias = None if bias is None else _sum_rows(g).astype(bias.dtype)
    g_normed = g * scale
    d_x = g_normed - normed * jnp.mean(g_normed * normed, axis=-1, keepdims=True)
    if center:
        d_x = d_x - jnp.mean(g_normed, axis=-1, keepdims=True)
    return (d_x * rstd).astype(like_x.dtype), d_scale, d_bias


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


@jax.custom_vjp
def _add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    return y + bias


def _add_bias_fwd(y, bias):
    return y + bias, bias


def _add_bias_bwd(bias, g):
    g = jax.lax.optimization_barrier(g)  # as in _normalize_bwd
    return g, _sum_rows(g).astype(bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


# Blocked causal attention -------------------------------------------------------------------

# Query block length: score blocks of [64, <=T] stay in cache.
ATTENTION_BLOCK = 64


@jax.custom_vjp
def _blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention one block of 64 queries at a time, each against the keys up to its end,
    with the backward pass written out. Left to autodiff, the softmax's backward summed
    dP * P over every key of every block, which profiles showed costing more than the
    attention's matmuls at T = 256; the written-out form takes that sum as dO . O over the
    head's features instead (as flash attention does), a sum H long instead of T."""
    return _blocked_attention_fwd(q, k, v)[0]


def _query_blocks(T: int) -> list[tuple[int, int]]:
    return [(start, min(start + ATTENTION_BLOCK, T)) for start in range(0, T, ATTENTION_BLOCK)]


def _blocked_attention_fwd(q, k, v):
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4) * (H ** -0.5)  # [B, K, G, T, H]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    blocks, probs = [], []
    for start, end in _query_blocks(T):
        scores = jnp.einsum("bkgth,bksh->bkgts", q[:, :, :, start:end], k[:, :, :end])
        visible = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]  # [t, s]
        scores = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
        probs.append(jax.nn.softmax(scores, axis=-1).astype(v.dtype))
        blocks.append(jnp.einsum("bkgts,bksh->bkgth", probs[-1], v[:, :, :end]))
    out = jnp.concatenate(blocks, axis=3)  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H), (q, k, v, out, probs)


def _blocked_attention_bwd(residuals, g):
    q, k, v, out, probs = residuals  # q scaled, [B, K, G, T, H]; k, v [B, K, S, H]
    B, K, G, T, H = q.shape
    g = g.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    # d(scores) = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O).
    row = jnp.sum(g.astype(jnp.float32) * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    d_q, d_k, d_v = [], jnp.zeros_like(k), jnp.zeros_like(v)
    for (start, end), p in zip(_query_blocks(T), probs):
        g_block = g[:, :, :, start:end]
        d_p = jnp.einsum("bkgth,bksh->bkgts", g_block, v[:, :, :end])
        d_s = (p * (d_p - row[:, :, :, start:end])).astype(q.dtype)
        d_q.append(jnp.einsum("bkgts,bksh->bkgth", d_s, k[:, :, :end]))
        d_k = d_k.at[:, :, :end].add(jnp.einsum("bkgts,bkgth->bksh", d_s, q[:, :, :, start:end]))
        d_v = d_v.at[:, :, :end].add(jnp.einsum("bkgts,bkgth->bksh", p, g_block))
    d_q = (jnp.concatenate(d_q, axis=3) * (H ** -0.5)).transpose(0, 3, 1, 2, 4)
    return d_q.reshape(B, T, K * G, H), d_k.transpose(0, 2, 1, 3), d_v.transpose(0, 2, 1, 3)


_blocked_causal_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


# SwiGLU's gated hidden layer ----------------------------------------------------------------


@jax.custom_vjp
def _gated_activation(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """ReferenceKernels.gated_activation with the backward pass written out. Left to autodiff,
    XLA's CPU backend fused the silu's backward into a copy writing the hidden gradient
    transposed, for the weight gradient's matmul, and that strided copy cost more than the
    matmul (profile at width 128, F = 384); here the weight gradients are x^T-times products
    of row-major gradients."""
    return _gated_activation_fwd(x, w_gate, w_up)[0]


def _gated_activation_fwd(x, w_gate, w_up):
    gate, up = _project(x, w_gate), _project(x, w_up)
    return jax.nn.silu(gate) * up, (x, w_gate, w_up, gate, up)


def _gated_activation_bwd(residuals, g):
    x, w_gate, w_up, gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    d_up = g * gate * sig  # d/d up of silu(gate) * up
    d_gate = g * up * sig * (1 + gate * (1 - sig))  # silu'(z) = s(z) (1 + z (1 - s(z)))
    rows = x.reshape(-1, x.shape[-1]).T  # [D, R]
    d_w_gate = jnp.dot(rows, d_gate.reshape(-1, d_gate.shape[-1])).astype(w_gate.dtype)
    d_w_up = jnp.dot(rows, d_up.reshape(-1, d_up.shape[-1])).astype(w_up.dtype)
    d_x = (jnp.einsum("btf,df->btd", d_gate, w_gate)
           + jnp.einsum("btf,df->btd", d_up, w_up)).astype(x.dtype)
    return d_x, d_w_gate, d_w_up


_gated_activation.defvjp(_gated_activation_fwd, _gated_activation_bwd)


# Fused, chunked cross-entropy ---------------------------------------------------------------

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


def fused_cross_entropy(model: nnx.Module, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of the model's output head applied to features x [B, T, D].

    Equal to cross_entropy(model.logits(x), targets), but never holds the [B, T, V] logits:
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
    return _fused_ce(chunk_logits, T // _chunk_len(B, T, vocab), sharding.active_ways("batch"),
                     hoist, state, x, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused_ce(chunk_logits, chunks, shards, hoist, state, x, targets):
    return _fused_ce_fwd(chunk_logits, chunks, shards, hoist, state, x, targets)[0]


def _loss_and_d_logits(logits, targets):
    """Summed cross-entropy of rows of logits [R, V] and its gradient, softmax minus one-hot."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # [R, 1]
    # Exponentials once, kept: the compiler would otherwise compute them twice, for the
    # normaliser and for the softmax, and exp is the costliest elementwise op here.
    e = jax.lax.optimization_barrier(jnp.exp(logits - top))  # [R, V]
    total = jnp.sum(e, axis=-1, keepdims=True)  # [R, 1]
    loss = jnp.sum(top + jnp.log(total) - target_logits(logits, targets)[:, None])
    return loss, e / total - jax.nn.one_hot(targets, logits.shape[-1])


def _fused_ce_fwd(chunk_logits, chunks, shards, hoist, state, x, targets):
    B, T, D = x.shape
    c, S = T // chunks, shards
    # [n, S, B*c/S, D]: each chunk flattened to rows (so the head's matmuls are plain 2-D) and
    # grouped by batch shard S. Each shard accumulates its own partial parameter gradient in
    # the loop; they are summed once at the end, instead of one all-reduce per chunk.
    xs = jnp.swapaxes(x.reshape(B, chunks, c, D), 0, 1).reshape(chunks, S, B * c // S, D)
    ts = jnp.swapaxes(targets.reshape(B, chunks, c), 0, 1).reshape(chunks, S, B * c // S)
    xs = sharding.constrain(xs, (None, "batch", None, None))
    ts = sharding.constrain(ts, (None, "batch", None))
    losses = sharding.constrain(jnp.zeros((S,), jnp.float32), ("batch",))

    if hoist:
        def one_chunk(losses, inputs):
            loss_s, d_logits = jax.vmap(lambda xc, tc: _loss_and_d_logits(
                chunk_logits(state, xc), tc))(*inputs)
            return losses + loss_s, d_logits

        carry = sharding.varying_as(losses, state, x)
        loss, d_logits = jax.lax.scan(one_chunk, carry, (xs, ts))  # d_logits [n, S, R, V]
        def every_chunk(state, xs):
            return jax.vmap(jax.vmap(lambda xc: chunk_logits(state, xc)))(xs)

        d_state, d_xs = jax.vjp(every_chunk, state, xs)[1](d_logits)
        loss = jnp.sum(loss)
    else:
        def shard_chunk(state, xc, tc):
            logits, pull_back = jax.vjp(chunk_logits, state, xc)  # [R, V]
            loss, d_logits = _loss_and_d_logits(logits, tc)
            return loss, *pull_back(d_logits)

        def one_chunk(carry, inputs):
            loss_s, d_state_s, d_xc = jax.vmap(shard_chunk, in_axes=(None, 0, 0))(state, *inputs)
            return jax.tree.map(jnp.add, carry, (loss_s, d_state_s)), d_xc

        def per_shard_zeros(var):
            axes = var.get_metadata().get("out_sharding") or (None,) * var.ndim
            zeros = jnp.zeros((S, *var.shape), var.dtype)
            return var.replace(sharding.constrain(zeros, ("batch", *axes)))

        zeros = jax.tree.map(per_shard_zeros, state,
                             is_leaf=lambda v: isinstance(v, nnx.Variable))
        # Inside a pipeline stage (shard_map) the sums vary from stage to stage as their terms do.
        carry = sharding.varying_as((losses, zeros), state, x)
        (loss, d_state), d_xs = jax.lax.scan(one_chunk, carry, (xs, ts))
        loss, d_state = jax.tree.map(lambda d: jnp.sum(d, axis=0), (loss, d_state))
    d_x = jnp.swapaxes(d_xs.reshape(chunks, B, c, D), 0, 1).reshape(B, T, D)
    count = B * T
    return loss / count, (d_state, d_x, count)


def _fused_ce_bwd(chunk_logits, chunks, shards, hoist, residuals, g):
    d_state, d_x, count = residuals
    scale = g / count
    return (jax.tree.map(lambda d: d * scale, d_state), (d_x * scale).astype(d_x.dtype), None)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)

_KERNELS: dict[str, ReferenceKernels] = {"reference": ReferenceKernels(), "cpu": CpuKernels()}
