"""The engine's programs compiled, kept and chosen: one table for the process, and for each
engine the programs of its cache's shape.

A program is named by what it runs: ("decode", b, sample, want) for b rows of decode steps
that may sample (else every row takes the argmax) and report `want` of their tokens (0: the
tokens, 1: their log-probabilities, 2: and the likeliest alternatives: each a program of its
own, not a branch in every step), ("prefill", n, P, logprobs) for n prompts of P tokens.
Compiled programs are kept in one table for the process, keyed on the model's structure, the
layout's context and the arguments' shapes and placements, so a new engine for the same model
(one per `generate` call) compiles nothing again. For a shape of work an engine uses its own
program when it is compiled, else the smallest compiled one that holds the work (compiling its
own in the background, where the engine has a compile thread), else compiles its own now. The
cache and slot state are donated and handed back placed as they came (the cache by its logical
axes, the slot state replicated), so every call's arguments are laid out as its program was
compiled for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt import sharding
from minigpt.decoding.programs import (
    EMPTY,
    HOWS,
    STOP_IDS,
    Slots,
    counts,
    decode,
    default_how,
    empty_cache,
    prefill,
    served_weights,
    sizes,
)
from minigpt.decoding.sampler import Sampling
from minigpt.models import DecoderLM

_TABLE: collections.OrderedDict = collections.OrderedDict()  # signature -> executable
_TABLE_MOST = 128
_table_lock = threading.Lock()


class _Key:
    """A table key whose hash is computed once (a model's structure and its weights'
    signature take a millisecond to hash)."""

    def __init__(self, parts: tuple):
        self.parts, self.hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Key) and self.hash == other.hash
                                 and self.parts == other.parts)


def forget() -> None:
    """Drop every compiled program the process keeps (as `jax.clear_caches` drops JAX's own):
    what a long-lived process, or a test run, calls between models it is done with."""
    with _table_lock:
        _TABLE.clear()
    EMPTY.clear()


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None))
                          for a in leaves)


def abstract(value):
    """An argument's shape, dtype and (for a device array) placement: what compiling needs,
    without holding the array (the engine's next call may donate it)."""
    if isinstance(value, jax.Array):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    return value


def describe(name: tuple) -> str:
    """A program's name for logs and /health: "decode 4 rows", "prefill 1 x 64"."""
    if name[0] == "decode":
        _, b, sample, want = name
        return (f"decode {b} row{'s' if b > 1 else ''}" + (", sampling" if sample else "")
                + ("", ", logprobs", ", top logprobs")[want])
    _, n, P, logprobs = name
    return f"prefill {n} x {P}" + (" with prompt logprobs" if logprobs else "")


class Programs:
    """The programs for one model and one cache of `slots` x `length` positions: decode for
    each row count in `rows` (up to `most` steps a call) and prefill for each prompt count,
    prompt length in `lengths` and whether it reports the prompt's log-probabilities.
    `compiled` lists those compiled and `compiling` those compiling in the background (with
    `background`), for logs and /health; both are read from other threads, under a lock."""

    def __init__(self, model: DecoderLM, slots: int, length: int, *, smallest: int = 32,
                 how: str | None = None, most: int = 64,
                 context: Callable[[], Any] = lambda: sharding.running(),
                 log: Callable[[str], None] = lambda line: None, background: bool = False):
        self.how = how or default_how(model)
        if self.how not in HOWS:
            raise ValueError(f"how the layers run: one of {HOWS}, got {self.how!r}")
        served = model
        if self.how != "per layer" and model.blocks.scan != (self.how == "scanned"):
            served = nnx.merge(*nnx.split(model))  # the same arrays; only how the stack runs
            served.blocks.scan = self.how == "scanned"
        self.graphdef, state = nnx.split(served)
        self.slots, self.length, self.most = slots, length, most
        self.lengths = sizes(length, min(smallest, length))
        self.rows = counts(slots)  # decode programs' and prefills' row counts
        self.context, self.log = context, log
        self._lock = threading.Lock()
        self._programs: dict[tuple, Any] = {}
        self._compiled: list[str] = []
        self._compiling: set[tuple] = set()
        self._compiler = (concurrent.futures.ThreadPoolExecutor(1, "minigpt-decoding-compile")
                          if background else None)
        with context():
            self.weights, self.layers = served_weights(model, self.graphdef, state, self.how)
            self._empty = functools.partial(empty_cache, self.graphdef, self.weights,
                                            slots=slots, length=length,
                                            per_layer=self.layers is not None)
            self._base = _Key((self.graphdef, sharding.active(), _signature(self.weights),
                               _signature(self.layers), length, most))

    @property
    def compiled(self) -> list[str]:
        with self._lock:
            return list(self._compiled)

    @property
    def compiling(self) -> list[str]:
        with self._lock:
            return [describe(name) for name in self._compiling]

    def empty(self):
        """A fresh cache ([L, S, K, C, H] x 2, or per layer [S, K, C, H] x 2) and slot
        state, placed as every program hands them back."""
        with self.context():
            cache = self._empty()
            # The weights' devices: a model laid out by a preset may be decoded outside its
            # layout's context, where the cache would otherwise be made on one device.
            weights = jax.tree.leaves(self.weights)[0].sharding
            placed = jax.tree.leaves(cache)[0].sharding
            if isinstance(weights, jax.sharding.NamedSharding):
                self._replicated = jax.sharding.NamedSharding(weights.mesh,
                                                              jax.sharding.PartitionSpec())
                if placed.device_set != weights.device_set:
                    cache = jax.device_put(cache, self._replicated)
            else:
                self._replicated = placed
            self._cache_shardings = jax.tree.map(lambda a: a.sharding, cache)
            return cache, jax.device_put(Slots.empty(self.slots), self._replicated)

    # --- which program ------------------------------------------------------------------------

    def decode_for(self, active: int, sample: bool, want: int,
                   args: Callable[[int], tuple]) -> tuple:
        """The decode program for `active` slots, which may sample (`sample`) and want their
        tokens' log-probabilities (`want`, as `sampler.choose` takes it); `args(b)`: a
        program of b rows' arguments, should one be compiled."""
        b = next(c for c in self.rows if c >= active)
        return self._chosen(("decode", b, sample, want), lambda other: (
            other[1] >= b and other[2] >= sample and other[3] >= want), lambda: args(b),
            size=lambda other: other[1:])

    def prefill_for(self, prompts: int, longest: int, logprobs: bool,
                    args: Callable[[tuple], tuple]) -> tuple:
        """The prefill program for `prompts` prompts of at most `longest` tokens
        (`args(name)`: that program's arguments)."""
        n = next(c for c in self.rows if c >= prompts)
        P = next(size for size in self.lengths if size >= longest)
        name = ("prefill", n, P, logprobs)
        return self._chosen(name, lambda other: (other[3] == logprobs and other[1] >= n
                                                  and other[2] >= P), lambda: args(name),
                            size=lambda other: other[1] * other[2])

    def _chosen(self, name: tuple, holds, args: Callable[[], tuple], size) -> tuple:
        with self._lock:
            if name in self._programs:
                return name
            others = [other for other in self._programs if other[0] == name[0] and holds(other)]
        if not others:
            return name  # compiled by `run`
        if self._compiler is not None:
            self.in_background(name, args())
        return min(others, key=size)

    # --- arguments ---------------------------------------------------------------------------

    # Arguments go in as NumPy values: the compiled call moves them with the rest, where each
    # jnp.asarray would be an eager operation of its own (about a millisecond apiece).
    def decode_args(self, cache, slots: Slots, rows: list[int], b: int, count: int):
        padded = np.asarray([*rows, *[self.slots] * (b - len(rows))], np.int32)
        return self.weights, self.layers, cache, slots, padded, np.int32(count)

    def prefill_args(self, cache, slots: Slots, rows: list[int], prompts: list[list[int]],
                     n: int, P: int, counts: list[int], left: list[int],
                     stops: list[tuple[int, ...]], sampling: list, want: int):
        """A prefill's arguments: the prompts padded to n rows of P tokens (a padding row's slot
        number is past the slots: dropped)."""
        pad = n - len(prompts)
        tokens = np.zeros((n, P), np.int32)
        for j, prompt in enumerate(prompts):
            tokens[j, :len(prompt)] = prompt
        stop_ids = np.full((n, STOP_IDS), -1, np.int32)
        for j, ids in enumerate(stops):
            ids = list(ids)[:STOP_IDS]
            stop_ids[j, :len(ids)] = ids
        draws = Sampling.of(list(sampling) + [sampling[0]] * pad)
        draws.temperature[len(prompts):] = 0.0
        return (self.weights, self.layers, cache, slots,
                np.asarray([*rows, *[self.slots] * pad], np.int32), tokens,
                np.asarray([*map(len, prompts), *[1] * pad], np.int32),
                np.asarray([*counts, *[0] * pad], np.int32),
                np.asarray([*left, *[1] * pad], np.int32), stop_ids, draws, np.int32(want))

    # --- compiling and running -----------------------------------------------------------------

    def run(self, name: tuple, args):
        """Call the program `name`, compiling it now if it is not there."""
        with self._lock:
            program = self._programs.get(name)
        if program is None:
            self.compile(name, args)
            with self._lock:
                program = self._programs[name]
        return program(*args)

    def compile(self, name: tuple, args, *, note: str = "") -> None:
        """Compile `name` for arguments like `args` (arrays or their shapes) and keep it (the
        process's copy, if it was compiled before); logged with its time."""
        began = time.perf_counter()
        args = [abstract(a) for a in args]
        with self.context():
            key = (self._base, name, _signature(args[2:]))
            with _table_lock:
                program = _TABLE.get(key)
                if program is not None:
                    _TABLE.move_to_end(key)
            if program is None:
                program = self._lower(name, args)
                with _table_lock:
                    _TABLE[key] = program
                    while len(_TABLE) > _TABLE_MOST:
                        _TABLE.popitem(last=False)
        with self._lock:
            self._programs[name] = program
            self._compiled.append(describe(name))
        self.log(f"compiled {describe(name)} in {time.perf_counter() - began:.1f} s{note}")

    def _lower(self, name: tuple, args):
        replicated = self._replicated
        if name[0] == "decode":
            fn = functools.partial(decode, self.graphdef, length=self.length, most=self.most,
                                   whole=name[1] == self.slots, sample=name[2], want=name[3])
            placed = (self._cache_shardings, replicated, replicated, replicated)
        else:
            fn = functools.partial(prefill, self.graphdef, length=self.length,
                                   prompt_logprobs=name[3])
            placed = (self._cache_shardings, replicated, replicated,
                      replicated if name[3] else None)
        return jax.jit(fn, donate_argnums=(2, 3), out_shardings=placed).lower(*args).compile()

    def in_background(self, name: tuple, args) -> None:
        """Compile `name` on the compile thread, once (nothing without one)."""
        if self._compiler is None:
            return
        with self._lock:
            if name in self._compiling or name in self._programs:
                return
            self._compiling.add(name)
        shapes = [abstract(a) for a in args]

        def work():
            try:
                self.compile(name, shapes, note=" in the background")
            except Exception as error:  # the next call of that shape compiles it
                self.log(f"error: compiling {describe(name)} in the background failed "
                         f"({error}); a call of that shape will compile it")
            finally:
                with self._lock:
                    self._compiling.discard(name)

        self._compiler.submit(work)

    def close(self, wait: bool = False) -> None:
        """Stop the compile thread: after what is queued (`wait`), or dropping what has not
        begun."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=wait, cancel_futures=not wait)
