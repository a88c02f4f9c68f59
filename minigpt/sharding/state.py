"""Model and optimizer state under a preset: every array's sharding by its logical axes, state
born sharded (each array created by a compiled function directly on the devices that own it),
what each device holds, and the arrays a preset must leave whole where it names them split.

A preset that splits a dimension its mesh axes do not divide is refused (`check_divisible`)
for the layers and the experts, whose split is the point of the preset; any other dimension
keeps its mesh axes for the next dimension that can use them (`presets.resolve_spec`), and
`replicated_by_shape` says which parameters end up whole that way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from minigpt.sharding.layout import Layout, experts_undivided
from minigpt.sharding.presets import PresetError, mesh_axes_in, resolve_mesh_shape, ways


def _path_name(path: tuple) -> str:
    """A parameter's path as users know it: `blocks.layers.mlp.up.kernel` (the index of the
    model within a (model, optimizer) pair left out)."""
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return ".".join(names[1:] if len(names) > 1 and names[0].isdigit() else names)


def check_divisible(layout: Layout, abstract_state) -> None:
    """Refuse a preset that splits a dimension its mesh axes do not divide evenly."""
    preset, mesh = layout.preset, layout.mesh
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        if not isinstance(var, nnx.Variable):
            continue
        axes = var.get_metadata().get("out_sharding")
        if not axes:
            continue
        spec = layout.spec(axes, var.shape)
        for dim, (size, entry) in enumerate(zip(var.shape, spec)):
            n = ways(mesh, entry)
            if size % n and axes[dim] == "layers":
                raise PresetError(
                    f"preset {preset.name!r} splits the model's {size} layer(s) into {n} "
                    f"pipeline stages, and {n} does not divide {size}: choose a model whose "
                    f"layer count divides by {n}, or another preset")
            if size % n and axes[dim] == "expert":
                raise PresetError(experts_undivided(preset, size, mesh_axes_in(entry), n))
            if size % n:
                raise PresetError(
                    f"preset {preset.name!r}: parameter {_path_name(path)} of shape "
                    f"{tuple(var.shape)} splits dimension {dim} ({axes[dim]!r}, size {size}) "
                    f"over mesh axes {mesh_axes_in(entry)} of {n} devices, and {n} does not "
                    f"divide {size}; pick a model whose {axes[dim]!r} size divides by {n} or "
                    f"another preset")


def state_shardings(layout: Layout, abstract_state):
    """The NamedSharding of every Variable in an (abstract) NNX state, by the preset's rules."""
    def sharding_of(var):
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        shape = var.shape if isinstance(var, nnx.Variable) else None
        spec = layout.preset.spec(axes or (), shape, layout.mesh)
        sharding = jax.sharding.NamedSharding(layout.mesh, spec)
        return var.replace(sharding) if isinstance(var, nnx.Variable) else sharding

    return jax.tree.map(sharding_of, abstract_state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def _laid_out(build: Callable[[], Any], layout: Layout):
    """`build`'s objects traced for shapes alone: (graphdef, abstract state, each array's
    NamedSharding), after checking that the preset applies to them on this mesh."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    check_divisible(layout, abstract_state)
    return graphdef, abstract_state, state_shardings(layout, abstract_state)


def create_sharded(build: Callable[[], Any], layout: Layout) -> Any:
    """Create the NNX objects `build` returns with every array born on its own devices.

    `build` runs twice: once abstractly (shapes only) to learn each array's sharding and check
    that the preset applies, then compiled with those output shardings, so no full copy of any
    parameter ever sits on one device.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"create_sharded takes a Layout (minigpt.sharding.Layout.make(preset)), "
                        f"not {type(layout).__name__}")
    graphdef, abstract_state, shardings = _laid_out(build, layout)
    with layout.active():
        state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def abstract_sharded(build: Callable[[], Any], layout: Layout) -> Any:
    """The NNX objects `build` returns, shapes only: each array a `jax.ShapeDtypeStruct` with
    the sharding `create_sharded` would give it. A checkpoint is restored into these, so loading
    a run neither compiles nor runs an initialiser whose values would be overwritten."""
    graphdef, abstract_state, shardings = _laid_out(build, layout)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_state, shardings)
    return nnx.merge(graphdef, placed)


def describe(layout: Layout, abstract_state) -> list[dict[str, Any]]:
    """One row per array of an abstract NNX state: its name, shape, axes, spec, bytes/device."""
    rows = []
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        axes = (var.get_metadata().get("out_sharding") or ()
                if isinstance(var, nnx.Variable) else ())
        spec = layout.spec(axes, value.shape)
        pieces = math.prod(ways(layout.mesh, entry) for entry in spec)
        nbytes = math.prod(value.shape) * value.dtype.itemsize
        rows.append({"name": _path_name(path), "shape": tuple(value.shape), "axes": tuple(axes),
                     "spec": spec, "bytes": nbytes, "bytes_per_device": nbytes // pieces})
    return rows


def replicated_by_shape(layout: Layout, abstract_state) -> list[dict[str, Any]]:
    """The arrays the preset's rules name split that end up split fewer ways on this mesh,
    because their dimensions do not divide by the devices (`presets.resolve_spec` leaves the
    mesh axes to no other dimension): fsdp on 3 devices, tp with heads that do not divide.
    One {"name", "shape", "asked", "got"} (ways) per array."""
    found = []
    leaves = jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        if not axes:
            continue
        asked = math.prod(ways(layout.mesh, entry) for entry in layout.spec(axes))
        got = math.prod(ways(layout.mesh, entry) for entry in layout.spec(axes, var.shape))
        if got < asked:
            found.append({"name": _path_name(path), "shape": tuple(var.shape), "asked": asked,
                          "got": got})
    return found


def degenerate_note(layout: Layout, abstract_state, *, most: int = 64) -> str | None:
    """One line saying which arrays the preset keeps whole (or split fewer ways than its rules
    ask) on this mesh, and the device counts up to `most` that would split them all; None
    where it splits everything it names."""
    preset, mesh = layout.preset, layout.mesh
    found = replicated_by_shape(layout, abstract_state)
    if not found:
        return None
    values = sum(math.prod(f["shape"]) for f in found)
    splitting = []
    for count in range(2, most + 1):
        try:
            shape = resolve_mesh_shape(preset, count)
        except PresetError:
            continue
        other = layout.replace(mesh=jax.sharding.AbstractMesh(shape, preset.mesh_axes))
        if not replicated_by_shape(other, abstract_state):
            splitting.append(count)
    counts = (", ".join(map(str, splitting[:6])) + (" ..." if len(splitting) > 6 else "")
              if splitting else "no device count up to 64")
    names = ", ".join(f["name"] for f in found[:3]) + (", ..." if len(found) > 3 else "")
    return (f"note: preset {preset.name!r} on {mesh.size} devices splits {len(found)} "
            f"parameter array(s) fewer ways than it names ({values:,} values; {names}): their "
            f"dimensions do not divide by the devices; {counts} devices would split them all")
