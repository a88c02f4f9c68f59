"""Parallelism presets: the only place that knows about meshes and mesh axis names.

Models name the *logical* role of every array axis ("embed", "mlp", "vocab", ...). A preset is a
small TOML file in `presets/` that says how the devices form a mesh and which mesh axis each logical
axis is split over; anything it does not list is replicated. This package loads and checks presets
and builds the mesh (`presets`), keeps the context model code runs in (`context`, with the
settings of how to run in `settings`: a pipeline, attention over a split sequence, experts),
makes a run's `Layout` (the preset, its mesh and those settings as one value, entered with
`layout.active()`; it checks and places batches), creates model and optimizer state born
sharded and says what each device holds (`state`). It depends on nothing of ours but the
config and the files; the explainer that prints a preset as a table (`python -m
minigpt.sharding --model minigpt --preset fsdp`) is `minigpt.explain`.

A preset that cannot apply, or a batch it cannot split, is refused with a `PresetError` (or a
`ConfigError`) before anything is compiled.

    layout = sharding.Layout.make("fsdp")          # the preset, over every device
    model = sharding.create_sharded(lambda: build_model(cfg, rngs=nnx.Rngs(0)), layout)
    with layout.active():
        logits = model(tokens)
"""

from __future__ import annotations

from minigpt.sharding.context import (
    Context,
    active,
    active_ways,
    constrain,
    jit,
    lay_out,
    logical_to_spec,
    running,
    varying_as,
    without_axis,
)
from minigpt.sharding.layout import (
    Layout,
    pipeline_axis,
    put_batch,
    sequence_axis,
)
from minigpt.sharding.presets import (
    LOGICAL_AXES,
    PRESETS_DIR,
    MeshAxes,
    Preset,
    PresetError,
    Rules,
    available_presets,
    load_preset,
    make_mesh,
    mesh_axes_in,
    resolve_mesh_shape,
    resolve_spec,
    ways,
)
from minigpt.sharding.settings import ContextParallel, Experts, Pipeline, default_microbatches
from minigpt.sharding.state import (
    abstract_sharded,
    check_divisible,
    create_sharded,
    degenerate_note,
    describe,
    replicated_by_shape,
    state_shardings,
)

__all__ = ["LOGICAL_AXES", "PRESETS_DIR", "Context", "ContextParallel", "Experts", "Layout",
           "MeshAxes", "Pipeline", "Preset", "PresetError", "Rules", "abstract_sharded",
           "active", "active_ways", "available_presets", "check_divisible", "constrain",
           "create_sharded", "default_microbatches", "degenerate_note", "describe", "jit",
           "lay_out", "load_preset", "logical_to_spec", "make_mesh", "mesh_axes_in",
           "pipeline_axis", "put_batch", "replicated_by_shape", "resolve_mesh_shape",
           "resolve_spec", "running", "sequence_axis", "state_shardings",
           "varying_as", "ways", "without_axis"]
