"""Presets: load and check a preset file, and build the device mesh it describes.

A preset is a small TOML file in `presets/`: how the devices form a mesh (`[mesh]`: axis names and
sizes, -1 for the devices the other axes leave) and which mesh axis each logical axis is split
over (`[rules]`; anything unlisted is replicated). A preset that cannot apply is refused with a
`PresetError` that names the preset and the sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from minigpt.errors import UserError
from minigpt.files import read_named_toml, shipped_folder

PRESETS_DIR = shipped_folder("presets")

# The logical axis vocabulary. Model code uses only these names; presets map them to mesh axes.
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "kv", "mlp", "vocab", "layers",
                "expert")
# Axes that never give up their mesh axes to a later dimension (`resolve_spec`): a model whose
# layers or experts the mesh does not divide is refused instead (`check_divisible`).
UNYIELDING_AXES = ("layers", "expert")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]


def mesh_axes_in(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec entry (or a rule's target) names: None, "a" or ("a", "b")."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ways(mesh, entry: MeshAxes) -> int:
    """Into how many pieces a PartitionSpec entry splits its dimension on this mesh."""
    return math.prod(mesh.shape[a] for a in mesh_axes_in(entry))


class PresetError(UserError, ValueError):
    """A preset cannot apply to this model or these devices; the message says why."""


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]  # may contain one -1: all devices the other axes leave
    rules: Rules  # every logical axis, unlisted ones mapped to None (replicated)
    path: Path

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh=None) -> jax.P:
        """The PartitionSpec of an array whose dimensions have these logical names (and, given
        its shape and the mesh, sizes: see `resolve_spec`)."""
        return resolve_spec(axes, self.rules, shape, mesh)

    def mesh_axes_of(self, logical: str) -> tuple[str, ...]:
        return mesh_axes_in(dict(self.rules).get(logical))


def resolve_spec(axes: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None,
                 mesh=None) -> jax.P:
    """The PartitionSpec of an array whose dimensions have these logical names, by `rules`.

    A mesh axis can split only one dimension of an array. When several dimensions map to the
    same mesh axis, the first of them takes it and the later ones go without it: under `fsdp`
    an [embed, mlp] kernel is split by embed, an [mlp] bias by mlp, and a [batch, seq, embed]
    activation by batch; under a pipeline preset that splits the batch over (`stage`, `data`),
    a [layers, batch, ...] cache is split by stage, then by data.

    Given the array's shape and the mesh (parameters: their shapes are known), a dimension the
    mesh axes do not divide leaves them to the next dimension that maps to them: GPT-2's 12
    heads do not split 8 ways, so under `fsdp` on 8 devices its [heads, head_dim, embed]
    projection is split by embed instead. The layers and the experts never give up their axis
    (a pipeline whose stages do not divide the layers, or an expert axis that does not divide
    the experts, is refused: `check_divisible`).

    A dimension may also name several logical axes, a tuple, and is split over all their mesh
    axes in turn: the rows of the fused loss, [batch and seq flattened], are ("batch", "seq").
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(axes):
        names = (name,) if name is None or isinstance(name, str) else name
        mesh_axes = tuple(a for n in names if n for a in mesh_axes_in(table.get(n))
                          if a not in used)
        if (shape is not None and mesh is not None and mesh_axes and name not in UNYIELDING_AXES
                and shape[dim] % math.prod(mesh.shape[a] for a in mesh_axes)):
            mesh_axes = ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return jax.P(*spec)


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


# On a machine without that many devices, the command lines simulate them.
_SIMULATE = " (on a CPU, --devices N simulates N devices)"


def resolve_mesh_shape(preset: Preset, num_devices: int) -> tuple[int, ...]:
    """Replace -1 by the devices the other axes leave; refuse shapes that do not fit."""
    fixed = math.prod(s for s in preset.mesh_shape if s != -1)
    if -1 in preset.mesh_shape:
        if num_devices % fixed:
            raise PresetError(
                f"preset {preset.name!r}: mesh {dict(zip(preset.mesh_axes, preset.mesh_shape))} "
                f"needs a device count divisible by {fixed}, but there are {num_devices} devices"
                f"{_SIMULATE}")
        return tuple(num_devices // fixed if s == -1 else s for s in preset.mesh_shape)
    if fixed != num_devices:
        raise PresetError(
            f"preset {preset.name!r}: mesh {dict(zip(preset.mesh_axes, preset.mesh_shape))} "
            f"uses {fixed} devices, but there are {num_devices}; use -1 for one axis to "
            f"take the remaining devices{_SIMULATE}")
    return preset.mesh_shape


def make_mesh(preset: Preset, devices: Sequence[Any] | None = None):
    """Build the device mesh a preset describes, over `devices` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(preset, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, preset.mesh_axes, axis_types=auto, devices=devices)
