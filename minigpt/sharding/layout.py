"""Batches, pipelines, experts and sequences under a preset: whether the preset can split them
evenly (`check_layout`, asked by the trainer, the explainer and the planner before anything
compiles), which mesh axis is a pipeline's stages or a ring's devices, and where each process's
rows of a batch go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from minigpt.config import CONTEXT_STRATEGIES, PIPELINE_SCHEDULES, ConfigError
from minigpt.sharding.context import active
from minigpt.sharding.presets import Preset, PresetError, Rules, mesh_axes_in, ways
from minigpt.sharding.settings import ContextParallel, Pipeline, default_microbatches


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


def sequence_axis(rules: Rules | None = None) -> str | None:
    """The mesh axis the rules (default: the active ones) split `seq` over, the ring of context
    parallelism, or None. Attention runs round one axis; `seq` over several is refused."""
    axes = mesh_axes_in(dict(active().rules if rules is None else rules).get("seq"))
    if len(axes) > 1:
        raise PresetError(f"context parallelism needs `seq` on one mesh axis, not {axes}")
    return axes[0] if axes else None


def check_layout(preset: Preset, mesh, *, model: str, num_layers: int,
                 batch_size: int | None = None, accumulation: int = 1, seq_len: int | None = None,
                 pipeline: Pipeline | None = None,
                 context_parallel: ContextParallel | None = None,
                 num_experts: int = 0) -> Pipeline:
    """Refuse batch, pipeline and expert settings the preset cannot split evenly, before
    anything compiles (the trainer and the explainer both ask); return `pipeline` with its
    microbatches resolved (0 where the preset has no pipeline). Without a batch size only the
    layers, the experts and the schedule are checked."""
    pipeline = pipeline or Pipeline()
    try:
        axis = pipeline_axis(preset.rules)
    except PresetError as error:
        raise PresetError(f"preset {preset.name!r}: {error}") from None
    stages = mesh.shape[axis] if axis else 1
    _check_experts(preset, mesh, num_experts)
    pieces = (pipeline.microbatches or default_microbatches(stages)) if stages > 1 else 0
    pipeline = dataclasses.replace(pipeline, microbatches=pieces)
    _check_sequence(preset, mesh, seq_len, context_parallel or ContextParallel())
    if stages > 1:
        _check_stages(preset, stages, model, num_layers, pipeline)
    if seq_len is not None and seq_len % stages:
        raise ConfigError(
            f"train.seq_len {seq_len} does not divide by the {stages} pipeline stages of preset "
            f"{preset.name!r}, which share the output head's work by positions: choose a "
            f"multiple of {stages}")
    if batch_size is None:
        return pipeline
    per_micro = batch_size // accumulation
    if pieces and per_micro % pieces:
        raise ConfigError(
            f"train.pipeline_microbatches {pieces} does not divide the {per_micro} sequences of "
            f"each batch the pipeline runs (batch size {batch_size} / {accumulation} "
            f"accumulation microbatch(es)): choose a divisor")
    _check_batch(preset, mesh, batch_size, accumulation, pieces)
    return pipeline


def _check_sequence(preset: Preset, mesh, seq_len: int | None,
                    settings: ContextParallel) -> None:
    """A preset that splits `seq`: over one mesh axis, without pipeline stages, with a strategy
    it knows and (given one) a sequence length it can cut into its chunks (2 per device with
    load balancing)."""
    try:
        axis = sequence_axis(preset.rules)
    except PresetError as error:
        raise PresetError(f"preset {preset.name!r}: {error}") from None
    if axis is None or mesh.shape[axis] == 1:
        return
    stage_axis = pipeline_axis(preset.rules)
    if stage_axis and mesh.shape[stage_axis] > 1:
        raise PresetError(f"preset {preset.name!r} splits both `seq` (context parallelism) and "
                          f"`layers` (pipeline stages), which do not run together yet: choose "
                          f"a preset that splits one of them")
    if settings.strategy not in CONTEXT_STRATEGIES:
        raise ConfigError(f"unknown train.context_strategy {settings.strategy!r}: choose one "
                          f"of {', '.join(CONTEXT_STRATEGIES)}")
    chunks = mesh.shape[axis] * (2 if settings.balanced else 1)
    if seq_len is not None and seq_len % chunks:
        why = (f"2 chunks for each of its {mesh.shape[axis]} {axis!r} devices (causal load "
               f"balancing)" if settings.balanced else f"its {chunks} {axis!r} devices")
        raise ConfigError(f"train.seq_len {seq_len} does not divide into the {chunks} equal "
                          f"chunks preset {preset.name!r} splits each sequence into, {why}: "
                          f"choose a multiple of {chunks}")


def experts_undivided(preset: Preset, experts: int, axes: tuple[str, ...], n: int) -> str:
    return (f"preset {preset.name!r} splits the model's {experts} experts over mesh axes {axes} "
            f"of {n} devices, and {n} does not divide {experts}: choose an expert count that "
            f"divides by {n}, or another preset")


def _check_experts(preset: Preset, mesh, num_experts: int) -> None:
    """The experts a preset with an `expert` rule can split evenly."""
    entry = preset.spec(("expert",))[0]
    n = ways(mesh, entry)
    if num_experts and num_experts % n:
        raise PresetError(experts_undivided(preset, num_experts, mesh_axes_in(entry), n))


def _check_stages(preset: Preset, stages: int, model: str, num_layers: int,
                  pipeline: Pipeline) -> None:
    """The layers, chunks and schedule a pipeline of `stages` stages can run."""
    S, M, R = stages, pipeline.microbatches, pipeline.repeats
    if num_layers % S:
        raise PresetError(
            f"preset {preset.name!r} splits the layers into {S} pipeline stages, but model "
            f"{model!r} has {num_layers} layer(s), which {S} stages cannot share evenly: "
            f"choose a model whose layer count divides by {S}, or another preset")
    if pipeline.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"unknown train.pipeline_schedule {pipeline.schedule!r}: choose one "
                          f"of {', '.join(PIPELINE_SCHEDULES)}")
    if R > 1 and (num_layers // S) % R:
        raise ConfigError(
            f"train.pipeline_repeats {R} does not divide the {num_layers // S} layer(s) each of "
            f"the {S} stages holds: choose a divisor, so each stage holds {R} equal chunks")
    if R > 1 and pipeline.schedule != "gpipe":
        raise ConfigError(f"train.pipeline_repeats {R} (the circular schedule) runs with "
                          f"train.pipeline_schedule=gpipe, not {pipeline.schedule}")
    if R > 1 and M < S:
        raise ConfigError(
            f"the circular schedule needs at least as many microbatches as stages: "
            f"train.pipeline_microbatches {M} < {S} stages")


def _check_batch(preset: Preset, mesh, batch_size: int, accumulation: int, pieces: int) -> None:
    split = batch_divisor(preset, mesh)
    per_piece = batch_size // accumulation // max(pieces, 1)
    if per_piece % split:
        pieces_text = f" and {pieces} pipeline microbatches" if pieces else ""
        raise ConfigError(
            f"batch size {batch_size} with {accumulation} microbatch(es){pieces_text} gives "
            f"{per_piece} sequences per piece, which preset {preset.name!r} must split {split} "
            f"ways over its batch axes {preset.mesh_axes_of('batch')}: choose a batch size that "
            f"is a multiple of {split * accumulation * max(pieces, 1)}")


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


def put_batch(batch: dict[str, Any], sharding) -> dict[str, Any]:
    """Place this process's rows of a global batch on the mesh (works on one host or many)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def put_batch_fn(preset: Preset, mesh) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function placing host batches [batch, seq] by the preset's `batch` rule."""
    shard = batch_sharding(preset, mesh)
    return lambda batch: put_batch(batch, shard)


