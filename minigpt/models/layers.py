"""Layers the model zoo shares, written with logical axis names only.

Every parameter is created by `param`, which records the logical name of each dimension
("embed", "mlp", ...). Which mesh axis a name is split over is the preset's business
(`minigpt.sharding`); nothing here knows about meshes or devices. Which kernels to run is read
from the context `minigpt.sharding` keeps; a model's entry points put its own choice there
(`minigpt.models.decoder`, which also stacks the blocks these layers make). Where the active rules
split `seq` over devices, attention runs as `minigpt.parallel` says.

Dimension letters used in shapes and einsum strings:
  B batch, T query positions, S key/value positions, D embed, N query heads, K key/value heads,
  H head dim, F feed-forward (mlp), V vocabulary (padded), L layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

import minigpt.models.fp8 as fp8
import minigpt.models.kernels as kernels
from minigpt import parallel, sharding
from minigpt.config import ModelConfig
from minigpt.models.execution import compute_dtype, operand_dtype
from minigpt.models.masks import AttentionInputs, within_window

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]

ACTIVATION_AXES = ("batch", "seq", "embed")  # [B, T, D] between layers

# The layers name every weight matrix `kernel` and every lookup table `table`; biases are `bias`
# and norm scales `scale`. Weight decay goes by these names (minigpt.optim.optimizer.decays).
DECAYED_PARAMETERS = ("kernel", "table")
# Projections from the block's inner features back to the embedding (attention's `out`, the
# MLP's `down`): every axis but the last is an input. Muon reads them so (minigpt.optim.optimizer).
OUTPUT_PROJECTIONS = ("out", "down")


def product(spec: str, x: jax.Array, w: jax.Array, *, dtype, operands) -> jax.Array:
    """A projection's `jnp.einsum(spec, x, w)` in `dtype`, its operands cast to `operands`
    (a CPU's bfloat16: bfloat16 operands accumulated in float32, `execution.operand_dtype`),
    under FP8 where the model runs so (`minigpt.models.fp8`), its contracted dimensions in
    the kernel's order inside the decoding engine's programs (`kernel_order_einsum`)."""
    if fp8.active():  # model.fp8 (minigpt.models.fp8)
        return fp8.einsum(spec, x.astype(dtype), w.astype(dtype))
    einsum = kernel_order_einsum if _kernel_order.get() else jnp.einsum
    precision = {} if operands == dtype else {"preferred_element_type": dtype}
    return einsum(spec, x.astype(operands), w.astype(operands), **precision)


def param(rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...],
          axes: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter whose dimensions carry logical axis names.

    Eager sharding is off: arrays are placed by `sharding.create_sharded`, which knows the mesh,
    so models can also be built plainly on one device.
    """
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes,
                     eager_sharding=False)


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """One dropout key per row of a batch: fold_in(key, row) for rows 0..rows-1, [rows]."""
    return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(rows))


def token_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """One dropout key per token: its row's key folded with its position, [B] and [B, T] ->
    [B, T]. A token's masks then depend on its row and its place in the sequence only, not on
    where it is computed: the same when a context-parallel preset runs the positions in another
    order (`minigpt.parallel.sequence_order`) or splits them over devices."""
    return jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)))(keys, positions)


def _each_key(fn, keys: jax.Array):
    """`fn` of one key mapped over every key of an array of them ([B] or [B, T])."""
    for _ in range(keys.ndim):
        fn = jax.vmap(fn)
    return fn(keys)


def fold_keys(keys: jax.Array, data: int | jax.Array) -> jax.Array:
    """Every key folded with the same number (a layer's index, say): [B] -> [B] or
    [B, T] -> [B, T]."""
    return _each_key(lambda k: jax.random.fold_in(k, data), keys)


def split_keys(keys: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """n independent keys per row (or token), as n arrays [B] (or [B, T]); no keys (evaluation)
    gives n Nones."""
    if keys is None:
        return (None,) * n
    split = _each_key(lambda k: jax.random.split(k, n), keys)  # [..., n]
    return tuple(split[..., i] for i in range(n))


def dropout(x: jax.Array, rate: float, keys: jax.Array | None) -> jax.Array:
    """Inverted dropout of x [B, ...] with one key per row [B] or per token [B, T]; no keys means
    evaluation (identity).

    A row's (a token's) mask depends only on its own key, so it is the same whatever batch,
    microbatch, pipeline stage or device it is computed in. Each element is kept where a 16-bit
    random integer is at least rate * 2^16 (exact to 2^-16), two to every 32 random bits the
    generator makes: the random numbers were a tenth of a CPU step of `minigpt` (dropout 0.1)
    with one 32-bit draw per element, and cost 40% less this way (bench/RESULTS.md). Rows of
    odd width draw 32 bits an element.
    """
    if keys is None or rate == 0.0:
        return x
    shape = x.shape[keys.ndim:]
    if shape and shape[-1] % 2 == 0:
        half = (*shape[:-1], shape[-1] // 2)
        bits = _each_key(lambda k: jax.random.bits(k, half, jnp.uint32), keys)
        # [..., F/2] uint32 -> [..., F/2, 2] uint16 -> [..., F]
        bits = jax.lax.bitcast_convert_type(bits, jnp.uint16).reshape(x.shape)
        keep = bits >= jnp.uint16(min(round(rate * 2**16), 2**16 - 1))
    else:
        bits = _each_key(lambda k: jax.random.bits(k, shape, jnp.uint32), keys)
        keep = bits >= jnp.uint32(min(round(rate * 2**32), 2**32 - 1))
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


_kernel_order: contextvars.ContextVar[bool] = contextvars.ContextVar("minigpt.kernel_order",
                                                                    default=False)


@contextlib.contextmanager
def in_kernel_order() -> Iterator[None]:
    """Projections inside contract in their kernels' order (`kernel_order_einsum`): what the
    decoding engine's programs trace under."""
    token = _kernel_order.set(True)
    try:
        yield
    finally:
        _kernel_order.reset(token)


def kernel_order_einsum(spec: str, x: jax.Array, w: jax.Array, **precision) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection, its contracted dimensions taken in the
    kernel's order. jnp.einsum orders them its own way ("BTNH,NHD->BTD" contracts H before N),
    and XLA's CPU backend then transposes the kernel [N, H, D] to [H, N, D] to match: inside a
    decode loop, a copy of the attention's output weights at every token of every layer
    (SmolLM2-135M's shape decoded 15% faster without). Training keeps jnp.einsum's order, the
    sums its runs were checked with."""
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    contracted = [c for c in ws if c in xs and c not in out]
    if "." in spec or len(contracted) < 2:
        return jnp.einsum(spec, x, w, **precision)
    batch = [c for c in ws if c in xs and c in out]
    y = jax.lax.dot_general(x, w, (([xs.index(c) for c in contracted],
                                    [ws.index(c) for c in contracted]),
                                   ([xs.index(c) for c in batch], [ws.index(c) for c in batch])),
                            **precision)
    order = batch + [c for c in xs if c not in ws] + [c for c in ws if c not in xs]
    return y if order == list(out) else y.transpose([order.index(c) for c in out])


class Dense(nnx.Module):
    """A projection written as an einsum, e.g. "BTD,DNH->BTNH" for the query heads.

    The initializer sees the kernel as a matrix [dimensions contracted with the input, the
    others], so fan-in and fan-out mean what they do for a matrix whatever the kernel's layout.
    """

    def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *,
                 init: Initializer, use_bias: bool, dtype: str, rngs: nnx.Rngs):
        self.spec, self.dtype = spec, jnp.dtype(compute_dtype(dtype))
        self.operands = jnp.dtype(operand_dtype(dtype))
        x_letters, k_letters = spec.split("->")[0].split(",")
        ins = [i for i, letter in enumerate(k_letters) if letter in x_letters]
        outs = [i for i, letter in enumerate(k_letters) if letter not in x_letters]

        def flat_init(key, full_shape, dtype):
            in_shape = [full_shape[i] for i in ins]
            out_shape = [full_shape[i] for i in outs]
            flat = init(key, (math.prod(in_shape), math.prod(out_shape)), dtype)
            order = [(ins + outs).index(i) for i in range(len(full_shape))]
            return flat.reshape(in_shape + out_shape).transpose(order)

        self.kernel = param(rngs, flat_init, shape, axes)
        self.bias = (param(rngs, nnx.initializers.zeros, tuple(shape[i] for i in outs),
                           tuple(axes[i] for i in outs)) if use_bias else None)
        self.lora = nnx.data(None)  # a low-rank adapter, when one is attached (models.lora)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = product(self.spec, x, self.kernel[...], dtype=self.dtype, operands=self.operands)
        if self.lora is not None:
            y = y + self.lora(x.astype(self.dtype))
        if self.bias is None:
            return y
        bias = self.bias[...].astype(self.dtype)
        if bias.ndim > 1:  # [N, H] head biases: treat as one flat feature axis
            flat = y.reshape(*y.shape[:-bias.ndim], -1)
            return kernels.active().add_bias(flat, bias.reshape(-1)).reshape(y.shape)
        return kernels.active().add_bias(y, bias)


class Embedding(nnx.Module):
    """A lookup table [V, D]; `attend` reuses it as an output head (weight tying)."""

    def __init__(self, num: int, dim: int, axes: tuple[str | None, str], *,
                 init: Initializer, dtype: str, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(compute_dtype(dtype))
        self.operands = jnp.dtype(operand_dtype(dtype))
        self.table = param(rngs, init, (num, dim), axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], ids, axis=0).astype(self.dtype)  # [B, T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        return product("...D,VD->...V", x, self.table[...], dtype=self.dtype,
                       operands=self.operands)


class LayerNorm(nnx.Module):
    """Normalise over the embedding (or, given `features`, over a last axis of that logical
    name and size): subtract the mean, divide by the standard deviation, then scale and shift
    (`center=False` makes it RMSNorm: no mean, no shift). With `unit_offset` the scale is
    stored as its difference from 1 (Gemma's norms: they start at 0 and multiply by 1 + w)."""

    def __init__(self, cfg: ModelConfig, *, center: bool = True,
                 features: tuple[str, int] | None = None, unit_offset: bool = False,
                 rngs: nnx.Rngs):
        self.eps, self.center, self.offset = cfg.norm_eps, center, 1.0 if unit_offset else 0.0
        self.dtype = jnp.dtype(compute_dtype(cfg.dtype))
        axis, size = features or ("embed", cfg.embed_dim)
        start = nnx.initializers.zeros if unit_offset else nnx.initializers.ones
        self.scale = param(rngs, start, (size,), (axis,))
        self.bias = param(rngs, nnx.initializers.zeros, (size,), (axis,)) if center else None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the compute dtype: bf16 variances lose too much.
        bias = None if self.bias is None else self.bias[...]
        scale = self.scale[...] + self.offset if self.offset else self.scale[...]
        y = kernels.active().normalize(x, scale, bias, self.eps, self.center)
        return y.astype(self.dtype)


def RMSNorm(cfg: ModelConfig, *, features: tuple[str, int] | None = None,  # noqa: N802
            unit_offset: bool = False, rngs: nnx.Rngs) -> LayerNorm:
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): a scale, no mean, no bias."""
    return LayerNorm(cfg, center=False, features=features, unit_offset=unit_offset, rngs=rngs)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> jax.Array:
    """The rotary embedding's frequencies theta^(-2i/H) for i < H/2 [H/2], with `scaling`
    (`rope_scaling(cfg)`) as Llama 3.1+ ("llama3": wavelengths longer than the original context
    / low slowed by the factor, shorter than context / high kept, a smooth blend between) or a
    plain factor ("linear"), as transformers computes them."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    if not scaling:
        return freq
    kind, factor, low, high, original = scaling
    if kind == "linear":
        return freq / factor
    wavelength = 2 * math.pi / freq
    slowed = jnp.where(wavelength > original / low, freq / factor, freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(medium, blended, slowed)


def rope_scaling(cfg: ModelConfig) -> tuple:
    """A model's rotary scaling as `rope_frequencies` takes it (() for none)."""
    if not cfg.rope_scaling:
        return ()
    return (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq, cfg.rope_high_freq,
            cfg.rope_original_context)


def apply_rope(x: jax.Array, positions: jax.Array, freq: jax.Array) -> jax.Array:
    """Rotate feature pairs (i, i + R/2) of x [B, T, N, H] by angles positions * frequency i
    (`rope_frequencies`, [R/2]): all of its features (R = H), or the first R of them, the rest
    passed through (Phi-3's partial rotary embedding)."""
    freq = jnp.asarray(freq, jnp.float32)  # [R/2], or one frequency for every pair
    turned = 2 * freq.shape[-1] if freq.ndim else x.shape[-1]
    rotated, kept = x[..., :turned], x[..., turned:]
    angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [B, T, 1, R/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(rotated.astype(jnp.float32), 2, axis=-1)
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
    return jnp.concatenate([y, kept], -1) if kept.shape[-1] else y


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, K, H] into cache [B, K, S, H] at a per-row offset start [B]."""
    def write_row(c, n, s):
        return jax.lax.dynamic_update_slice(c, n, (0, s, 0))
    return jax.vmap(write_row)(cache, new.swapaxes(1, 2), start)


class Attention(nnx.Module):
    """Causal multi-head self-attention with grouped-query heads, optional rotary positions,
    optional query and key norms (`qk_norm`: RMSNorm over each head's features, as Qwen3 and
    Gemma 3) and an optional key/value cache for decoding. What it sees besides its input (each
    token's position, its document, the window of a local layer) comes in one record,
    `masks.AttentionInputs`. Families may scale queries otherwise than 1/sqrt(H) (`query_scale`,
    Gemma's 1/sqrt(query_pre_attn_scalar)) and rotate local layers' keys and queries at their
    own base (`local_rope_theta`: Gemma 3's sliding layers), or bring norms of their own for
    queries and keys (`qk_norms`: OLMo 2's, over the whole projection), or rotate the first
    `rotary_dim` features of each head alone (Phi-3's partial rotary embedding)."""

    def __init__(self, cfg: ModelConfig, *, use_bias: bool, rope: bool, init: Initializer,
                 out_init: Initializer, qk_norm: bool = False, out_bias: bool | None = None,
                 query_scale: float = 0.0, local_rope_theta: float = 0.0,
                 norm_offset: bool = False, qk_norms: tuple[nnx.Module, nnx.Module] | None = None,
                 rotary_dim: int = 0, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        common = dict(use_bias=use_bias, dtype=cfg.dtype, rngs=rngs)
        out_bias = use_bias if out_bias is None else out_bias
        self.query = Dense("BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "kv"), init=init,
                           **common)
        self.key = Dense("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "kv"), init=init,
                         **common)
        self.value = Dense("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "kv"), init=init,
                           **common)
        self.out = Dense("BTNH,NHD->BTD", (N, H, D), ("heads", "kv", "embed"), init=out_init,
                         **{**common, "use_bias": out_bias})
        self.rope = (cfg.rope_theta, rope_scaling(cfg)) if rope else None
        self.rotary_dim = rotary_dim or H
        self.local_theta = local_rope_theta  # 0: local layers rotate as the global ones
        # Queries pre-scaled where the family's scale is not the kernels' 1/sqrt(H).
        self.q_scale = query_scale * H ** 0.5 if query_scale else 1.0
        if qk_norm:  # one scale per head feature, shared by the heads, as Qwen3's
            self.q_norm = RMSNorm(cfg, features=("kv", H), unit_offset=norm_offset, rngs=rngs)
            self.k_norm = RMSNorm(cfg, features=("kv", H), unit_offset=norm_offset, rngs=rngs)
        else:
            self.q_norm, self.k_norm = qk_norms or (None, None)

    def frequencies(self, head_dim: int, attn: AttentionInputs) -> jax.Array:
        """The rotary frequencies [H/2] of this layer: the global ones, or a local layer's
        (a window set, with a local base: Gemma 3) at `local_theta` without scaling."""
        freq = rope_frequencies(head_dim, *self.rope)
        if not (self.local_theta and attn.windowed):
            return freq
        return jnp.where(jnp.asarray(attn.window) > 0,
                         rope_frequencies(head_dim, self.local_theta), freq)

    def __call__(self, x: jax.Array, attn: AttentionInputs,
                 kv: tuple[jax.Array, jax.Array] | None = None):
        """Attend over x [B, T, D] as `attn` says (each token's position in its document, its
        document, the layer's window); with a cache `kv`, to the cached keys of its row up to
        its position (and within its window)."""
        q, k, v = self.query(x), self.key(x), self.value(x)  # [B, T, N, H], [B, T, K, H] x2
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            freq = self.frequencies(self.rotary_dim, attn)
            q, k = apply_rope(q, attn.positions, freq), apply_rope(k, attn.positions, freq)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        if kv is None:
            # Where the rules split the sequence over devices, attention is the one layer
            # that needs the others' positions: a collective region of its own.
            split = sharding.active_ways("seq") > 1
            y = (parallel.causal_attention if split else kernels.active().causal_attention)(
                q, k, v, attn)  # [B, T, N, H]
        else:
            # Each row writes at its own offset; a key is visible when its position is at most
            # the query's (and within its window), which also hides stale entries beyond a
            # row's current length.
            positions = attn.positions
            k_cache = write_cache(kv[0], k.astype(kv[0].dtype), positions[:, 0])  # [B, K, S, H]
            v_cache = write_cache(kv[1], v.astype(kv[1].dtype), positions[:, 0])
            key_pos = jnp.arange(k_cache.shape[2])
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
            if attn.windowed:
                mask = mask & within_window(positions, jnp.broadcast_to(
                    key_pos, (positions.shape[0], key_pos.shape[0])), attn.window)[:, None]
            y = kernels.active().cached_attention(q, k_cache.astype(q.dtype),
                                                  v_cache.astype(q.dtype), mask)
            kv = (k_cache, v_cache)
        return self.out(y), kv


class MLP(nnx.Module):
    """Two-layer feed-forward network: D -> F -> D with an elementwise activation."""

    def __init__(self, cfg: ModelConfig, *, activation: Callable[[jax.Array], jax.Array],
                 use_bias: bool, init: Initializer, out_init: Initializer, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.mlp_dim
        common = dict(use_bias=use_bias, dtype=cfg.dtype, rngs=rngs)
        self.up = Dense("BTD,DF->BTF", (D, F), ("embed", "mlp"), init=init, **common)
        self.down = Dense("BTF,FD->BTD", (F, D), ("mlp", "embed"), init=out_init, **common)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.activation(self.up(x)))
