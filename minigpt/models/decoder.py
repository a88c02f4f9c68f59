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

import minigpt.models.execution as execution
import minigpt.models.fp8 as fp8
import minigpt.models.kernels as kernels
import minigpt.models.lora as lora
import minigpt.models.loss as loss
from minigpt import parallel, pipeline, sharding
from minigpt.config import ModelConfig
from minigpt.models.inputs import check_inputs, in_run_order, loss_batch, positions_in
from minigpt.models.layers import ACTIVATION_AXES, fold_keys, row_keys, token_keys
from minigpt.models.masks import AttentionInputs, document_positions
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
    pipeline settings say. A block is called as `block(x, attn, kv, keys) -> (x, kv)` (`attn`:
    the `AttentionInputs` of its layer, the window set where the model's layers have their own),
    or `(x, kv, report)` where it has something to report (a mixture of experts: the router's
    penalties and counts, `minigpt.models.moe`), which the stack sums over its layers; layer i
    draws its dropout masks from every token's key folded with i. The stack owns the
    layout of the key/value cache ([L, B, K, S, H] keys and values), so callers treat the
    cache as opaque.
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], cfg: ModelConfig, *,
                 rngs: nnx.Rngs):
        # How the stack runs, as `execution.for_backend` resolved it (a config built by hand
        # may still say "auto": resolved here, for the backend running)
        self.remat = execution.remat_policy(cfg.remat_policy)
        self.scan, self.num_layers = execution.scanned(cfg.scan_layers), cfg.num_layers
        self.windows = layer_windows(cfg)  # each layer's sliding window (0: full)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs):
            return make_block(rngs)

        self.layers = stacked(rngs)

    def __call__(self, x: jax.Array, attn: AttentionInputs, cache, keys: jax.Array | None,
                 layers: list | None = None):
        """(x, cache, the layers' reports summed: {} where the blocks report nothing). With
        `layers` (`unstacked`: each layer's parameters as arrays of their own), the layers run
        unrolled on those, and the cache is a list of per-layer (keys, values)."""
        graphdef, params = nnx.split(self.layers)
        if layers is not None:
            return self._run(graphdef, layers, x, attn, cache, keys, first_layer=0)
        order = pipeline.positions_in_use(self.num_layers)
        if order is not None:  # the arrays hold a circular schedule's order: run the model's
            params = jax.tree.map(lambda a: a[np.argsort(order)], params)
        return self._run(graphdef, params, x, attn, cache, keys, first_layer=0)

    def unstacked(self) -> list:
        """Each layer's parameters as arrays of their own (copies of the stack's slices), for
        `__call__(layers=...)`: a loop over them slices nothing. On a CPU, XLA copies each slice
        of a stacked weight that a product reads (scanned or unrolled alike), which in a decode
        step of SmolLM2-135M's shape took longer than the products (see
        `minigpt.decoding.programs.default_how`)."""
        state = nnx.state(self.layers)
        return [jax.tree.map(lambda a, i=i: jnp.array(a[i]), state)
                for i in range(self.num_layers)]

    def run_chunk(self, params, x: jax.Array, attn: AttentionInputs, keys: jax.Array | None,
                  first_layer) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Apply the consecutive layers whose stacked parameters are `params` (a slice of the
        stack's state, [c, ...]), numbered from `first_layer`: one pipeline stage's chunk.
        Returns its output and its layers' reports, summed."""
        x, _, report = self._run(nnx.graphdef(self.layers), params, x, attn, None, keys,
                                 first_layer=first_layer)
        return x, report

    def _run(self, graphdef, params, x, attn, cache, keys, *, first_layer):
        """Apply the layers whose stacked parameters are `params`, numbered from first_layer."""
        def layer(x, layer_params, kv, index):
            block = nnx.merge(graphdef, layer_params)
            layer_keys = None if keys is None else fold_keys(keys, index)
            with lora.dropout_keys(layer_keys):  # the adapters' (the layer splits its own)
                x, kv, *report = block(x, attn.for_layer(self.windows, index), kv, layer_keys)
            return constrain(x, ACTIVATION_AXES), kv, (report[0] if report else {})

        if self.remat is not None:
            layer = jax.checkpoint(layer, policy=self.remat)
        per_layer = isinstance(params, list)  # `unstacked` layers, with per-layer caches
        count = len(params) if per_layer else jax.tree.leaves(params)[0].shape[0]
        indices = first_layer + jnp.arange(count)
        if self.scan and not per_layer:
            def body(x, xs):
                x, kv, report = layer(x, *xs)
                return x, (kv, report)

            x, (cache, reports) = jax.lax.scan(body, x, (params, cache, indices))
            return x, cache, jax.tree.map(lambda a: jnp.sum(a, axis=0), reports)
        def nth(tree, i):
            return tree[i] if per_layer else jax.tree.map(lambda a: a[i], tree)

        new_cache, reports = [], []
        for i in range(count):
            x, kv, report = layer(x, nth(params, i), None if cache is None else nth(cache, i),
                                  indices[i])
            new_cache.append(kv)
            reports.append(report)
        if cache is not None and not per_layer:
            new_cache = jax.tree.map(lambda *a: jnp.stack(a), *new_cache)
        return (x, None if cache is None else new_cache,
                jax.tree.map(lambda *a: functools.reduce(jnp.add, a), *reports))

    def init_cache(self, shape: tuple[int, ...], dtype, *, per_layer: bool = False):
        """Zeros for the keys and values of every layer: two arrays [L, B, K, S, H], or with
        `per_layer` (for `unstacked` layers) a list of L pairs [B, K, S, H]."""
        axes = ("layers", "batch", "kv_heads", None, "kv")
        if per_layer:
            return [tuple(constrain(jnp.zeros(shape, dtype), axes[1:]) for _ in range(2))
                    for _ in range(self.num_layers)]
        return tuple(constrain(jnp.zeros((self.num_layers, *shape), dtype), axes)
                     for _ in range(2))


def layer_windows(cfg: ModelConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention): `model.sliding_window` on every layer,
    or, with `model.sliding_window_pattern` N, on all but every N-th (Gemma 3's five local
    layers to one global)."""
    W, N = cfg.sliding_window, cfg.sliding_window_pattern
    return tuple(0 if not W or (N and (i + 1) % N == 0) else W for i in range(cfg.num_layers))


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
    """Run a model's entry point with the model's own kernel and FP8 choices
    (`ModelConfig.kernels`, `ModelConfig.fp8`) in the context, where its layers read them:
    resolved once per model, not in every layer."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with sharding.running(kernels=self.config.kernels,
                              operands=execution.operand_dtype(self.config.dtype)), \
                fp8.running(self.config):
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

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] (float32, V padded, padding at -inf) for token ids [B, T].

        With `segment_ids` (int32 [B, T]: equal ids one document, 0 padding) each document
        gets the logits it would get alone: it attends to itself only and its positions start
        at 0 (`minigpt.models.masks`). Dropout is on exactly when a key is given, so evaluation
        needs no flag.
        """
        return self.logits(self.features(tokens, segment_ids=segment_ids,
                                         dropout_key=dropout_key))

    @_with_own_kernels
    def features(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """The last layer's output [B, T, D], before the output head (the loss fuses the head
        with the softmax, so training never holds all logits at once).

        `dropout_key` is one key, or one key per row [B] (a train step gives each row of the
        global batch its own, so microbatches and pipeline stages draw the masks the whole
        batch would).
        """
        return self.features_and_report(tokens, segment_ids=segment_ids,
                                        dropout_key=dropout_key)[0]

    @_with_own_kernels
    def features_and_report(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                            positions: jax.Array | None = None,
                            dropout_key: jax.Array | None = None, run_order: bool = False
                            ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`features`, and what the blocks reported, summed over the layers ({} for a dense
        model; a mixture of experts' penalties and counts). `positions` (each token's place in
        its document) default to what `segment_ids` say, or 0..T-1 without them.

        Under a preset that splits the sequence with load balancing the model runs its
        positions in another order (`in_run_order`); the features come back in the tokens'
        order, or, with `run_order` (tokens, ids and positions given in that order: the loss, a
        mean over positions, needs no other), in that order.
        """
        check_inputs(tokens, segment_ids=segment_ids, positions=positions)
        B, T = tokens.shape
        order = parallel.sequence_order(T)
        if segment_ids is not None and positions is None:
            if run_order and order is not None:
                raise ValueError("give the positions of tokens in run order (see in_run_order)")
            positions = document_positions(segment_ids)
        if order is not None and not run_order:
            tokens, segment_ids, positions = (None if a is None else a[:, order]
                                              for a in (tokens, segment_ids, positions))
        keys = dropout_key
        if keys is not None and keys.ndim == 0:
            keys = row_keys(keys, B)
        places = positions_in(order, B, T)  # each token's place in the window
        positions = places if positions is None else positions
        # Dropout keys go by the place in the window, which no two tokens of a row share.
        keys = None if keys is None else token_keys(keys, places)  # [B, T]
        # The embedding's dropout keys come after the layers' 0..L-1.
        embed_keys = None if keys is None else fold_keys(keys, self.config.num_layers)
        x = constrain(self.embed(tokens, positions, embed_keys), ACTIVATION_AXES)  # [B, T, D]
        x, _, report = self.blocks(x, AttentionInputs(positions, segment_ids), None, keys)
        if order is not None and not run_order:
            x = constrain(x[:, np.argsort(order)], ACTIVATION_AXES)  # the tokens' order again
        return x, report

    @_with_own_kernels
    def loss(self, batch: dict[str, jax.Array], keys: jax.Array | None = None) -> jax.Array:
        """The training loss of a batch {"inputs", "targets"} (int [B, T] each; optionally
        "segment_ids", "positions" and "loss_mask", see `loss_batch`), with dropout when per-row
        keys are given: the mean next-token cross-entropy over the trained targets, plus the
        router's penalties of a mixture of experts. The one door to the loss kernel; under a
        pipeline preset the model runs as the context's pipeline settings say."""
        return self.loss_and_metrics(batch, keys)[0]

    @_with_own_kernels
    def loss_and_metrics(self, batch: dict[str, jax.Array], keys: jax.Array | None = None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss`, and what it is made of: {"cross_entropy": the mean over trained targets, and
        what the blocks report: each loss term (float) as a mean over positions, each count
        (int) for the whole batch}. The loss is the cross-entropy plus the terms."""
        check_inputs(batch["inputs"], **{k: batch.get(k) for k in (
            "targets", "segment_ids", "positions")})
        batch = loss_batch(batch)
        if sharding.active_ways("layers") > 1:
            return self.pipelined_loss(batch, keys)
        batch = in_run_order(batch)
        x, report = self.features_and_report(
            batch["inputs"], segment_ids=batch.get("segment_ids"),
            positions=batch.get("positions"), dropout_key=keys, run_order=True)  # [B, T, D]
        cross_entropy = kernels.active().cross_entropy(self, x, batch["targets"],
                                                       batch.get("weights"))
        terms, metrics = _report_metrics(report, batch["targets"].size)
        return cross_entropy + terms, {"cross_entropy": cross_entropy, **metrics}

    @_with_own_kernels
    def pipelined_loss(self, batch: dict[str, jax.Array], keys: jax.Array | None
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss_and_metrics` under a pipeline preset, the embedding, the block stack and the
        head handed to `minigpt.pipeline` as the schedule's pieces.

        Same value and gradients as without a pipeline, with the same per-row dropout keys;
        how the batch goes through the stages is the context's pipeline settings. The blocks'
        loss terms join the loss inside each stage, their counts are summed.
        """
        cfg = self.config
        # The pipeline differentiates the trainable parameters alone (with adapters: those).
        wrt, in_blocks = lora.trainable(self), nnx.PathContains("blocks")
        graphdef, blocks, frozen_blocks, rest, frozen_rest = nnx.split(
            self, nnx.All(in_blocks, wrt), in_blocks, wrt, ...)
        stand_in = loss.placeholders(nnx.merge_state(blocks, frozen_blocks))  # never read
        B, T = batch["inputs"].shape
        places = positions_in(parallel.sequence_order(T), B, T)
        batch = in_run_order(batch)
        inputs = {"tokens": batch["inputs"], "targets": batch["targets"],
                  "keys": None if keys is None else token_keys(keys, places),
                  "positions": batch.get("positions", places),
                  "segments": batch.get("segment_ids"), "weights": batch.get("weights")}

        def embed(rest, mb):
            model = nnx.merge(graphdef, stand_in(), _lookup_ready(rest))
            keys = None if mb["keys"] is None else fold_keys(mb["keys"], cfg.num_layers)
            return constrain(model.embed(mb["tokens"], mb["positions"], keys), ACTIVATION_AXES)

        def stage(chunk, x, mb, first_layer):
            attn = AttentionInputs(mb["positions"], mb["segments"])
            y, report = self.blocks.run_chunk(chunk["blocks"]["layers"], x, attn, mb["keys"],
                                              first_layer)
            terms = [v for v in report.values() if jnp.issubdtype(v.dtype, jnp.floating)]
            return y, sum(terms, jnp.zeros((), jnp.float32)), report

        def head(rest, y, targets, weights):
            model = nnx.merge(graphdef, stand_in(), rest)
            return kernels.active().cross_entropy(model, y, targets, weights) * targets.size

        loss_value, report = pipeline.loss(embed, stage, head, rest, blocks, inputs,
                                           frozen=(frozen_rest, frozen_blocks))
        terms, metrics = _report_metrics(report, batch["targets"].size)
        return loss_value, {"cross_entropy": loss_value - terms, **metrics}

    @_with_own_kernels
    def logits(self, x: jax.Array) -> jax.Array:
        """Output head: features [..., D] to float32 logits [..., V], vocabulary padding at -inf."""
        logits = self.head(x).astype(jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "seq", "vocab"))
        return mask_padded_vocab(logits, self.config.vocab_size)

    @_with_own_kernels
    def decode(self, tokens: jax.Array, positions: jax.Array, cache, layers: list | None = None,
               *, last: jax.Array | None = None):
        """Run tokens [B, T] at positions [B, T] against a cache; returns (logits, cache).
        With `layers` (`blocks.unstacked()`), on those, against a per-layer cache. With `last`
        [B], only the logits at each row's position `last[b]` of the T ([B, 1, V]): a prompt's
        prefill needs no more, and the head over every position of a long vocabulary costs
        more than a small model's layers.

        Row b's positions must be consecutive, starting where its cached prefix ends.
        """
        x = constrain(self.embed(tokens, positions), ACTIVATION_AXES)
        x, cache, _ = self.blocks(x, AttentionInputs(positions), cache, None, layers)
        if last is not None:
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
        return self.logits(x), cache

    def init_cache(self, batch: int, length: int, dtype=jnp.float32, *,
                   per_layer: bool = False):
        """An empty cache for `batch` rows of at most `length` positions (`per_layer`: one
        pair of arrays a layer, for `decode(layers=...)`)."""
        cfg = self.config
        return self.blocks.init_cache((batch, cfg.kv_heads, length, cfg.head_dim), dtype,
                                      per_layer=per_layer)


def _report_metrics(report: dict[str, jax.Array], positions: int
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The blocks' summed report as (its loss terms' sum, per position; metrics: each term per
    position, each count as it is)."""
    metrics = {k: v / positions if jnp.issubdtype(v.dtype, jnp.floating) else v
               for k, v in report.items()}
    terms = [v for k, v in metrics.items() if jnp.issubdtype(report[k].dtype, jnp.floating)]
    return sum(terms, jnp.zeros((), jnp.float32)), metrics


def count_params(model: nnx.Module, cfg: ModelConfig, *, active: bool = False) -> int:
    """Parameters a model really has: the vocabulary's padding rows are not counted. With
    `active`, those one token uses: of a mixture of experts' experts (the parameters with an
    `expert` axis), k of E."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            axes = node.get_metadata().get("out_sharding") or ()
            rows = cfg.vocab_size / cfg.padded_vocab if "vocab" in axes else 1
            if active and "expert" in axes:
                rows = cfg.experts_per_token / cfg.num_experts
            total += round(node.size * rows)
    return total
