"""The decoder every model in the zoo is: a stack of blocks between an embedding and a head.

`BlockStack` holds the transformer blocks stacked into `[layers, ...]` arrays and runs them (a
scan, an unrolled loop, or chunk by chunk as a pipeline's stages); `DecoderLM` is what the
architectures subclass: token ids in, next-token logits out, the features the loss fuses with
the head, the pipelined loss, cached decoding. The layers they are built from are
`minigpt.models.layers`; dimension letters as there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt import pipeline, sharding
from minigpt.config import ModelConfig
from minigpt.models import kernels, loss
from minigpt.models.layers import ACTIVATION_AXES, fold_keys, row_keys
from minigpt.sharding import constrain


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
    def loss(self, batch: dict[str, jax.Array], keys: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy of a batch {"inputs", "targets"} (int [B, T] each),
        with dropout when per-row keys are given: the one door to the loss kernel. Under a
        pipeline preset the model runs as the context's pipeline settings say."""
        if sharding.active_ways("layers") > 1:
            return self.pipelined_loss(batch, keys)
        x = self.features(batch["inputs"], dropout_key=keys)  # [B, T, D]
        return kernels.active().cross_entropy(self, x, batch["targets"])

    @_with_own_kernels
    def pipelined_loss(self, batch: dict[str, jax.Array], keys: jax.Array | None) -> jax.Array:
        """Mean next-token cross-entropy of a batch under a pipeline preset, the embedding, the
        block stack and the head handed to `minigpt.pipeline` as the schedule's pieces.

        Same value and gradients as `kernels.active().cross_entropy(model,
        model.features(...))` with the same per-row dropout keys; how the batch goes through
        the stages is the context's pipeline settings.
        """
        cfg = self.config
        graphdef, blocks, rest = nnx.split(self, nnx.PathContains("blocks"), ...)
        stand_in = loss.placeholders(blocks)  # the embedding and head never read them
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
