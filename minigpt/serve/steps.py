"""The serving engine's compiled programs: decode steps for every slot, and prefills by prompt
length and count.

The engine keeps a fixed number of decode slots. Their key/value cache is one pair of arrays
[L, S, K, C, H] (layers, slots, KV heads, positions, head features), and what each slot decodes
next lives on the device beside it (`SlotState`: its last token, its position, its sampling
settings and random key), so a step needs nothing from the host and its outputs feed the next
step directly: the host reads one call's tokens while the next call runs. One compiled program
runs a given number of decode steps (a loop: a call of a small model's steps costs more to
start than to run, a call of a large one's the other way round, `Engine` chooses). A prefill
runs the prompts that arrived together, right-padded to a length bucket, into a cache of that
length, writes those rows into their slots' and draws their first tokens. Both draw tokens the
same way (`draw.choose`), each slot with its own settings.

A prefill of a new shape (count and length bucket) is compiled in the background while a larger
compiled one (more rows, a longer bucket: padding is dropped, and no query sees a key past its
own position) serves its prompts, so that a new mix of arrivals does not stall every stream for
a compile (3.1 s for `stories-cpu`'s 4 x 32 on a 2-core CPU, 2026-11-28); a call waits for a
compile only where no compiled prefill holds its prompts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import minigpt.models.kernels as kernels
from minigpt.models import DecoderLM, execution
from minigpt.serve.draw import TOP, choose


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What each slot decodes next, one entry per slot [S] (keys [S, 2]): its last token and
    the position it goes in, its sampling settings, its random key and how many tokens it has
    drawn (the index folded into the key)."""

    token: jax.Array
    position: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    key: jax.Array
    count: jax.Array

    @staticmethod
    def empty(slots: int) -> SlotState:
        return SlotState(token=jnp.zeros(slots, jnp.int32), position=jnp.zeros(slots, jnp.int32),
                         temperature=jnp.zeros(slots, jnp.float32),
                         top_p=jnp.ones(slots, jnp.float32),
                         key=jnp.zeros((slots, 2), jnp.uint32), count=jnp.zeros(slots, jnp.int32))


def seed_key(seed: int) -> np.ndarray:
    """A request's seed as the raw key data a slot keeps: threefry's two words, [0, seed]
    (jax.random.key(seed)'s under JAX's default), written without a call to the device;
    `draw.choose` wraps them as a threefry key whatever JAX's default is."""
    return np.asarray([0, seed % 2**32], np.uint32)


def cache_dtype(model: DecoderLM):
    return kernels.compute_dtype(model.config.dtype)


def decode_step(graphdef, weights, layers, cache, slots: SlotState, active, want, *,
                length: int):
    """One token for every slot: each runs its last token at its position against its cache
    rows and draws the next (`active` [S]: the slots that hold a request; `want`: what any of
    them asks to know of its tokens, as `draw.choose` takes it; `layers`: the layers'
    weights one by one, or None: the model's stack). A slot's position stops at the cache's
    last row (`length` - 1), so an idle slot never writes outside it. Returns (cache, slots,
    drawn)."""
    model = nnx.merge(graphdef, weights)
    logits, cache = model.decode(slots.token[:, None], slots.position[:, None], cache, layers)
    drawn = choose(logits[:, 0], slots.temperature, slots.top_p, slots.key, slots.count,
                   active, want)
    slots = dataclasses.replace(slots, token=drawn[0],
                                position=jnp.minimum(slots.position + 1, length - 1),
                                count=slots.count + 1)
    return cache, slots, drawn


def decode_steps(graphdef, weights, layers, cache, slots: SlotState, active, want, count, *,
                 length: int, most: int):
    """`count` (traced, 1 to `most`) decode steps in one program, a loop that the same
    compilation runs for any count: what one call of the engine runs. Returns (cache, slots,
    drawn) with each of drawn's arrays stacked over the steps [most, S, ...] (rows past
    `count` zeros)."""
    S = slots.token.shape[0]
    out = (jnp.zeros((most, S), jnp.int32), jnp.zeros((most, S), jnp.float32),
           jnp.zeros((most, S, TOP), jnp.int32), jnp.zeros((most, S, TOP), jnp.float32))

    def one(i, carry):
        cache, slots, out = carry
        cache, slots, drawn = decode_step(graphdef, weights, layers, cache, slots, active,
                                          want, length=length)
        return cache, slots, tuple(o.at[i].set(d) for o, d in zip(out, drawn))

    return jax.lax.fori_loop(0, count, one, (cache, slots, out))


def prefill(graphdef, weights, layers, cache, slots: SlotState, rows, tokens, lengths,
            temperature, top_p, key, want, *, prompt_logprobs: bool):
    """Run n prompts, tokens [n, P] right-padded (prompt j's first `lengths[j]` real), into
    the slots `rows` [n] (a row numbered past the slots is padding, dropped): each prompt's
    keys and values fill its slot's first P cache rows (those past its length are overwritten
    before any query can see them: a key is visible only at or before its query's position),
    and its first token is drawn from its last real position's logits, with its own sampling
    settings [n] and key [n, 2]. With `prompt_logprobs`, also every prompt token's
    log-probability given the ones before it [n, P - 1] and each position's TOP alternatives
    [n, P, TOP]. Returns (cache, slots, drawn, prompt or None)."""
    model = nnx.merge(graphdef, weights)
    n, P = tokens.shape
    fresh = model.init_cache(n, P, dtype=cache_dtype(model), per_layer=layers is not None)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (n, P))
    logits, fresh = model.decode(tokens, positions, fresh, layers)  # [n, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [n, V]
    drawn = choose(last, temperature, top_p, key, jnp.zeros(n, jnp.int32), jnp.ones(n, bool),
                   want)
    # [(L,) S, K, C, H]: the slots' axis is the fourth from the end, stacked or per layer
    cache = jax.tree.map(lambda c, f: c.at[..., rows, :, :P, :].set(f.astype(c.dtype),
                                                                     mode="drop"),
                         cache, fresh)

    def put(values, new):
        return values.at[rows].set(new, mode="drop")

    slots = SlotState(token=put(slots.token, drawn[0]), position=put(slots.position, lengths),
                      temperature=put(slots.temperature, temperature),
                      top_p=put(slots.top_p, top_p), key=put(slots.key, key),
                      count=put(slots.count, jnp.ones(n, jnp.int32)))
    prompt = None
    if prompt_logprobs:
        logprobs = jax.nn.log_softmax(logits, axis=-1)  # [n, P, V]
        given = jnp.take_along_axis(logprobs[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
        prompt = (given, top_ids.astype(jnp.int32), top_logprobs)
    return cache, slots, drawn, prompt


class Programs:
    """The compiled programs for one model and one cache shape: `step` (the decode steps, up
    to `most` a call, compiled once) and `prefill` (compiled once per batch bucket, length
    bucket and whether it reports the prompt's log-probabilities; `compiled` lists them, for
    the log and /health). The cache and slot state are donated: each call hands back the ones
    to use next."""

    def __init__(self, model: DecoderLM, slots: int, length: int, *, smallest: int = 32,
                 how: str | None = None, most: int = 64,
                 context: Callable[[], Any] = contextlib.nullcontext,
                 log: Callable[[str], None] = lambda line: None):
        self.how = how or default_how(model)
        if self.how not in HOWS:
            raise ValueError(f"how the layers run: one of {HOWS}, got {self.how!r}")
        served = model
        if self.how != "per layer" and model.blocks.scan != (self.how == "scanned"):
            served = nnx.merge(*nnx.split(model))  # the same arrays; only how the stack runs
            served.blocks.scan = self.how == "scanned"
        self.graphdef, self.weights = nnx.split(served)
        self.layers = served.blocks.unstacked() if self.how == "per layer" else None
        self.slots, self.length, self.most = slots, length, most
        self.buckets = buckets(length, smallest)
        # Prompts that arrive together are prefilled together, in batches of these sizes.
        self.batches = sorted({*(4 ** i for i in range(8) if 4 ** i < slots), slots})
        self.compiled: list[str] = []
        self.context, self.log = context, log
        self._step = jax.jit(functools.partial(decode_steps, self.graphdef, length=length,
                                               most=most), donate_argnums=(2, 3))
        self._prefills: dict[tuple[int, int, bool], Any] = {}  # (n, P, logprobs) -> compiled
        self._compiling: set[tuple[int, int, bool]] = set()  # in the background
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, "minigpt-serve-compile")
        self._empty = jax.jit(lambda: model.init_cache(
            slots, length, dtype=cache_dtype(model), per_layer=self.layers is not None))

    @property
    def most_prefills(self) -> int:
        """Prefill programs at most: one per batch and length bucket, and one per length
        bucket for the prompts whose log-probabilities are asked (each prefilled alone)."""
        return (len(self.batches) + 1) * len(self.buckets)

    def empty(self):
        """A fresh cache ([L, S, K, C, H] x 2, or per layer [S, K, C, H] x 2) and slot
        state."""
        return self._empty(), SlotState.empty(self.slots)

    # Arguments go in as NumPy values: the jitted call moves them with the rest, where each
    # jnp.asarray would be an eager operation of its own (about a millisecond apiece).
    def step(self, cache, slots: SlotState, active: np.ndarray, want: int, count: int = 1):
        """`count` decode steps (1 to `most`) for every slot."""
        return self._step(self.weights, self.layers, cache, slots, active, np.int32(want),
                          np.int32(count))

    def prefill(self, cache, slots: SlotState, rows: list[int], prompts: list[list[int]], *,
                temperature: list[float], top_p: list[float], keys: list[np.ndarray],
                want: int, prompt_logprobs: bool):
        """Prefill `prompts` into the slots `rows` at once, right-padded to the length bucket
        of the longest and, in number, to a batch bucket (`batches`): by the program of that
        shape, or while it compiles in the background by the smallest compiled one that
        holds the prompts (compiling now where none does)."""
        P = next(b for b in self.buckets if b >= max(map(len, prompts)))
        n = next(b for b in self.batches if b >= len(prompts))
        shape = (n, P, prompt_logprobs)
        holds = [] if shape in self._prefills else [
            s for s in tuple(self._prefills)  # (a background compile may add one)
            if s[2] == prompt_logprobs and s[0] >= n and s[1] >= P]
        if holds:
            if shape not in self._compiling:
                args = self._prefill_args(cache, slots, rows, prompts, n, P, temperature,
                                          top_p, keys, want)
                self._compiling.add(shape)
                self._compiler.submit(self._compile, shape, jax.tree.map(_abstract, args),
                                      background=True)
            shape = min(holds, key=lambda s: s[0] * s[1])
        args = self._prefill_args(cache, slots, rows, prompts, *shape[:2], temperature, top_p,
                                  keys, want)
        if shape not in self._prefills:  # no compiled prefill holds these prompts
            self._compile(shape, args, background=False)
        return self._prefills[shape](*args)

    def _prefill_args(self, cache, slots, rows, prompts, n, P, temperature, top_p, keys, want):
        """A prefill program's arguments: the prompts padded to n rows of P tokens (a padding
        row's slot number is past the slots: dropped)."""
        pad = n - len(prompts)
        tokens = np.zeros((n, P), np.int32)
        for j, prompt in enumerate(prompts):
            tokens[j, :len(prompt)] = prompt
        return (self.weights, self.layers, cache, slots,
                np.asarray([*rows, *[self.slots] * pad], np.int32),
                tokens, np.asarray([*map(len, prompts), *[1] * pad], np.int32),
                np.asarray([*temperature, *[0.0] * pad], np.float32),
                np.asarray([*top_p, *[1.0] * pad], np.float32),
                np.asarray([*keys, *[np.zeros(2, np.uint32)] * pad], np.uint32),
                np.int32(want))

    @property
    def compiling(self) -> list[str]:
        """The prefills compiling in the background now."""
        return [_name(shape) for shape in tuple(self._compiling)]

    def _compile(self, shape: tuple[int, int, bool], args, *, background: bool) -> None:
        """Compile the prefill of `shape` for arguments like `args` (arrays or their shapes)
        and keep it; logged with its time."""
        began = time.perf_counter()
        try:
            with self.context():
                fn = jax.jit(functools.partial(prefill, self.graphdef, prompt_logprobs=shape[2]),
                             donate_argnums=(2, 3))
                self._prefills[shape] = fn.lower(*args).compile()
            self.compiled.append(_name(shape))
        except Exception as error:  # in the background: the next such call compiles it now
            if not background:
                raise
            self.log(f"error: compiling {_name(shape)} in the background failed ({error}); "
                     f"a call of that shape will compile it")
            return
        finally:
            self._compiling.discard(shape)
        self.log(f"compiled {_name(shape)} in {time.perf_counter() - began:.1f} s"
                 f"{' in the background' if background else ''} ({len(self.compiled)} prefill "
                 f"programs so far, at most {self.most_prefills})")

    def close(self, wait: bool = True) -> None:
        """Stop the background compiles' thread: after those queued finish (`wait`), or
        dropping those not begun."""
        self._compiler.shutdown(wait=wait, cancel_futures=not wait)


def _name(shape: tuple[int, int, bool]) -> str:
    n, P, logprobs = shape
    return f"prefill {n} x {P}" + (" with prompt logprobs" if logprobs else "")


def _abstract(value):
    """An argument's shape, dtype and (for a device array) placement: what compiling needs,
    without holding the array (the engine's next call may donate it)."""
    if isinstance(value, jax.Array):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    return value


HOWS = ("per layer", "scanned", "unrolled")


def default_how(model: DecoderLM) -> str:
    """How the served layers run: on a CPU, each layer on weights of its own ("per layer":
    `BlockStack.unstacked`, a copy of the blocks' weights beside the model's), elsewhere as
    the model runs them. XLA on a CPU copies each slice of a stacked weight that a product
    reads, scanned or unrolled alike: a decode step of SmolLM2-135M's shape (30 layers) for 16
    slots of 160 positions spent more time copying weights than multiplying. Per layer it took
    77.5 ms against 131.7 scanned, the `stories-cpu` model's (3 layers) 2.1 ms against 2.7
    unrolled and 3.7 scanned (8 steps a call, the fastest of 5; 2-core CPU, 2026-11-28;
    compiling took 4.1 s against 1.8 for SmolLM2's shape)."""
    if execution.backend() == "cpu":
        return "per layer"
    return "scanned" if model.blocks.scan else "unrolled"


def buckets(length: int, smallest: int = 32) -> list[int]:
    """The prompt lengths prefill compiles for: powers of two from `smallest`, and `length`
    itself (a bounded count, log2(length / smallest) + 1 at most)."""
    sizes, size = [], smallest
    while size < length:
        sizes.append(size)
        size *= 2
    return [*sizes, length]
