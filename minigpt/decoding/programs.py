"""What the engine's programs compute: prompts prefilled into slots, and decode steps for the
slots in use (compiled and kept by `minigpt.decoding.compiled`).

A slot is a row of the key/value cache ([L, S, K, C, H], or per layer [S, K, C, H]) and of the
slot state (`Slots`): its last token and the position it runs at, how many tokens its request
drew (the number folded into its key), how many it may still draw, whether it is done, its stop
ids and its sampling settings. `prefill` runs n prompts into n slots and draws each one's first
token; `decode` runs up to `count` steps for the b slots in use (gathered from the S, then put
back: a person chatting alone runs a program of one row, not of every slot), and stops early
once every one of them is done: a stop id drawn, its limit reached, or its cache rows full (the
engine then starts its next window). A slot's rows are its own, and a key is visible only at or
before its query's position, so a request's tokens do not depend on what runs beside it.

How the programs compute is decided here, once, for every client (evaluation's scores too,
`token_scores`): the weights each layer
multiplies are cast to its compute dtype once (`in_compute_dtypes`), on a CPU each layer runs
on weights of its own (`default_how`), projections contract in their kernels' order
(`layers.in_kernel_order`: no weight copied at every step), and products are plain ones
whatever `model.fp8` says
(a step of one token a row is bound by reading the weights, which FP8 would quantize afresh
every step; prompts run the same products, so every door gives the same numbers).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import minigpt.models.fp8 as fp8
from minigpt import sharding
from minigpt.decoding.sampler import TOP, Sampling, choose
from minigpt.models import DecoderLM, execution
from minigpt.models.layers import Dense, Embedding, in_kernel_order
from minigpt.models.loss import target_logits

STOP_IDS = 8  # stop ids a slot checks on the device (the host checks every one)
HOWS = ("per layer", "scanned", "unrolled")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
    """Each slot's state [S]: its last token and where it runs, the tokens drawn (`count`) and
    still allowed (`left`), whether it is `done`, its stop ids [S, STOP_IDS] (-1: none) and
    how it draws."""

    token: jax.Array
    position: jax.Array
    count: jax.Array
    left: jax.Array
    done: jax.Array
    stops: jax.Array
    sampling: Sampling

    @staticmethod
    def empty(slots: int) -> Slots:
        """Idle slots, as host arrays (placed on the devices in one transfer)."""
        def zeros():
            return np.zeros(slots, np.int32)

        return Slots(token=zeros(), position=zeros(), count=zeros(), left=zeros(),
                     done=np.ones(slots, bool), stops=np.full((slots, STOP_IDS), -1, np.int32),
                     sampling=Sampling(temperature=np.zeros(slots, np.float32), top_k=zeros(),
                                       top_p=np.ones(slots, np.float32),
                                       min_p=np.zeros(slots, np.float32),
                                       key=np.zeros((slots, 2), np.uint32)))


def _slot_axis(array: jax.Array) -> int:
    return array.ndim - 4  # [(L,) S, K, C, H]


def _take(tree, rows):
    return jax.tree.map(lambda c: jnp.take(c, rows, axis=_slot_axis(c), mode="clip"), tree)


def _put(tree, rows, sub):
    def one(c, s):
        index = (slice(None),) * _slot_axis(c) + (rows,)
        return c.at[index].set(s.astype(c.dtype), mode="drop")

    return jax.tree.map(one, tree, sub)


def _finished(token, position, left, stops, *, length: int) -> jax.Array:
    return jnp.any(token[:, None] == stops, axis=-1) | (left <= 0) | (position >= length)


def decode(graphdef, weights, layers, cache, slots: Slots, rows, count, *, length: int,
           most: int, whole: bool, sample: bool, want: int):
    """Up to `count` (traced, 1 to `most`) decode steps for the slots `rows` [b] (a number
    past the slots: padding), ending early once all of them are done; with `whole` (b is the
    number of slots) every slot runs in its place and nothing is gathered. `sample`: whether
    any row may sample (else every row takes the argmax); `want`: what is reported of the
    tokens, as `sampler.choose` takes it. Returns (cache, slots, drawn, steps): drawn's arrays
    stacked over the steps [most, b, ...] (token, log-probability, TOP ids and
    log-probabilities; rows past `steps`, and what `want` leaves out, zeros)."""
    S = slots.token.shape[0]
    if whole:  # every slot runs; those not asked for count as done
        sub_cache, sub = cache, slots
        asked = jnp.zeros(S, bool).at[rows].set(True, mode="drop")
    else:
        sub_cache = _take(cache, rows)
        sub = jax.tree.map(lambda a: jnp.take(a, rows, axis=0, mode="clip"), slots)
        asked = rows < S
    sub = dataclasses.replace(sub, done=sub.done | ~asked)
    b = sub.token.shape[0]
    shapes = [(most, b), (most, b), (most, b, TOP), (most, b, TOP)]
    dtypes = [jnp.int32, jnp.float32, jnp.int32, jnp.float32]
    kept = 1 + (want > 0) + 2 * (want > 1)  # how many of the four outputs are carried
    out = tuple(jnp.zeros(shape, dtype) for shape, dtype in zip(shapes[:kept], dtypes))

    def going(carry):
        i, _, s, _ = carry
        return (i < count) & ~jnp.all(s.done)

    def step(carry):
        i, cache, s, out = carry
        model = nnx.merge(graphdef, weights)
        at = jnp.minimum(s.position, length - 1)
        logits, cache = model.decode(s.token[:, None], at[:, None], cache, layers)
        drawn = choose(logits[:, 0], s.sampling, s.count, ~s.done, want, sample=sample)
        token, position, left = drawn[0], s.position + 1, s.left - 1
        done = s.done | _finished(token, position, left, s.stops, length=length)

        def keep(new, old):
            return jnp.where(s.done, old, new)

        s = dataclasses.replace(s, token=keep(token, s.token), position=keep(position, s.position),
                                count=keep(s.count + 1, s.count), left=keep(left, s.left),
                                done=done)
        return i + 1, cache, s, tuple(o.at[i].set(d) for o, d in zip(out, drawn))

    with fp8.suspended(), in_kernel_order():
        steps, sub_cache, sub, out = jax.lax.while_loop(going, step, (0, sub_cache, sub, out))
    out = (*out, *(jnp.zeros(shape, dtype) for shape, dtype in zip(shapes[kept:], dtypes[kept:])))
    if whole:
        return sub_cache, sub, out, steps
    slots = jax.tree.map(lambda a, s: a.at[rows].set(s, mode="drop"), slots, sub)
    return _put(cache, rows, sub_cache), slots, out, steps


def prefill(graphdef, weights, layers, cache, slots: Slots, rows, tokens, lengths, counts, left,
            stops, sampling: Sampling, want, *, length: int, prompt_logprobs: bool):
    """Run n prompts, tokens [n, P] right-padded (prompt j's first `lengths[j]` real), into
    the slots `rows` [n] (a number past the slots: padding, dropped): each prompt's keys and
    values fill its slot's first P cache rows (those past its length are overwritten before any
    query can see them), and its next token is drawn from its last position's logits as token
    number `counts[j]` of its request, which may then draw `left[j]` more. With
    `prompt_logprobs`, also every prompt token's log-probability given the ones before it
    [n, P - 1] and each position's TOP alternatives [n, P, TOP]. Returns (cache, slots, drawn,
    prompt or None)."""
    with fp8.suspended(), in_kernel_order():
        model = nnx.merge(graphdef, weights)
        n, P = tokens.shape
        fresh = model.init_cache(n, P, dtype=cache_dtype(model), per_layer=layers is not None)
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (n, P))
        # [n, P, V] where the prompt's own log-probabilities are asked, else [n, 1, V]
        logits, fresh = model.decode(tokens, positions, fresh, layers,
                                     last=None if prompt_logprobs else lengths - 1)
    last = (jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
            if prompt_logprobs else logits)[:, 0]  # [n, V]
    drawn = choose(last, sampling, counts, jnp.ones(n, bool), want)
    cache = jax.tree.map(lambda c, f: c.at[(slice(None),) * _slot_axis(c) + (
        rows, slice(None), slice(0, P))].set(f.astype(c.dtype), mode="drop"), cache, fresh)
    new = Slots(token=drawn[0], position=lengths, count=counts + 1, left=left - 1,
                done=_finished(drawn[0], lengths, left - 1, stops, length=length),
                stops=stops, sampling=sampling)
    slots = jax.tree.map(lambda a, s: a.at[rows].set(s, mode="drop"), slots, new)
    prompt = None
    if prompt_logprobs:
        logprobs = jax.nn.log_softmax(logits, axis=-1)  # [n, P, V]
        given = jnp.take_along_axis(logprobs[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
        prompt = (given, top_ids.astype(jnp.int32), top_logprobs)
    return cache, slots, drawn, prompt


def cache_dtype(model: DecoderLM):
    return execution.compute_dtype(model.config.dtype)


def compute_dtypes(model: nnx.Module) -> dict[tuple, Any]:
    """The dtype each `Dense` and `Embedding` layer casts its weights to on every call, by
    their paths: a kernel to its products' operands, a bias and a table to what the layer
    computes in (a table is also looked up, in that dtype: on a CPU's bfloat16, float32)."""
    return {(*path, name): layer.operands if name == "kernel" else layer.dtype
            for path, layer in nnx.iter_graph(model)
            if isinstance(layer, Dense | Embedding) for name in ("kernel", "bias", "table")}


def in_compute_dtypes(model: nnx.Module, weights: nnx.State) -> nnx.State:
    """`weights` (the model's state) with the kernels, biases and tables of its `Dense` and
    `Embedding` layers cast to the dtype each of them computes in, which is what those layers
    cast them to on every call: the same values, so the same tokens.

    Cast once rather than in every step: XLA left the casts of float32 parameters inside the
    decode loop (the stacked weights' per-layer slices converted at every token), so a
    bfloat16 decode read the float32 weights, wrote them as bfloat16 and read them again for
    each token. Other parameters (norms' scales and biases, which the norms use in float32;
    adapters) are left as they are. The casts run as one program.
    """
    if execution.operand_dtype(model.config.dtype) == "float32":
        return weights  # parameters are float32, and so is what every product takes
    dtypes = compute_dtypes(model)
    flat = list(nnx.to_flat_state(weights))
    todo = [(i, jnp.dtype(dtypes[path]).name) for i, (path, variable) in enumerate(flat)
            if dtypes.get(path) not in (None, variable.get_value().dtype)]
    if not todo:
        return weights
    values = _cast([flat[i][1].get_value() for i, _ in todo], dtypes=tuple(d for _, d in todo))
    for (i, _), value in zip(todo, values):
        path, variable = flat[i]
        flat[i] = (path, variable.replace(value))
    return nnx.from_flat_state(flat)


@functools.partial(jax.jit, static_argnames=("dtypes",))
def _cast(values: list, *, dtypes: tuple[str, ...]) -> list:
    return [v.astype(d) for v, d in zip(values, dtypes)]


EMPTY: dict[tuple, Any] = {}  # the compiled zeros of a cache, by model structure and shape


def empty_cache(graphdef, state, *, slots: int, length: int, per_layer: bool):
    """Zeros for every slot's keys and values, laid out by the active context's rules: one
    compiled program per model structure, shape and context, which holds no weights (only
    their shapes)."""
    key = (graphdef, slots, length, per_layer, sharding.active())
    if key not in EMPTY:
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        model = nnx.merge(graphdef, shapes)
        EMPTY[key] = jax.jit(lambda: model.init_cache(slots, length, dtype=cache_dtype(model),
                                                       per_layer=per_layer))
    return EMPTY[key]()


def served_weights(model: DecoderLM, graphdef, state, how: str):
    """The weights the programs read: `state` in the layers' compute dtypes and, with "per
    layer", each layer's blocks as arrays of their own (copied in one program, not an eager
    copy per array)."""
    state = in_compute_dtypes(model, state)
    return state, (_unstacked(graphdef, state, context=sharding.active())
                   if how == "per layer" else None)


@functools.partial(jax.jit, static_argnames=("graphdef", "context"))
def _unstacked(graphdef, state, *, context):
    return nnx.merge(graphdef, state).blocks.unstacked()


def default_how(model: DecoderLM) -> str:
    """How the layers run: on a CPU, each layer on weights of its own ("per layer":
    `BlockStack.unstacked`, a copy of the blocks' weights beside the model's), elsewhere as
    the model runs them. XLA on a CPU copies each slice of a stacked weight that a product
    reads, scanned or unrolled alike: a decode step of SmolLM2-135M's shape (30 layers) for 16
    slots of 160 positions took 77.5 ms per layer against 131.7 scanned, the `stories-cpu`
    model's (3 layers) 2.1 ms against 2.7 unrolled and 3.7 scanned (2-core CPU, 2026-11-28)."""
    if execution.backend() == "cpu":
        return "per layer"
    return "scanned" if model.blocks.scan else "unrolled"


def sizes(limit: int, smallest: int) -> list[int]:
    """Powers of two from `smallest` below `limit`, then `limit`: the prompt lengths prefill
    compiles for (log2(limit / smallest) + 1 of them at most)."""
    out, size = [], smallest
    while size < limit:
        out.append(size)
        size *= 2
    return [*out, limit]


def counts(slots: int) -> list[int]:
    """The row counts programs compile for, up to `slots`: 1, 4, 16, ... and `slots`."""
    return sorted({*(4 ** i for i in range(16) if 4 ** i < slots), slots})


# The scores of evaluation's rows (`minigpt.eval.scoring`): float32 logits one slice of the head
# may hold (128 MiB).
LOGIT_FLOATS = 1 << 25


@sharding.jit
def token_scores(model, inputs: jax.Array, segments: jax.Array | None, places: jax.Array,
                 wanted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For inputs [B, T]: log p(wanted) at the positions `places` [B, C] and whether it is
    the argmax there [B, C]. The head runs at those positions alone, a slice at a time, and
    the products are plain ones whatever `model.fp8` says, as in every program here."""
    with fp8.suspended():
        x = model.features(inputs, segment_ids=segments)  # [B, T, D]
        x = jnp.take_along_axis(x, places[:, :, None], axis=1)  # [B, C, D]
        B, C = places.shape
        step = max(1, min(C, LOGIT_FLOATS // (B * model.config.padded_vocab)))
        scores, hits = [], []
        for a in range(0, C, step):
            logits = model.logits(x[:, a:a + step])  # [B, c, V] float32, padding at -inf
            target = wanted[:, a:a + step]
            scores.append(target_logits(logits, target) - jax.nn.logsumexp(logits, axis=-1))
            hits.append(jnp.argmax(logits, axis=-1) == target)
    return jnp.concatenate(scores, axis=1), jnp.concatenate(hits, axis=1)
