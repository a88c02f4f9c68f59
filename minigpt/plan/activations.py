"""What one layer keeps for its backward pass, found by tracing the architecture's own block.

The activations a train step holds at its peak are mostly what each layer of the block stack
saves in its forward pass for the backward (the *residuals* of the layer's vector-Jacobian
product), times the layers, or what rematerialisation (`model.remat`) trades them for. Rather
than a formula per architecture, the plan traces one block of the model as one device runs it
(`jax.make_jaxpr` of `jax.vjp`; shapes only, nothing computed or compiled): its heads and
feed-forward units as the preset leaves them (tensor parallelism), with the kernels the step
would run (`minigpt.models.kernels`), the dropout it would draw and the adapters it carries.
The backward is traced too, from those residuals, and only the residuals it reads are counted
(the stack's scan keeps no others: measured against XLA's stacked buffers, bench/RESULTS.md).
The weights are held anyway and are not counted; the layer's input is, where the backward
reads it (post-norm blocks).

Residuals grow linearly with the rows, those shaped like the layer's weights aside, so a block
is traced with one row and scaled; a long sequence is traced at two short lengths and extended
(a linear and a quadratic term in the positions). Where a preset splits the sequence (context
parallelism), attention runs round the ring (`minigpt.parallel.ring`), which keeps its queries,
keys, values, output and log-sum-exp, as the fused attention kernels of accelerators do; the
rest of the layer is position by position, so its residuals scale with the positions a device
holds. Each distinct split of the heads is traced once and remembered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt import sharding
from minigpt.config import ModelConfig
from minigpt.models import kernels as kernel_sets
from minigpt.models import lora
from minigpt.models.masks import AttentionInputs

try:  # jax's own dead-code elimination, which sees into nested jaxprs
    from jax._src.interpreters.partial_eval import dce_jaxpr
except ImportError:  # pragma: no cover - a jax without it: every residual counts
    dce_jaxpr = None

F32 = 4
FUSED = ("cudnn", "splash")  # minigpt.models.kernels' fused attention kernels
BLOCK = kernel_sets.ATTENTION_BLOCK  # the CPU kernels' attention block of queries
SHORT = 256  # positions up to which a layer is traced at its own length


@dataclasses.dataclass(frozen=True)
class LayerTrace:
    """Bytes one layer holds per row of its input: `saved`, the residuals its backward reads;
    `largest`, the largest of them; `input`, the layer's input (what a rematerialised layer
    keeps); and `fixed`, per layer whatever the rows."""

    saved: int
    largest: int
    input: int
    fixed: int = 0  # per layer whatever the rows (16-bit weight casts, experts' weight copies)
    narrow: int = 0  # of `saved`, the bytes in 16-bit types (bfloat16 activations)


class Sizes(NamedTuple):
    """What a trace finds, in bytes: every residual (`total`, `largest`, those in 16-bit types:
    `narrow`) and of them those shaped like a weight of the layer (`fixed`, `fixed_narrow`:
    its weights cast to a 16-bit compute dtype, or copied into a region of their own), which do
    not grow with the rows."""

    total: int
    largest: int
    narrow: int
    fixed: int = 0
    fixed_narrow: int = 0


@dataclasses.dataclass(frozen=True)
class Split:
    """How one device's layer is cut: its heads, key/value heads, feed-forward units."""

    heads: int
    kv_heads: int
    mlp: int


class BlockTracer:
    """Traces a model's block at each split it is asked for, once."""

    def __init__(self, model: nnx.Module, cfg: ModelConfig, kernels: str, *, adapted: bool,
                 dropping: bool, documents: bool):
        self.cfg, self.dropping, self.documents = cfg, dropping, documents
        # A fused attention kernel (cuDNN's, Splash) keeps what a ring keeps: traced with the
        # plain kernels, its attention's residuals are replaced by those.
        self.fused = kernels in FUSED
        self.kernels = "reference" if self.fused else kernels
        self.wrt = nnx.LoRAParam if adapted else nnx.Param  # a frozen base trains no weight
        self.graphdef, self.trained, self.frozen = nnx.split(model.blocks.layers, self.wrt, ...)
        self._cache: dict[tuple, tuple] = {}

    def layer(self, split: Split, positions: int, sequence: int) -> LayerTrace:
        """One layer at this split on `positions` of each row's `sequence` positions (fewer:
        the sequence is split over devices, and attention runs round their ring)."""
        cfg = self.cfg
        saved, largest, fixed, narrow = self._block(split, sequence)
        if positions != sequence or self.fused:  # the attention's residuals apart
            attention = self._attention(split, sequence).total
            rest = (saved - attention) * positions // sequence
            a = jnp.dtype(cfg.dtype).itemsize
            H = cfg.head_dim
            own = positions * H * (2 * split.heads + 2 * split.kv_heads) * a \
                + positions * split.heads * F32  # q, k, v, out and the log-sum-exp
            # the largest residual left, attention's gone: the feed-forward's hidden layer's
            largest = max(positions * max(split.mlp, cfg.embed_dim) * a, own // 4)
            saved = rest + own
            narrow = narrow * positions // sequence
        x = positions * cfg.embed_dim * jnp.dtype(cfg.dtype).itemsize
        return LayerTrace(saved=saved, largest=largest, input=x, fixed=fixed, narrow=narrow)

    def _block(self, split: Split, T: int) -> tuple[int, int, int, int]:
        """(bytes per row, the largest per row, bytes per layer whatever the rows, bytes per row
        in 16-bit types), from one row's trace: the residuals shaped like the layer's weights
        (its weights cast to a 16-bit compute dtype; a mixture of experts' copied into the
        region that dispatches its tokens, `minigpt.parallel.experts`, traced as the step runs
        it: its batch split over a mesh axis, here of one device) do not grow with the rows."""
        key = ("block", split, T)
        if key not in self._cache:
            dispatch = contextlib.nullcontext()
            if self.cfg.num_experts:
                dispatch = contextlib.ExitStack()
                dispatch.enter_context(jax.sharding.use_abstract_mesh(
                    jax.sharding.AbstractMesh((1,), ("data",))))
                dispatch.enter_context(sharding.running(rules=(("batch", "data"),)))
            with dispatch:
                found = self._sized(split, T, attention_only=False)
            per_row = found.total - found.fixed
            self._cache[key] = (per_row, min(found.largest, per_row), found.fixed,
                                found.narrow - found.fixed_narrow)
        return self._cache[key]

    def _attention(self, split: Split, T: int) -> Sizes:
        key = ("attention", split, T)
        if key not in self._cache:
            self._cache[key] = self._sized(split, T, attention_only=True)
        return self._cache[key]

    def _sized(self, split: Split, T: int, *, attention_only: bool) -> Sizes:
        """`_trace` at T positions. A long sequence is traced at two short lengths instead
        (a trace's cost grows with the blocks attention runs in) and the sizes found are
        extended to T as what they are: a term growing with the positions, and one with their
        square (attention's scores, whole or block by block); the weights' copies do not
        change. The short lengths take the same attention path as T
        (`minigpt.models.kernels`: blocks of 64 queries where T divides by 64, XLA's attention
        elsewhere)."""
        if T <= SHORT:
            return self._trace(split, T, attention_only=attention_only)
        short = (2 * BLOCK, 4 * BLOCK) if T % BLOCK == 0 else (3 * BLOCK // 2, 5 * BLOCK // 2)
        one, two = (self._trace(split, t, attention_only=attention_only) for t in short)

        def extend(a: int, b: int) -> int:  # a = p t1 + q t1^2, b = p t2 + q t2^2 -> at T
            (t1, t2), det = short, short[0] * short[1] ** 2 - short[1] * short[0] ** 2
            p = (a * t2**2 - b * t1**2) / det
            q = (b * t1 - a * t2) / det
            return max(round(p * T + q * T * T), 0)

        grown = [extend(a - fa, b - fb) for a, b, fa, fb in zip(
            one[:3], two[:3], (one.fixed, 0, one.fixed_narrow), (two.fixed, 0, two.fixed_narrow))]
        return Sizes(grown[0] + one.fixed, grown[1], grown[2] + one.fixed_narrow, one.fixed,
                     one.fixed_narrow)

    def _local(self, state, split: Split):
        """A layer's weights (the stacked axis dropped) as one device computes with them."""
        cfg = self.cfg
        ways = {"heads": cfg.num_heads // split.heads, "kv_heads": cfg.kv_heads // split.kv_heads,
                "mlp": cfg.expert_dim // split.mlp}

        def one(var):
            axes = var.get_metadata().get("out_sharding") or ()
            shape = [d // ways.get(a, 1) for d, a in zip(var.shape, axes)][1:]
            return var.replace(jax.ShapeDtypeStruct(tuple(shape), var.dtype))

        return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def _trace(self, split: Split, T: int, *, attention_only: bool) -> Sizes:
        """The residuals of one row of a layer of T positions, or of its attention."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        with sharding.running(kernels=self.kernels):
            if attention_only:
                H = cfg.head_dim
                args = (jax.ShapeDtypeStruct((1, T, split.heads, H), dtype),
                        *[jax.ShapeDtypeStruct((1, T, split.kv_heads, H), dtype)] * 2)
                attn = self._attention_inputs(T)
                return _residuals(kernel_sets.active().causal_attention, args, (attn,),
                                  weights=False)
            x = jax.ShapeDtypeStruct((1, T, cfg.embed_dim), dtype)
            keys = jax.ShapeDtypeStruct((1, T), jax.random.key(0).dtype) if self.dropping \
                else None
            graphdef = self.graphdef

            def layer(trained, x, frozen, keys, attn):
                block = nnx.merge(graphdef, trained, frozen)
                with lora.dropout_keys(keys):
                    return block(x, attn, None, keys)[0]

            return _residuals(layer, (self._local(self.trained, split), x),
                              (self._local(self.frozen, split), keys, self._attention_inputs(T)),
                              weights=True)

    def _attention_inputs(self, T: int) -> AttentionInputs:
        """A row's attention inputs as the step's are: positions, and its documents' ids
        where documents are kept apart (shapes only)."""
        row = jax.ShapeDtypeStruct((1, T), jnp.int32)
        return AttentionInputs(row, row if self.documents else None)


def _residuals(fn, args: tuple, consts: tuple, *, weights: bool) -> Sizes:
    """The residuals of fn(*args, *consts)'s VJP with respect to `args` that its backward
    reads; with `weights`, args[0] and consts[0] are the layer's weights (trained and frozen),
    held anyway and not counted, and residuals of their shapes are `fixed`."""
    treedef = {}

    def forward(args, consts):
        _, pull = jax.vjp(lambda *a: fn(*a, *consts), *args)
        leaves, treedef["pull"] = jax.tree.flatten(pull)
        return leaves

    fwd = jax.make_jaxpr(forward)(args, consts)
    outs = fwd.jaxpr.outvars

    def backward(leaves, g):
        return jax.tree.unflatten(treedef["pull"], leaves)(g)

    bwd = jax.make_jaxpr(backward)([jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                    for v in outs], jax.eval_shape(fn, *args, *consts))
    if dce_jaxpr is not None:
        _, used = dce_jaxpr(bwd.jaxpr, [True] * len(bwd.jaxpr.outvars))
    else:  # pragma: no cover
        used = [True] * len(bwd.jaxpr.invars)
    held, shapes = set(), set()
    if weights:  # the invars are args' leaves, then consts' leaves
        n_args, n_trained = len(jax.tree.leaves(args)), len(jax.tree.leaves(args[0]))
        invars = fwd.jaxpr.invars
        mine = invars[:n_trained] + invars[n_args:n_args + len(jax.tree.leaves(consts[0]))]
        held, shapes = {id(v) for v in mine}, {v.aval.shape for v in mine}
    seen, sizes = set(), [0, 0, 0, 0, 0]  # total, largest, narrow, fixed, fixed narrow
    for var, read in zip(outs, used):
        if not read or not hasattr(var, "aval") or id(var) in held or id(var) in seen:
            continue
        seen.add(id(var))
        size = math.prod(var.aval.shape) * var.aval.dtype.itemsize
        narrow = size if var.aval.dtype.itemsize == 2 else 0
        fixed = var.aval.shape in shapes
        sizes = [sizes[0] + size, max(sizes[1], size) if not fixed else sizes[1],
                 sizes[2] + narrow, sizes[3] + size * fixed, sizes[4] + narrow * fixed]
    return Sizes(*sizes)
