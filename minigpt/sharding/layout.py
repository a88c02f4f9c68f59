"""A run's `Layout`: the preset, the mesh made of it and how to run what they lay out, one value.

A layout is made once per run (`Layout.make("fsdp")`: the preset loaded, the mesh built over the
devices) and passed as one value to everything that places arrays or checks a split: state born
sharded (`minigpt.sharding.state`), batches placed on the mesh, the explainer, the planner (over
an abstract mesh), the pipeline's layer order. `layout.active()` enters it as the context model
code runs in. `checked(...)` refuses batch, pipeline, sequence and expert settings the preset
cannot split evenly, before anything compiles (the trainer, the explainer and the planner all
ask), and returns the layout with its pipeline's microbatches resolved.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from minigpt.config import CONTEXT_STRATEGIES, PIPELINE_SCHEDULES, ConfigError
from minigpt.sharding.context import active, running
from minigpt.sharding.presets import (
    Preset,
    PresetError,
    Rules,
    load_preset,
    make_mesh,
    mesh_axes_in,
    ways,
)
from minigpt.sharding.settings import ContextParallel, Experts, Pipeline, default_microbatches


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run lays out its arrays and runs them: a preset on a mesh (a real one, or an
    abstract one for plans), and the pipeline, context-parallel and expert settings."""

    preset: Preset
    mesh: Any  # jax.sharding.Mesh, or AbstractMesh where nothing is placed
    pipeline: Pipeline = Pipeline()
    context_parallel: ContextParallel = ContextParallel()
    experts: Experts = Experts()

    @classmethod
    def make(cls, preset: str | Path | Preset, devices=None, **settings: Any) -> Layout:
        """The layout of a preset (a name, a path or a loaded one) over `devices` (default:
        all), with `settings` (pipeline=, context_parallel=, experts=)."""
        preset = preset if isinstance(preset, Preset) else load_preset(preset)
        return cls(preset, make_mesh(preset, devices), **settings)

    @property
    def name(self) -> str:
        return self.preset.name

    @property
    def rules(self) -> Rules:
        return self.preset.rules

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)

    def spec(self, axes, shape=None) -> jax.P:
        """The PartitionSpec of an array with these logical axes (and, given its shape, sizes:
        a dimension the mesh axes do not divide gives them up, `presets.resolve_spec`)."""
        return self.preset.spec(axes, shape, None if shape is None else self.mesh)

    def ways(self, logical: str) -> int:
        """Into how many pieces the rules split a logical axis on this mesh."""
        return ways(self.mesh, self.spec((logical,))[0])

    def axis_of(self, logical: str) -> str | None:
        """The one mesh axis a logical axis is split over (`layers`: the stage axis, `seq`:
        the ring's), or None; PresetError where the rules name several."""
        axes = self.preset.mesh_axes_of(logical)
        if len(axes) > 1:
            what = "a pipeline needs `layers`" if logical == "layers" else \
                "context parallelism needs `seq`"
            raise PresetError(f"preset {self.name!r}: {what} on one mesh axis, not {axes}")
        return axes[0] if axes else None

    @property
    def stages(self) -> int:
        """Pipeline stages (1: none)."""
        axis = self.axis_of("layers")
        return self.mesh.shape[axis] if axis else 1

    @contextlib.contextmanager
    def active(self) -> Iterator[Layout]:
        """Enter the mesh, the rules and how to run: the context for all model code.

        The rules live in our own context rather than `nnx.logical_axis_rules`, because Flax
        maps each logical name independently and would turn an [embed, mlp] kernel under `fsdp`
        into the invalid spec ('fsdp', 'fsdp'); `logical_to_spec` resolves such clashes."""
        with running(rules=self.rules, pipeline=self.pipeline,
                     context_parallel=self.context_parallel, experts=self.experts), \
                jax.set_mesh(self.mesh):
            yield self

    # --- batches ------------------------------------------------------------------------

    def batch_sharding(self, ndim: int = 2) -> jax.sharding.NamedSharding:
        """Sharding of a [batch, ...] array: the batch dimension split as the `batch` rule."""
        return jax.sharding.NamedSharding(self.mesh, self.spec(("batch",) + (None,) * (ndim - 1)))

    @property
    def batch_divisor(self) -> int:
        """How many ways the batch dimension is split: global batches must divide by it."""
        return self.ways("batch")

    def batch_share(self, batch_size: int) -> tuple[int, int]:
        """Which rows of each global batch this process loads, as (share index, share count):
        its devices' rows. Processes that differ only along an axis the batch is not split over
        (the `stage` of a pipeline spanning hosts) load the same rows."""
        shard = self.batch_sharding(1)
        spans = {(s.start or 0, batch_size if s.stop is None else s.stop)
                 for (s,) in shard.addressable_devices_indices_map((batch_size,)).values()}
        start, stop = min(a for a, _ in spans), max(b for _, b in spans)
        size = stop - start
        if sum(b - a for a, b in spans) != size or batch_size % size or start % size:
            raise PresetError(f"preset {self.name!r} gives this process rows {sorted(spans)} of "
                              f"each batch, which are not one even share: order the mesh axes "
                              f"so that each process holds a contiguous block of the batch")
        return start // size, batch_size // size

    def put_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Place this process's rows of a global batch [batch, ...] on the mesh (one host or
        many)."""
        return put_batch(batch, self.batch_sharding())

    # --- checks -------------------------------------------------------------------------

    def checked(self, *, model: str, num_layers: int, batch_size: int | None = None,
                accumulation: int = 1, seq_len: int | None = None,
                num_experts: int = 0) -> Layout:
        """Refuse batch, pipeline, sequence and expert settings the preset cannot split evenly,
        before anything compiles; the layout with its pipeline's microbatches resolved (0 where
        the preset has no stages). Without a batch size only the layers, the experts, the
        sequence and the schedule are checked."""
        stages = self.stages
        self._check_experts(num_experts)
        pieces = (self.pipeline.microbatches or default_microbatches(stages)) if stages > 1 else 0
        layout = self.replace(pipeline=dataclasses.replace(self.pipeline, microbatches=pieces))
        layout._check_sequence(seq_len)
        if stages > 1:
            layout._check_stages(model, num_layers)
        if seq_len is not None and seq_len % stages:
            raise ConfigError(
                f"train.seq_len {seq_len} does not divide by the {stages} pipeline stages of "
                f"preset {self.name!r}, which share the output head's work by positions: choose "
                f"a multiple of {stages}")
        if batch_size is None:
            return layout
        per_micro = batch_size // accumulation
        if pieces and per_micro % pieces:
            raise ConfigError(
                f"train.pipeline_microbatches {pieces} does not divide the {per_micro} sequences "
                f"of each batch the pipeline runs (batch size {batch_size} / {accumulation} "
                f"accumulation microbatch(es)): choose a divisor")
        layout._check_batch(batch_size, accumulation, pieces)
        return layout

    def _check_sequence(self, seq_len: int | None) -> None:
        """A preset that splits `seq`: over one mesh axis, without pipeline stages, with a
        strategy it knows and (given one) a sequence length it can cut into its chunks (2 per
        device with load balancing)."""
        axis = self.axis_of("seq")
        if axis is None or self.mesh.shape[axis] == 1:
            return
        if self.stages > 1:
            raise PresetError(f"preset {self.name!r} splits both `seq` (context parallelism) "
                              f"and `layers` (pipeline stages), which do not run together yet: "
                              f"choose a preset that splits one of them")
        settings = self.context_parallel
        if settings.strategy not in CONTEXT_STRATEGIES:
            raise ConfigError(f"unknown train.context_strategy {settings.strategy!r}: choose "
                              f"one of {', '.join(CONTEXT_STRATEGIES)}")
        devices = self.mesh.shape[axis]
        chunks = devices * (2 if settings.balanced else 1)
        if seq_len is not None and seq_len % chunks:
            why = (f"2 chunks for each of its {devices} {axis!r} devices (causal load "
                   f"balancing)" if settings.balanced else f"its {chunks} {axis!r} devices")
            raise ConfigError(f"train.seq_len {seq_len} does not divide into the {chunks} "
                              f"equal chunks preset {self.name!r} splits each sequence into, "
                              f"{why}: choose a multiple of {chunks}")

    def _check_experts(self, num_experts: int) -> None:
        entry = self.spec(("expert",))[0]
        n = ways(self.mesh, entry)
        if num_experts and num_experts % n:
            raise PresetError(experts_undivided(self.preset, num_experts, mesh_axes_in(entry), n))

    def _check_stages(self, model: str, num_layers: int) -> None:
        """The layers, chunks and schedule a pipeline of `stages` stages can run."""
        S, M, R = self.stages, self.pipeline.microbatches, self.pipeline.repeats
        if num_layers % S:
            raise PresetError(
                f"preset {self.name!r} splits the layers into {S} pipeline stages, but model "
                f"{model!r} has {num_layers} layer(s), which {S} stages cannot share evenly: "
                f"choose a model whose layer count divides by {S}, or another preset")
        if self.pipeline.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"unknown train.pipeline_schedule {self.pipeline.schedule!r}: "
                              f"choose one of {', '.join(PIPELINE_SCHEDULES)}")
        if R > 1 and (num_layers // S) % R:
            raise ConfigError(
                f"train.pipeline_repeats {R} does not divide the {num_layers // S} layer(s) each "
                f"of the {S} stages holds: choose a divisor, so each stage holds {R} equal "
                f"chunks")
        if R > 1 and self.pipeline.schedule != "gpipe":
            raise ConfigError(f"train.pipeline_repeats {R} (the circular schedule) runs with "
                              f"train.pipeline_schedule=gpipe, not {self.pipeline.schedule}")
        if R > 1 and M < S:
            raise ConfigError(
                f"the circular schedule needs at least as many microbatches as stages: "
                f"train.pipeline_microbatches {M} < {S} stages")

    def _check_batch(self, batch_size: int, accumulation: int, pieces: int) -> None:
        split = self.batch_divisor
        per_piece = batch_size // accumulation // max(pieces, 1)
        if per_piece % split:
            pieces_text = f" and {pieces} pipeline microbatches" if pieces else ""
            raise ConfigError(
                f"batch size {batch_size} with {accumulation} microbatch(es){pieces_text} gives "
                f"{per_piece} sequences per piece, which preset {self.name!r} must split "
                f"{split} ways over its batch axes {self.preset.mesh_axes_of('batch')}: choose "
                f"a batch size that is a multiple of {split * accumulation * max(pieces, 1)}")


def experts_undivided(preset: Preset, experts: int, axes: tuple[str, ...], n: int) -> str:
    return (f"preset {preset.name!r} splits the model's {experts} experts over mesh axes {axes} "
            f"of {n} devices, and {n} does not divide {experts}: choose an expert count that "
            f"divides by {n}, or another preset")


def put_batch(batch: dict[str, Any], sharding) -> dict[str, Any]:
    """Place this process's rows of a global batch on the mesh (works on one host or many)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def pipeline_axis(rules: Rules | None = None) -> str | None:
    """The mesh axis the rules (default: the active ones) split `layers` over, the stage axis of
    a pipeline, or None."""
    axes = mesh_axes_in(dict(active().rules if rules is None else rules).get("layers"))
    if len(axes) > 1:
        raise PresetError(f"a pipeline needs `layers` on one mesh axis, not {axes}")
    return axes[0] if axes else None


def sequence_axis(rules: Rules | None = None) -> str | None:
    """The mesh axis the rules (default: the active ones) split `seq` over, the ring of context
    parallelism, or None."""
    axes = mesh_axes_in(dict(active().rules if rules is None else rules).get("seq"))
    if len(axes) > 1:
        raise PresetError(f"context parallelism needs `seq` on one mesh axis, not {axes}")
    return axes[0] if axes else None
