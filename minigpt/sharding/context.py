"""The context model code runs in: the preset's rules and how to run what they lay out.

It is entered once, at the top (`Layout.active()`, `minigpt.sharding.layout`: the mesh, the
rules, the pipeline settings, how attention runs over a sequence split across devices); a
model's entry points add their kernel choice (`running(kernels=...)`). Model code reads it where
it needs it (`active()`, `logical_to_spec`, `constrain`, `active_ways`) and never takes these
settings as arguments. Steps compiled with `jit` are keyed on it, so a call under other settings
compiles anew instead of reusing a program traced under the old ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from minigpt.sharding.presets import Rules, mesh_axes_in, resolve_spec, ways
from minigpt.sharding.settings import ContextParallel, Experts, Pipeline


@dataclasses.dataclass(frozen=True)
class Context:
    """What model code reads while it is traced: the preset's rules and how to run."""

    rules: Rules = ()
    pipeline: Pipeline = Pipeline()
    kernels: str = "auto"  # minigpt.models.kernels: "auto" or a set (minigpt.config.KERNELS)
    # The dtype the running model's products take their operands in (minigpt.models.execution:
    # bfloat16 on a CPU means bfloat16 operands, float32 accumulation): what kernels read.
    operands: str = "float32"
    context_parallel: ContextParallel = ContextParallel()
    experts: Experts = Experts()
    # Run the Splash attention kernel in Pallas' interpreter (any backend, slowly): how the
    # tests check the TPU kernel on a CPU (minigpt.models.attention).
    splash_interpret: bool = False


_DEFAULT = Context()
_active: contextvars.ContextVar[Context] = contextvars.ContextVar("minigpt", default=_DEFAULT)


def active() -> Context:
    """The context model code runs in (outside a layout's `active()`: no rules, defaults)."""
    return _active.get()


@contextlib.contextmanager
def running(**changes: Any) -> Iterator[Context]:
    """Change some settings of the active context (`kernels=...`, `pipeline=...`) inside."""
    token = _active.set(dataclasses.replace(_active.get(), **changes))
    try:
        yield _active.get()
    finally:
        _active.reset(token)


class _ContextJit:
    """A function compiled with `nnx.jit` once per context as well as per argument structure."""

    def __init__(self, fn: Callable, static_argnames: Sequence[str], **jit_kwargs: Any):
        def traced(*args, _context: Context, **kwargs):
            with running(**{f.name: getattr(_context, f.name)
                            for f in dataclasses.fields(Context)}):
                return fn(*args, **kwargs)

        # fn's own signature plus the context, so arguments are still named as fn names them
        signature = inspect.signature(fn)
        traced.__signature__ = signature.replace(parameters=[
            *signature.parameters.values(),
            inspect.Parameter("_context", inspect.Parameter.KEYWORD_ONLY)])
        traced.__name__, traced.__qualname__ = fn.__name__, fn.__qualname__
        self._jitted = nnx.jit(traced, static_argnames=(*static_argnames, "_context"),
                               **jit_kwargs)
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, _context=active(), **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, _context=active(), **kwargs)


def jit(fn: Callable | None = None, *, static_argnames: Sequence[str] = (), **jit_kwargs: Any):
    """`nnx.jit` keyed on the active context too: model code reads the context while it is
    traced, so a call under other rules or other pipeline settings must compile anew rather than
    reuse a program traced under the old ones. Used as `@sharding.jit` or `@sharding.jit(...)`."""
    if fn is None:
        return functools.partial(jit, static_argnames=static_argnames, **jit_kwargs)
    return _ContextJit(fn, static_argnames, **jit_kwargs)


def varying_as(tree, *like):
    """`tree`'s arrays typed as varying over every manual mesh axis some array of `like` varies
    over: inside `shard_map`, a loop's carry and the two branches of a `cond` must agree on it.
    Outside a manual region, the arrays as they are."""
    axes: set[str] = set()
    for leaf in jax.tree.leaves(like):
        axes |= set(jax.typeof(leaf).manual_axis_type.varying)

    def one(x):
        missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def lay_out(state):
    """An NNX state (or a tree of its gradients) with every array constrained to where the active
    rules put its Variable's logical axes: two branches of a `cond` that compute such trees
    must agree on their layout. Arrays outside Variables are left as they are."""
    def one(var):
        if not isinstance(var, nnx.Variable):
            return var
        axes = var.get_metadata().get("out_sharding")
        return var.replace(constrain(var.get_value(), axes)) if axes else var

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def without_axis(rules: Rules, axis: str) -> Rules:
    """The rules with mesh axis `axis` taken out of every entry: inside a region that is manual
    over `axis` (a pipeline's stages), nothing may be laid out over it."""
    def drop(entry):
        kept = tuple(a for a in mesh_axes_in(entry) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return tuple((name, drop(entry)) for name, entry in rules)


def logical_to_spec(axes: Sequence[str | None], rules: Rules | None = None) -> jax.P:
    """Translate logical axis names into a PartitionSpec by the given (or the active) rules
    (`presets.resolve_spec` says how clashes resolve)."""
    return resolve_spec(axes, active().rules if rules is None else rules)


def constrain(x, axes: Sequence[str | None]):
    """Ask the compiler to lay out activation `x` by logical axes; a no-op outside a preset. A
    dimension its mesh axes do not divide (three prompts under `dp` on 8 devices) keeps them
    for the next one that can use them, as parameters do (`presets.resolve_spec`), rather than
    asking for a split no device layout has."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not active().rules:
        return x
    return jax.lax.with_sharding_constraint(x, resolve_spec(axes, active().rules, x.shape, mesh))


def active_ways(logical: str) -> int:
    """Into how many pieces the active preset splits a logical axis (1 outside a preset)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not active().rules:
        return 1
    return ways(mesh, logical_to_spec((logical,))[0])
