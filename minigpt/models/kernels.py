"""Kernels: the few operations whose fastest form depends on the backend, each beside a plain one.

Six operations of a train step are written twice. `ReferenceKernels` is the plain form a reader
recognises (`jax.nn`, `optax`, autodiff does the rest) and what accelerators run. `CpuKernels`
is tuned for XLA's CPU backend, where profiles of the step showed costs plain code pays: row
sums (bias and norm-scale gradients) ran 100x slower than products with a vector of ones, so
they are such products; full causal attention materialised [B, N, T, T] scores, where attending
a block of queries at a time skips the blocks above the diagonal and stays in cache (2-3x), with
a written-out backward pass free of the softmax's long row sums; SwiGLU's gated layer, left to
autodiff, wrote its hidden gradient transposed, a strided copy dearer than its matmuls; the
cross-entropy over a 50k vocabulary dominated a small model's step, so a fused, chunked pass
(`minigpt.models.loss.fused_cross_entropy`) never stores the [B, T, V] logits; and XLA ran a
mixture of experts' `jax.lax.ragged_dot` as every row times every expert (E times the work),
where blocks of one expert's rows (`minigpt.models.grouped`) cost what the routed rows need.

On accelerators attention is the one operation worth a kernel of its own: `FusedKernels` are
the plain forms with attention (training's, and prompts run into the cache) through the flash
kernels JAX ships (`minigpt.models.attention`): cuDNN's on NVIDIA GPUs ("cudnn"), Splash on
TPUs ("splash"). Where a kernel refuses a call (float32 on cuDNN, a sequence that does not cut
into Splash's blocks, another backend) XLA's attention runs, the reason said once (`FALLBACKS`).

`ModelConfig.kernels` chooses ("auto": "cpu" on the CPU backend, "cudnn" on GPUs, "splash" on
TPUs, "reference" elsewhere), a model puts its choice in the context its code runs in
(`minigpt.sharding.running`) and its layers ask `active()`; `ModelConfig.dtype` says what they
compute in (`minigpt.models.execution`: on a CPU, bfloat16 means bfloat16 operands accumulated
in float32, `matmul`). Every set computes the same function; the tests compare losses and
every gradient on each architecture, the accelerator paths on a CPU too (the fused ones
through their fallback, Splash in Pallas' interpreter).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

import minigpt.models.attention as attention
import minigpt.models.execution as execution
from minigpt import sharding
from minigpt.models.execution import compute_dtype, kernel_set, operand_dtype
from minigpt.models.grouped import blocked_expert_ffn
from minigpt.models.loss import cross_entropy, fused_cross_entropy
from minigpt.models.masks import AttentionInputs

# Which backend each fused kernel runs on.
FUSED_BACKENDS = {"cudnn": "gpu", "splash": "tpu"}
# Each fallback said so far, "<kernel>: <reason>": said once, kept for reports.
FALLBACKS: list[str] = []


def get(choice: str) -> ReferenceKernels:
    """The kernel set for a `ModelConfig.kernels` value (minigpt.config.KERNELS; "auto" as
    `minigpt.models.execution` resolves it here)."""
    return _KERNELS[kernel_set(choice)]


def describe(kernels: str, dtype: str) -> str:
    """What a model with these settings runs here: "kernels cudnn (auto: ...), computing in
    bfloat16 (auto)"."""
    name, computes = kernel_set(kernels), compute_dtype(dtype)
    products = operand_dtype(dtype)
    how = computes if products == computes else (
        f"{computes} with {products} products (their operands; float32 accumulation)")
    return (f"kernels {name} ({'auto: ' if kernels == 'auto' else ''}{_KERNELS[name].about}), "
            f"computing in {how}{' (auto)' if dtype == 'auto' else ''}")


def active() -> ReferenceKernels:
    """The kernel set the running model chose (outside any model: "auto")."""
    return get(sharding.active().kernels)


class ReferenceKernels:
    """Plain JAX: what a reader expects, and what accelerators run but for attention."""

    name = "reference"
    about = "plain JAX, XLA's attention"

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

    def causal_attention(self, q: jax.Array, k: jax.Array, v: jax.Array,
                         attn: AttentionInputs | None = None) -> jax.Array:
        """Causal self-attention: q [B, T, N, H], k and v [B, T, K, H], N a multiple of K;
        as `attn` says, each query sees its own document's keys only (its `segment_ids`) and
        those within its window."""
        mask = None if attn is None else attn.mask()
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    def cached_attention(self, q: jax.Array, k: jax.Array, v: jax.Array,
                         mask: jax.Array) -> jax.Array:
        """Attention of q [B, T, N, H] to a key/value cache [B, K, S, H] where the mask
        [B, 1, T, S] allows. The cache lies by KV head so both products read it as it lies
        (laid out [B, S, K, H], it was copied whole at every layer of every decode step)."""
        B, T, N, H = q.shape
        q = q.reshape(B, T, k.shape[1], N // k.shape[1], H) * jnp.asarray(H ** -0.5, q.dtype)
        scores = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, :, None], scores, -jnp.inf)  # [B, K, G, T, S]
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bksh->bkgth", probs, v)
        return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)

    def gated_activation(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
        """SwiGLU's hidden layer: silu(x @ w_gate) * (x @ w_up), x [B, T, D], w [D, F]."""
        ops = sharding.active().operands
        return jax.nn.silu(_project(x, w_gate, ops)) * _project(x, w_up, ops)

    def cross_entropy(self, model: nnx.Module, x: jax.Array, targets: jax.Array,
                      weights: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy of `model.logits` on features x [B, T, D], each
        position's term times its weight [B, T] where given."""
        return cross_entropy(model.logits(x), targets, weights)

    def expert_ffn(self, x: jax.Array, group_sizes: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        """The experts' SwiGLU on rows sorted by expert: x [M, D], expert g taking the next
        group_sizes[g] rows (rows past them all give zeros), w_gate and w_up [G, D, F], w_down
        [G, F, D]. Grouped products (`jax.lax.ragged_dot`), which accelerators run as such."""
        gate = jax.lax.ragged_dot(x, w_gate, group_sizes)  # [M, F]
        up = jax.lax.ragged_dot(x, w_up, group_sizes)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [M, D]


def _project(x: jax.Array, w: jax.Array, operands: str) -> jax.Array:
    return matmul("btd,df->btf", x, w, operands)


def matmul(spec: str, a: jax.Array, b: jax.Array, operands: str) -> jax.Array:
    """`jnp.einsum(spec, a, b)`, float32 operands cast to bfloat16 and accumulated in float32
    where the products take bfloat16 (`operands`: the context's when the forward is traced;
    a backward pass is traced after the model's context has gone)."""
    if operands == "bfloat16" and a.dtype == b.dtype == jnp.float32:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b)


class FusedKernels(ReferenceKernels):
    """The plain forms, with attention through the fused kernel `kernel` ("cudnn" or "splash")
    where it takes the call. The cached decode is XLA's on Splash (its per-row masks have no
    block structure to skip), and a decode step (one query a row) is XLA's on either."""

    def __init__(self, kernel: str, about: str):
        self.name = self.kernel = kernel
        self.about = about

    def causal_attention(self, q, k, v, attn=None):
        try:
            self._check_backend()
            if self.kernel == "splash":
                return attention.splash(q, k, v, attn,
                                        interpret=sharding.active().splash_interpret)
            return attention.cudnn(q, k, v, mask=None if attn is None else attn.mask())
        except attention.Refused as refusal:
            self._fall_back(str(refusal))
            return super().causal_attention(q, k, v, attn)

    def cached_attention(self, q, k, v, mask):
        # A decode step (one query a row) reads the cache as it lies; a prompt run into the
        # cache hands cuDNN its [B, S, K, H] layout.
        if self.kernel == "cudnn" and q.shape[1] > 1:
            try:
                self._check_backend()
                return attention.cudnn(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask=mask,
                                       causal=False)
            except attention.Refused as refusal:
                self._fall_back(str(refusal))
        return super().cached_attention(q, k, v, mask)

    def _check_backend(self) -> None:
        backend, needed = execution.backend(), FUSED_BACKENDS[self.kernel]
        interpreted = self.kernel == "splash" and sharding.active().splash_interpret
        if backend != needed and not interpreted:
            raise attention.Refused(f"it runs on the {needed} backend, and this one is {backend}")

    def _fall_back(self, reason: str) -> None:
        said = f"{self.kernel}: {reason}"
        if said not in FALLBACKS:
            FALLBACKS.append(said)
            warnings.warn(f"{self.kernel} attention refused this call ({reason}); XLA's "
                          f"attention runs instead", stacklevel=3)


class CpuKernels(ReferenceKernels):
    """The same functions, shaped for XLA's CPU backend (see the module docstring)."""

    name = "cpu"
    about = "CPU-tuned: blocked attention, fused loss, written-out backward passes"

    def normalize(self, x, scale, bias, eps, center):
        return _normalize(x, scale, bias, eps, center)

    def add_bias(self, y, bias):
        return _add_bias(y, bias)

    def causal_attention(self, q, k, v, attn=None):
        T = q.shape[1]
        if T % ATTENTION_BLOCK or T == ATTENTION_BLOCK:
            return super().causal_attention(q, k, v, attn)
        return _blocked_causal_attention(sharding.active().operands, q, k, v, attn)

    def gated_activation(self, x, w_gate, w_up):
        return _gated_activation(sharding.active().operands, x, w_gate, w_up)

    def cross_entropy(self, model, x, targets, weights=None):
        return fused_cross_entropy(model, x, targets, weights)

    def expert_ffn(self, x, group_sizes, w_gate, w_up, w_down):
        return blocked_expert_ffn(x, group_sizes, w_gate, w_up, w_down)


# Row sums as products -----------------------------------------------------------------------


def _sum_rows(x: jax.Array) -> jax.Array:
    """Sum x [..., F] over every leading axis, as a matrix-vector product with ones.

    Inside a pipeline stage (a `shard_map` region, where the value varies over the stage axis)
    a plain sum instead: there XLA partitions that product into collectives that deadlock
    when the rows and the features are split over two other mesh axes (`fsdp_pp_tp`)."""
    if jax.typeof(x).manual_axis_type.varying:
        return jnp.sum(x.reshape(-1, x.shape[-1]).astype(jnp.float32), axis=0)
    # Contracted over the leading axes as they are, not over x.reshape(-1, F): where the
    # sequence is split over devices (context parallelism), merging batch and positions into
    # rows would gather every position onto every device.
    ones = jnp.ones(x.shape[:-1], x.dtype)
    return jnp.einsum("...f,...->f", x, ones, precision=jax.lax.Precision.HIGHEST,
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_causal_attention(operands: str, q: jax.Array, k: jax.Array, v: jax.Array,
                              attn: AttentionInputs | None) -> jax.Array:
    """Causal attention one block of 64 queries at a time, each against the keys up to its end
    (and, as `attn` says, of its own document and window), the backward pass written out: the
    softmax's backward takes rowsum(dP * P), which autodiff summed over every key (dearer than
    the matmuls at T = 256), as dO . O over the head's features (as flash attention does). A
    masked key has probability 0, so the backward needs no mask of its own."""
    return _blocked_attention_fwd(operands, q, k, v, attn)[0]


def _query_blocks(T: int) -> list[tuple[int, int]]:
    return [(start, min(start + ATTENTION_BLOCK, T)) for start in range(0, T, ATTENTION_BLOCK)]


def _blocked_attention_fwd(operands, q, k, v, attn):
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4) * (H ** -0.5)  # [B, K, G, T, H]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    blocks, probs = [], []
    for start, end in _query_blocks(T):
        scores = matmul("bkgth,bksh->bkgts", q[:, :, :, start:end], k[:, :, :end], operands)
        visible = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]  # [t, s]
        if attn is not None:  # [B, 1, 1, t, s]: and in the query's document and window
            part = AttentionInputs(attn.positions[:, start:end], None if attn.segment_ids is None
                                   else attn.segment_ids[:, start:end], attn.window)
            allowed = part.mask(attn.positions[:, :end], None if attn.segment_ids is None
                                else attn.segment_ids[:, :end])
            if allowed is not None:
                visible = visible & allowed[:, :, None]
        scores = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
        probs.append(jax.nn.softmax(scores, axis=-1).astype(v.dtype))
        blocks.append(matmul("bkgts,bksh->bkgth", probs[-1], v[:, :, :end], operands))
    out = jnp.concatenate(blocks, axis=3)  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H), (q, k, v, out, probs)


def _blocked_attention_bwd(operands, residuals, g):
    q, k, v, out, probs = residuals  # q scaled, [B, K, G, T, H]; k, v [B, K, S, H]
    B, K, G, T, H = q.shape
    g = g.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    # d(scores) = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O).
    row = jnp.sum(g.astype(jnp.float32) * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    d_q, d_k, d_v = [], jnp.zeros_like(k), jnp.zeros_like(v)
    for (start, end), p in zip(_query_blocks(T), probs):
        g_block = g[:, :, :, start:end]
        d_p = matmul("bkgth,bksh->bkgts", g_block, v[:, :, :end], operands)
        d_s = (p * (d_p - row[:, :, :, start:end])).astype(q.dtype)
        d_q.append(matmul("bkgts,bksh->bkgth", d_s, k[:, :, :end], operands))
        d_k = d_k.at[:, :, :end].add(
            matmul("bkgts,bkgth->bksh", d_s, q[:, :, :, start:end], operands))
        d_v = d_v.at[:, :, :end].add(matmul("bkgts,bkgth->bksh", p, g_block, operands))
    d_q = (jnp.concatenate(d_q, axis=3) * (H ** -0.5)).transpose(0, 3, 1, 2, 4)
    return (d_q.reshape(B, T, K * G, H), d_k.transpose(0, 2, 1, 3), d_v.transpose(0, 2, 1, 3),
            None)


_blocked_causal_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)


# SwiGLU's gated hidden layer ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_activation(operands: str, x: jax.Array, w_gate: jax.Array,
                      w_up: jax.Array) -> jax.Array:
    """ReferenceKernels.gated_activation with the backward pass written out. Left to autodiff,
    XLA fused the silu's backward into a copy writing the hidden gradient transposed, dearer
    than the matmul (width 128, F = 384); here the weight gradients are x^T-times products."""
    return _gated_activation_fwd(operands, x, w_gate, w_up)[0]


def _gated_activation_fwd(operands, x, w_gate, w_up):
    gate, up = _project(x, w_gate, operands), _project(x, w_up, operands)
    return jax.nn.silu(gate) * up, (x, w_gate, w_up, gate, up)


def _gated_activation_bwd(operands, residuals, g):
    x, w_gate, w_up, gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    d_up = g * gate * sig  # d/d up of silu(gate) * up
    d_gate = g * up * sig * (1 + gate * (1 - sig))  # silu'(z) = s(z) (1 + z (1 - s(z)))
    # x^T d over batch and positions together (not over flattened rows: see `_sum_rows`)
    d_w_gate = matmul("btd,btf->df", x, d_gate, operands).astype(w_gate.dtype)
    d_w_up = matmul("btd,btf->df", x, d_up, operands).astype(w_up.dtype)
    d_x = (matmul("btf,df->btd", d_gate, w_gate, operands)
           + matmul("btf,df->btd", d_up, w_up, operands)).astype(x.dtype)
    return d_x, d_w_gate, d_w_up


_gated_activation.defvjp(_gated_activation_fwd, _gated_activation_bwd)


_KERNELS: dict[str, ReferenceKernels] = {
    "reference": ReferenceKernels(), "cpu": CpuKernels(),
    "cudnn": FusedKernels("cudnn", "cuDNN flash attention, XLA's where cuDNN refuses a call"),
    "splash": FusedKernels("splash", "Splash flash attention (Pallas), XLA's where it does "
                                     "not fit")}
