"""Parallelism presets: the only place that knows about meshes and mesh axis names.

Models name the *logical* role of every array axis ("embed", "mlp", "vocab", ...). A preset is a
small TOML file in `presets/` that says how the devices form a mesh and which mesh axis each logical
axis is split over; anything it does not list is replicated. This module loads and validates
presets, builds the mesh, creates model and optimizer state born sharded (each array is created by a
compiled function directly on the devices that own it), places batches, and describes what each
device holds. It depends on nothing of ours but the config; the explainer that prints a preset as a
table (`python -m minigpt.sharding --model minigpt --preset fsdp`) is `minigpt.explain`.

The *context* model code runs in is entered here, once, at the top (`use_preset`): the mesh, the
preset's rules, and how to run what the rules lay out (the pipeline's microbatches, which kernels).
Models read it where they need it (`active()`) and never take these settings as arguments; the
compiled steps are keyed on it (`jit`), so other settings compile anew.

A preset that cannot apply, or a batch it cannot split, is refused with a `PresetError` (or a
`ConfigError`) before anything is compiled.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from minigpt.config import ConfigError, read_named_toml

PRESETS_DIR = Path(__file__).resolve().parents[2] / "presets"

# The logical axis vocabulary. Model code uses only these names; presets map them to mesh axes.
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "layers")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]


def mesh_axes_in(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec entry (or a rule's target) names: None, "a" or ("a", "b")."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ways(mesh, entry: MeshAxes) -> int:
    """Into how many pieces a PartitionSpec entry splits its dimension on this mesh."""
    return math.prod(mesh.shape[a] for a in mesh_axes_in(entry))


class PresetError(ValueError):
    """A preset cannot apply to this model or these devices; the message says why."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]  # may contain one -1: all devices the other axes leave
    rules: Rules  # every logical axis, unlisted ones mapped to None (replicated)
    path: Path

    def spec(self, axes: Sequence[str | None]) -> jax.P:
        """The PartitionSpec of an array whose dimensions have these logical names."""
        return logical_to_spec(axes, self.rules)

    def mesh_axes_of(self, logical: str) -> tuple[str, ...]:
        return mesh_axes_in(dict(self.rules).get(logical))


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name_or_path: str | Path) -> Preset:
    """Load a preset by name (a file in presets/) or by path to a TOML file, and validate it."""
    path, data = read_named_toml(name_or_path, PRESETS_DIR, "preset", PresetError)
    name = path.stem

    def fail(why: str) -> PresetError:
        return PresetError(f"preset {name!r} ({path}): {why}")

    mesh = data.get("mesh")
    if not isinstance(mesh, dict) or "axes" not in mesh or "shape" not in mesh:
        raise fail("needs a [mesh] table with 'axes' and 'shape'")
    axes, shape = mesh["axes"], mesh["shape"]
    if not (isinstance(axes, list) and axes and all(isinstance(a, str) for a in axes)):
        raise fail(f"mesh.axes must be a non-empty list of names, got {axes!r}")
    if len(set(axes)) != len(axes):
        raise fail(f"mesh.axes has a repeated name: {axes}")
    if not (isinstance(shape, list) and len(shape) == len(axes)
            and all(isinstance(s, int) and (s > 0 or s == -1) for s in shape)):
        raise fail(f"mesh.shape must be one positive size (or -1) per axis {axes}, got {shape!r}")
    if shape.count(-1) > 1:
        raise fail(f"mesh.shape may contain -1 at most once, got {shape}")

    rules = data.get("rules", {})
    if not isinstance(rules, dict):
        raise fail("[rules] must be a table of logical axis = mesh axis")
    table: dict[str, MeshAxes] = dict.fromkeys(LOGICAL_AXES)
    for logical, target in rules.items():
        if logical not in LOGICAL_AXES:
            raise fail(f"rule for unknown logical axis {logical!r}; "
                       f"logical axes are {', '.join(LOGICAL_AXES)}")
        targets = [target] if isinstance(target, str) else target
        if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise fail(f"rule {logical} = {target!r} must name a mesh axis or a list of them")
        for t in targets:
            if t not in axes:
                raise fail(f"rule {logical} = {target!r} names mesh axis {t!r}, "
                           f"but the mesh axes are {axes}")
        table[logical] = target if isinstance(target, str) else tuple(target)
    unknown_keys = sorted(set(data) - {"description", "mesh", "rules"})
    if unknown_keys:
        raise fail(f"unknown top-level keys {unknown_keys}; expected description, [mesh], [rules]")
    return Preset(name=name, description=str(data.get("description", "")),
                  mesh_axes=tuple(axes), mesh_shape=tuple(shape),
                  rules=tuple(table.items()), path=path)


def resolve_mesh_shape(preset: Preset, num_devices: int) -> tuple[int, ...]:
    """Replace -1 by the devices the other axes leave; refuse shapes that do not fit."""
    fixed = math.prod(s for s in preset.mesh_shape if s != -1)
    if -1 in preset.mesh_shape:
        if num_devices % fixed:
            raise PresetError(
                f"preset {preset.name!r}: mesh {dict(zip(preset.mesh_axes, preset.mesh_shape))} "
                f"needs a device count divisible by {fixed}, but there are {num_devices} devices")
        return tuple(num_devices // fixed if s == -1 else s for s in preset.mesh_shape)
    if fixed != num_devices:
        raise PresetError(
            f"preset {preset.name!r}: mesh {dict(zip(preset.mesh_axes, preset.mesh_shape))} "
            f"uses {fixed} devices, but there are {num_devices}; use -1 for one axis to "
            f"take the remaining devices")
    return preset.mesh_shape


def make_mesh(preset: Preset, devices: Sequence[Any] | None = None):
    """Build the device mesh a preset describes, over `devices` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(preset, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, preset.mesh_axes, axis_types=auto, devices=devices)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How a pipeline preset runs the block stack: settings of the program, never of the numbers
    (every choice computes the same losses and gradients)."""

    microbatches: int = 0  # M: pieces each batch goes through the stages in; 0: two per stage


def default_microbatches(stages: int) -> int:
    """Pipeline microbatches when none are configured: 2 per stage (a GPipe bubble under 1/3)."""
    return 2 * stages


@dataclasses.dataclass(frozen=True)
class Context:
    """What model code reads while it is traced: the preset's rules and how to run."""

    rules: Rules = ()
    pipeline: Pipeline = Pipeline()
    kernels: str = "auto"  # minigpt.kernels: "auto", "reference" or "cpu"


_DEFAULT = Context()
_active: contextvars.ContextVar[Context] = contextvars.ContextVar("minigpt", default=_DEFAULT)


def active() -> Context:
    """The context model code runs in (outside `use_preset`: no rules, defaults)."""
    return _active.get()


@contextlib.contextmanager
def running(**changes: Any) -> Iterator[Context]:
    """Change some settings of the active context (`kernels=...`, `pipeline=...`) inside."""
    token = _active.set(dataclasses.replace(_active.get(), **changes))
    try:
        yield _active.get()
    finally:
        _active.reset(token)


@contextlib.contextmanager
def use_preset(preset: Preset, mesh, pipeline: Pipeline = Pipeline()) -> Iterator[None]:
    """Enter the mesh, the preset's logical-axis rules and how to run: the context for all model
    code.

    The rules live in our own context rather than `nnx.logical_axis_rules`, because Flax maps each
    logical name independently and would turn an [embed, mlp] kernel under `fsdp` into the invalid
    spec ('fsdp', 'fsdp'); `logical_to_spec` resolves such clashes.
    """
    with running(rules=preset.rules, pipeline=pipeline), jax.set_mesh(mesh):
        yield


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


def logical_to_spec(axes: Sequence[str | None], rules: Rules | None = None) -> jax.P:
    """Translate logical axis names into a PartitionSpec by the given (or active) rules.

    A mesh axis can split only one dimension of an array. When several dimensions map to the
    same mesh axis, the first of them takes it and the later ones are replicated: under `fsdp`
    an [embed, mlp] kernel is split by embed, an [mlp] bias by mlp, and a [batch, seq, embed]
    activation by batch.
    """
    table = dict(active().rules if rules is None else rules)
    used: set[str] = set()
    spec = []
    for name in axes:
        mesh_axes = mesh_axes_in(table.get(name) if name else None)
        if any(a in used for a in mesh_axes):
            mesh_axes = ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return jax.P(*spec)


def constrain(x, axes: Sequence[str | None]):
    """Ask the compiler to lay out activation `x` by logical axes; a no-op outside a preset."""
    if jax.sharding.get_abstract_mesh().empty or not active().rules:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))


def _path_name(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_divisible(preset: Preset, mesh, abstract_state) -> None:
    """Refuse a preset that splits a dimension its mesh axes do not divide evenly."""
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        if not isinstance(var, nnx.Variable):
            continue
        axes = var.get_metadata().get("out_sharding")
        if not axes:
            continue
        spec = preset.spec(axes)
        for dim, (size, entry) in enumerate(zip(var.shape, spec)):
            n = ways(mesh, entry)
            if size % n and axes[dim] == "layers":
                raise PresetError(
                    f"preset {preset.name!r} splits the model's {size} layer(s) into {n} "
                    f"pipeline stages, and {n} does not divide {size}: choose a model whose "
                    f"layer count divides by {n}, or another preset")
            if size % n:
                raise PresetError(
                    f"preset {preset.name!r}: parameter {_path_name(path)} of shape "
                    f"{tuple(var.shape)} splits dimension {dim} ({axes[dim]!r}, size {size}) "
                    f"over mesh axes {mesh_axes_in(entry)} of {n} devices, and {n} does not "
                    f"divide {size}; pick a model whose {axes[dim]!r} size divides by {n} or "
                    f"another preset")


def state_shardings(preset: Preset, mesh, abstract_state):
    """The NamedSharding of every Variable in an (abstract) NNX state, by the preset's rules."""
    def sharding_of(var):
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        sharding = jax.sharding.NamedSharding(mesh, preset.spec(axes or ()))
        return var.replace(sharding) if isinstance(var, nnx.Variable) else sharding

    return jax.tree.map(sharding_of, abstract_state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(build: Callable[[], Any], preset: Preset, mesh) -> Any:
    """Create the NNX objects `build` returns with every array born on its own devices.

    `build` runs twice: once abstractly (shapes only) to learn each array's sharding and check
    that the preset applies, then compiled with those output shardings, so no full copy of any
    parameter ever sits on one device.
    """
    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    check_divisible(preset, mesh, abstract_state)
    shardings = state_shardings(preset, mesh, abstract_state)
    with use_preset(preset, mesh):
        state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def batch_sharding(preset: Preset, mesh, ndim: int = 2):
    """Sharding of a [batch, ...] array: the batch dimension split as the preset's `batch` rule."""
    return jax.sharding.NamedSharding(mesh, preset.spec(("batch",) + (None,) * (ndim - 1)))


def batch_divisor(preset: Preset, mesh) -> int:
    """How many ways the batch dimension is split: global batches must divide by it."""
    return ways(mesh, preset.spec(("batch",))[0])


def pipeline_axis(rules: Rules | None = None) -> str | None:
    """The mesh axis the rules (default: the active ones) split `layers` over, the stage axis of a
    pipeline, or None. A pipeline runs over one axis; `layers` split over several is refused."""
    axes = mesh_axes_in(dict(active().rules if rules is None else rules).get("layers"))
    if len(axes) > 1:
        raise PresetError(f"a pipeline needs `layers` on one mesh axis, not {axes}")
    return axes[0] if axes else None


def check_layout(preset: Preset, mesh, *, model: str, num_layers: int,
                 batch_size: int | None = None, accumulation: int = 1,
                 pipeline: Pipeline = Pipeline()) -> Pipeline:
    """Refuse batch and pipeline settings the preset cannot split evenly, before anything
    compiles (the trainer and the explainer both ask); return `pipeline` with its microbatches
    resolved (0 where the preset has no pipeline). Without a batch size only the layers are
    checked."""
    try:
        axis = pipeline_axis(preset.rules)
    except PresetError as error:
        raise PresetError(f"preset {preset.name!r}: {error}") from None
    stages = mesh.shape[axis] if axis else 1
    if stages > 1 and num_layers % stages:
        raise PresetError(
            f"preset {preset.name!r} splits the layers into {stages} pipeline stages, but model "
            f"{model!r} has {num_layers} layer(s), which {stages} stages cannot share evenly: "
            f"choose a model whose layer count divides by {stages}, or another preset")
    pieces = (pipeline.microbatches or default_microbatches(stages)) if stages > 1 else 0
    pipeline = dataclasses.replace(pipeline, microbatches=pieces)
    if batch_size is None:
        return pipeline
    per_micro = batch_size // accumulation
    if pieces and per_micro % pieces:
        raise ConfigError(
            f"train.pipeline_microbatches {pieces} does not divide the {per_micro} sequences of "
            f"each batch the pipeline runs (batch size {batch_size} / {accumulation} "
            f"accumulation microbatch(es)): choose a divisor")
    split = batch_divisor(preset, mesh)
    per_piece = per_micro // max(pieces, 1)
    if per_piece % split:
        pieces_text = f" and {pieces} pipeline microbatches" if pieces else ""
        raise ConfigError(
            f"batch size {batch_size} with {accumulation} microbatch(es){pieces_text} gives "
            f"{per_piece} sequences per piece, which preset {preset.name!r} must split {split} "
            f"ways over its batch axes {preset.mesh_axes_of('batch')}: choose a batch size that "
            f"is a multiple of {split * accumulation * max(pieces, 1)}")
    return pipeline


def batch_share(preset: Preset, mesh, batch_size: int) -> tuple[int, int]:
    """Which rows of each global batch this process loads, as (share index, share count): its
    devices' rows. Processes that differ only along an axis the batch is not split over (the
    `stage` of a pipeline spanning hosts) load the same rows."""
    shard = batch_sharding(preset, mesh, 1)
    spans = {(s.start or 0, batch_size if s.stop is None else s.stop)
             for (s,) in shard.addressable_devices_indices_map((batch_size,)).values()}
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    size = stop - start
    if sum(b - a for a, b in spans) != size or batch_size % size or start % size:
        raise PresetError(f"preset {preset.name!r} gives this process rows {sorted(spans)} of "
                          f"each batch, which are not one even share: order the mesh axes so "
                          f"that each process holds a contiguous block of the batch")
    return start // size, batch_size // size


def active_ways(logical: str) -> int:
    """Into how many pieces the active preset splits a logical axis (1 outside a preset)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not active().rules:
        return 1
    return ways(mesh, logical_to_spec((logical,))[0])


def put_batch(batch: dict[str, Any], sharding) -> dict[str, Any]:
    """Place this process's rows of a global batch on the mesh (works on one host or many)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def put_batch_fn(preset: Preset, mesh) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function placing host batches [batch, seq] by the preset's `batch` rule."""
    shard = batch_sharding(preset, mesh)
    return lambda batch: put_batch(batch, shard)


def describe(preset: Preset, mesh, abstract_state) -> list[dict[str, Any]]:
    """One row per array of an abstract NNX state: its name, shape, axes, spec, bytes/device."""
    rows = []
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        axes = (var.get_metadata().get("out_sharding") or ()
                if isinstance(var, nnx.Variable) else ())
        spec = preset.spec(axes)
        pieces = math.prod(ways(mesh, entry) for entry in spec)
        nbytes = math.prod(value.shape) * value.dtype.itemsize
        rows.append({"name": _path_name(path), "shape": tuple(value.shape), "axes": tuple(axes),
                     "spec": spec, "bytes": nbytes, "bytes_per_device": nbytes // pieces})
    return rows
