"""Layers the model zoo shares, written with logical axis names only.

Every parameter is created by `param`, which records the logical name of each dimension
("embed", "mlp", ...). Which mesh axis a name is split over is the preset's business
(`minigpt.sharding`); nothing here knows about meshes or devices. How to run (which kernels,
how a pipeline cuts the batch) is read from the context `minigpt.sharding` keeps, where the
layers need it; a model's entry points put its own kernel choice there.

Dimension letters used in shapes and einsum strings:
  B batch, T query positions, S key/value positions, D embed, N query heads, K key/value heads,
  H head dim, F feed-forward (mlp), V vocabulary (padded), L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt import kernels, pipeline, sharding
from minigpt.config import ModelConfig
from minigpt.sharding import constrain

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]

ACTIVATION_AXES = ("batch", "seq", "embed")  # [B, T, D] between layers

# The layers name every weight matrix `kernel` and every lookup table `table`; biases are `bias`
# and norm scales `scale`. Weight decay goes by these names (minigpt.steps.decays).
DECAYED_PARAMETERS = ("kernel", "table")


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


def fold_keys(keys: jax.Array, data: int | jax.Array) -> jax.Array:
    """Every row's key folded with the same number (a layer's index, say): [B] -> [B]."""
    return jax.vmap(jax.random.fold_in, (0, None))(keys, data)


def split_keys(keys: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """n independent keys per row, as n arrays [B]; no keys (evaluation) gives n Nones."""
    if keys is None:
        return (None,) * n
    split = jax.vmap(jax.random.split, (0, None))(keys, n)  # [B, n]
    return tuple(split[:, i] for i in range(n))


def dropout(x: jax.Array, rate: float, keys: jax.Array | None) -> jax.Array:
    """Inverted dropout of x [B, ...] with one key per row; no keys means evaluation (identity).

    A row's mask depends only on its own key, so a row sees the same mask whatever batch,
    microbatch or pipeline stage it is computed in. Compares raw 32-bit random integers with a
    threshold instead of drawing uniform floats, which halves the cost of the random numbers on
    CPU and is exact to 2^-32.
    """
    if keys is None or rate == 0.0:
        return x
    threshold = min(round(rate * 2**32), 2**32 - 1)
    bits = jax.vmap(lambda k: jax.random.bits(k, x.shape[1:], jnp.uint32))(keys)
    return jnp.where(bits >= jnp.uint32(threshold), x / (1.0 - rate), 0.0).astype(x.dtype)


class Dense(nnx.Module):
    """A projection written as an einsum, e.g. "BTD,DNH->BTNH" for the query heads.

    The initializer sees the kernel as a matrix [dimensions contracted with the input, the
    others], so fan-in and fan-out mean what they do for a matrix whatever the kernel's layout.
    """

    def __init__(self, spec: str, shape: tuple[int, ...], axes: tuple[str, ...], *,
                 init: Initializer, use_bias: bool, dtype: str, rngs: nnx.Rngs):
        self.spec, self.dtype = spec, jnp.dtype(dtype)
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

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum(self.spec, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
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
        self.dtype = jnp.dtype(dtype)
        self.table = param(rngs, init, (num, dim), axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], ids, axis=0).astype(self.dtype)  # [B, T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...D,VD->...V", x.astype(self.dtype),
                          self.table[...].astype(self.dtype))


class LayerNorm(nnx.Module):
    """Normalise over the embedding: subtract the mean, divide by the standard deviation, then
    scale and shift (`center=False` makes it RMSNorm: no mean, no shift)."""

    def __init__(self, cfg: ModelConfig, *, center: bool = True, rngs: nnx.Rngs):
        self.eps, self.dtype, self.center = cfg.norm_eps, jnp.dtype(cfg.dtype), center
        self.scale = param(rngs, nnx.initializers.ones, (cfg.embed_dim,), ("embed",))
        self.bias = (param(rngs, nnx.initializers.zeros, (cfg.embed_dim,), ("embed",))
                     if center else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the compute dtype: bf16 variances lose too much.
        bias = None if self.bias is None else self.bias[...]
        y = kernels.active().normalize(x, self.scale[...], bias, self.eps, self.center)
        return y.astype(self.dtype)


def RMSNorm(cfg: ModelConfig, *, rngs: nnx.Rngs) -> LayerNorm:  # noqa: N802 - reads as a layer
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): a scale, no mean, no bias."""
    return LayerNorm(cfg, center=False, rngs=rngs)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate feature pairs (i, i + H/2) of x [B, T, N, H] by angles positions * theta^(-2i/H)."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, K, H] into cache [B, S, K, H] at a per-row offset start [B]."""
    def write_row(c, n, s):
        return jax.lax.dynamic_update_slice(c, n, (s, 0, 0))
    return jax.vmap(write_row)(cache, new, start)


class Attention(nnx.Module):
    """Causal multi-head self-attention with grouped-query heads, optional rotary positions and
    an optional key/value cache for decoding."""

    def __init__(self, cfg: ModelConfig, *, use_bias: bool, rope: bool, init: Initializer,
                 out_init: Initializer, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        common = dict(use_bias=use_bias, dtype=cfg.dtype, rngs=rngs)
        self.query = Dense("BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "kv"), init=init,
                           **common)
        self.key = Dense("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "kv"), init=init,
                         **common)
        self.value = Dense("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "kv"), init=init,
                           **common)
        self.out = Dense("BTNH,NHD->BTD", (N, H, D), ("heads", "kv", "embed"), init=out_init,
                         **common)
        self.rope_theta = cfg.rope_theta if rope else None

    def __call__(self, x: jax.Array, positions: jax.Array,
                 kv: tuple[jax.Array, jax.Array] | None = None):
        q, k, v = self.query(x), self.key(x), self.value(x)  # [B, T, N, H], [B, T, K, H] x2
        if self.rope_theta is not None:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        if kv is None:
            y = kernels.active().causal_attention(q, k, v)  # [B, T, N, H]
        else:
            # Each row writes at its own offset; a key is visible when its position is at most
            # the query's, which also hides stale entries beyond a row's current length.
            k_cache = write_cache(kv[0], k.astype(kv[0].dtype), positions[:, 0])  # [B, S, K, H]
            v_cache = write_cache(kv[1], v.astype(kv[1].dtype), positions[:, 0])
            key_pos = jnp.arange(k_cache.shape[1])
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
            y = jax.nn.dot_product_attention(q, k_cache.astype(q.dtype),
                                             v_cache.astype(q.dtype), mask=mask)
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


def mask_padded_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """Give the padding rows of the vocabulary zero probability in every softmax."""
    if logits.shape[-1] == vocab_size:
        return logits
    real = jnp.arange(logits.shape[-1]) < vocab_size
    return jnp.where(real, logits, -jnp.inf)


class BlockStack(nnx.Module):
    """The transformer blocks: one stacked module whose parameters all have a leading `layers`
    axis [L, ...], applied in order.

    The layout is the same however the stack runs, so a checkpoint moves between all of them:
    `scan_layers` runs the layers with `lax.scan` (the compiled program holds one block however
    deep the model is), otherwise as an unrolled loop over the stack's slices; under a preset
    that splits `layers` over several devices (a pipeline preset) training runs the model as a
    pipeline (`DecoderLM.pipelined_loss`), chunk by chunk (`run_chunk`), as the context's
    pipeline settings say. A block is called as `block(x, positions, kv, keys) -> (x, kv)`;
    layer i draws its dropout masks from every row's key folded with i. The stack owns the
    layout of the key/value cache ([L, B, S, K, H] keys and values), so callers treat the
    cache as opaque.
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], cfg: ModelConfig, *,
                 rngs: nnx.Rngs):
        self.remat, self.scan, self.num_layers = cfg.remat, cfg.scan_layers, cfg.num_layers

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs):
            return make_block(rngs)

        self.layers = stacked(rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache, keys: jax.Array | None):
        graphdef, params = nnx.split(self.layers)
        order = pipeline.positions_in_use(self.num_layers)
        if order is not None:  # the arrays hold a circular schedule's order: run the model's
            params = jax.tree.map(lambda a: a[np.argsort(order)], params)
        return self._run(graphdef, params, x, positions, cache, keys, first_layer=0)

    def run_chunk(self, params, x: jax.Array, positions: jax.Array, keys: jax.Array | None,
                  first_layer) -> jax.Array:
        """Apply the consecutive layers whose stacked parameters are `params` (a slice of the
        stack's state, [c, ...]), numbered from `first_layer`: one pipeline stage's chunk."""
        return self._run(nnx.graphdef(self.layers), params, x, positions, None, keys,
                         first_layer=first_layer)[0]

    def _run(self, graphdef, params, x, positions, cache, keys, *, first_layer):
        """Apply the layers whose stacked parameters are `params`, numbered from first_layer."""
        def layer(x, layer_params, kv, index):
            block = nnx.merge(graphdef, layer_params)
            x, kv = block(x, positions, kv, None if keys is None else fold_keys(keys, index))
            return constrain(x, ACTIVATION_AXES), kv

        if self.remat:
            layer = jax.checkpoint(layer)
        count = jax.tree.leaves(params)[0].shape[0]
        indices = first_layer + jnp.arange(count)
        if self.scan:
            def body(x, xs):
                return layer(x, *xs)

            return jax.lax.scan(body, x, (params, cache, indices))
        new_cache = []
        for i in range(count):
            x, kv = layer(x, jax.tree.map(lambda a, i=i: a[i], params),
                          None if cache is None else jax.tree.map(lambda a, i=i: a[i], cache),
                          indices[i])
            new_cache.append(kv)
        return x, (None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new_cache))

    def init_cache(self, shape: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array]:
        """Zeros for the keys and values of every layer: two arrays [L, B, S, K, H]."""
        axes = ("layers", "batch", None, "kv_heads", "kv")
        return tuple(constrain(jnp.zeros((self.num_layers, *shape), dtype), axes)
                     for _ in range(2))


def _lookup_ready(state):
    """The state with its lookup tables' embedding axis gathered: inside a pipeline stage with
    two other mesh axes (the 3-D presets), XLA cannot partition a lookup into a table split
    along its embedding axis; FSDP gathers every weight it uses all the same."""
    def one(var):
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        if axes and len(axes) == 2 and axes[1] == "embed":  # [vocab or positions, embed]
            return var.replace(constrain(var.get_value(), (axes[0], None)))
        return var

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _with_own_kernels(method):
    """Run a model's entry point with the model's own kernel choice (`ModelConfig.kernels`) in
    the context, where its layers read it: resolved once per model, not in every layer."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with sharding.running(kernels=self.config.kernels):
            return method(self, *args, **kwargs)

    return wrapped


class DecoderLM(nnx.Module):
    """What every model in the zoo shares: token ids in, next-token logits out.

    Subclasses build `self.blocks` (a BlockStack) and define `embed` (ids and positions, and
    per-row dropout keys or None, to [B, T, D]) and `head` (final norm and projection, [..., D]
    to [..., V]).
    """

    config: ModelConfig
    blocks: BlockStack

    def embed(self, tokens: jax.Array, positions: jax.Array,
              keys: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError

    def head(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] (float32, V padded, padding at -inf) for token ids [B, T].

        Dropout is on exactly when a key is given, so evaluation needs no flag.
        """
        return self.logits(self.features(tokens, dropout_key=dropout_key))

    @_with_own_kernels
    def features(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """The last layer's output [B, T, D], before the output head (the loss fuses the head
        with the softmax, so training never holds all logits at once).

        `dropout_key` is one key, or one key per row [B] (a train step gives each row of the
        global batch its own, so microbatches and pipeline stages draw the masks the whole
        batch would).
        """
        B, T = tokens.shape
        keys = dropout_key
        if keys is not None and keys.ndim == 0:
            keys = row_keys(keys, B)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        # The embedding's dropout keys come after the layers' 0..L-1.
        embed_keys = None if keys is None else fold_keys(keys, self.config.num_layers)
        x = constrain(self.embed(tokens, positions, embed_keys), ACTIVATION_AXES)  # [B, T, D]
        x, _ = self.blocks(x, positions, None, keys)
        return x

    @_with_own_kernels
    def pipelined_loss(self, batch: dict[str, jax.Array], keys: jax.Array | None) -> jax.Array:
        """Mean next-token cross-entropy of a batch under a pipeline preset, the embedding, the
        block stack and the head handed to `minigpt.pipeline` as the schedule's pieces.

        Same value and gradients as `kernels.cross_entropy(model, model.features(...))` with
        the same per-row dropout keys; how the batch goes through the stages is the context's
        pipeline settings.
        """
        cfg = self.config
        graphdef, blocks, rest = nnx.split(self, nnx.PathContains("blocks"), ...)
        stand_in = kernels.placeholders(blocks)  # the embedding and head never read them
        B, T = batch["inputs"].shape
        inputs = {"tokens": batch["inputs"], "targets": batch["targets"], "keys": keys,
                  "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}

        def embed(rest, mb):
            model = nnx.merge(graphdef, stand_in(), _lookup_ready(rest))
            keys = None if mb["keys"] is None else fold_keys(mb["keys"], cfg.num_layers)
            return constrain(model.embed(mb["tokens"], mb["positions"], keys), ACTIVATION_AXES)

        def stage(chunk, x, mb, first_layer):
            return self.blocks.run_chunk(chunk["blocks"]["layers"], x, mb["positions"],
                                         mb["keys"], first_layer)

        def head(rest, y, targets):
            model = nnx.merge(graphdef, stand_in(), rest)
            return kernels.active().cross_entropy(model, y, targets) * targets.size

        return pipeline.loss(embed, stage, head, rest, blocks, inputs)

    @_with_own_kernels
    def logits(self, x: jax.Array) -> jax.Array:
        """Output head: features [..., D] to float32 logits [..., V], vocabulary padding at -inf."""
        logits = self.head(x).astype(jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "seq", "vocab"))
        return mask_padded_vocab(logits, self.config.vocab_size)

    @_with_own_kernels
    def decode(self, tokens: jax.Array, positions: jax.Array, cache):
        """Run tokens [B, T] at positions [B, T] against a cache; returns (logits, cache).

        Row b's positions must be consecutive, starting where its cached prefix ends.
        """
        x = constrain(self.embed(tokens, positions), ACTIVATION_AXES)
        x, cache = self.blocks(x, positions, cache, None)
        return self.logits(x), cache

    def init_cache(self, batch: int, length: int, dtype=jnp.float32):
        """An empty cache for `batch` rows of at most `length` positions."""
        cfg = self.config
        return self.blocks.init_cache((batch, length, cfg.kv_heads, cfg.head_dim), dtype)


def count_params(model: nnx.Module, cfg: ModelConfig) -> int:
    """Parameters a model really has: the vocabulary's padding rows are not counted."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            axes = node.get_metadata().get("out_sharding") or ()
            rows = cfg.vocab_size / cfg.padded_vocab if "vocab" in axes else 1
            total += round(node.size * rows)
    return total
