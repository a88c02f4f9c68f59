"""What one device holds of a step under a preset: the mesh, the trainer's checks, local sizes.

A `Layout` is a preset applied to a device count without devices: the mesh is an abstract one
(`jax.sharding.AbstractMesh`, sizes and names only), so a plan for 64 devices runs on a laptop.
Whether the preset applies is decided by the checks the trainer runs, in its order
(`sharding.resolve_mesh_shape`, `sharding.check_layout`, `sharding.check_divisible`), so a
preset the plan refuses is refused with the trainer's own one line. The local sizes are those
of the arrays each device computes on: its rows of a batch piece, its positions of a sequence,
its heads, feed-forward units and vocabulary entries, as the preset's rules split the
activations (`sharding.resolve_spec`, the rule the compiled step follows).
"""

from __future__ import annotations

import dataclasses

import jax

from minigpt import sharding
from minigpt.config import ModelConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    """A preset on a device count, checked, with the local sizes of one device's work."""

    preset: sharding.Preset
    mesh: jax.sharding.AbstractMesh
    pipeline: sharding.Pipeline  # microbatches resolved (0 where the preset has no stages)
    stages: int  # pipeline stages (1: none)
    rows: int  # b: sequences of one piece (accumulation and pipeline microbatch) per device
    positions: int  # t: positions of each sequence a device holds
    heads: int  # query heads a device computes
    kv_heads: int
    mlp: int  # feed-forward units (an expert's, for a mixture of experts)
    vocab: int  # padded vocabulary entries of the logits a device computes
    batch_ways: int  # devices the batch is split over
    seq_ways: int  # devices each sequence is split over (context parallelism)
    model_ways: int  # devices the heads (or feed-forward) are split over (tensor parallelism)

    @property
    def devices(self) -> int:
        return self.mesh.size

    def ways(self, logical: str) -> int:
        """How many pieces the rules cut a logical axis into on this mesh (unsized)."""
        return sharding.ways(self.mesh, self.preset.spec((logical,))[0])


def abstract_mesh(preset: sharding.Preset, devices: int) -> jax.sharding.AbstractMesh:
    """The mesh the preset makes of `devices` devices, as sizes and names (PresetError where
    its shape does not fit them, the trainer's message)."""
    shape = sharding.resolve_mesh_shape(preset, devices)
    return jax.sharding.AbstractMesh(tuple(shape), tuple(preset.mesh_axes))


def check(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset,
          devices: int, abstract_state, *, model_name: str) -> Layout:
    """The layout of `preset` on `devices` devices for this run, or the trainer's refusal
    (PresetError or ConfigError, one line) where it cannot apply."""
    mesh = abstract_mesh(preset, devices)
    seq_len = train_cfg.seq_len or model_cfg.context_len
    settings = sharding.check_layout(
        preset, mesh, model=model_name, num_layers=model_cfg.num_layers,
        batch_size=train_cfg.batch_size, accumulation=train_cfg.microbatches, seq_len=seq_len,
        pipeline=sharding.Pipeline(microbatches=train_cfg.pipeline_microbatches,
                                   schedule=train_cfg.pipeline_schedule,
                                   repeats=train_cfg.pipeline_repeats),
        context_parallel=sharding.ContextParallel(strategy=train_cfg.context_strategy),
        num_experts=model_cfg.num_experts)
    sharding.check_divisible(preset, mesh, abstract_state)
    return local_sizes(model_cfg, train_cfg, preset, mesh, settings)


def local_shape(preset: sharding.Preset, mesh, axes: tuple, shape: tuple[int, ...]) -> list[int]:
    """The shape one device holds of an array with these logical axes and this global shape."""
    spec = preset.spec(axes, shape, mesh)
    return [size // sharding.ways(mesh, entry) for size, entry in zip(shape, spec)]


def local_sizes(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset, mesh,
                settings: sharding.Pipeline) -> Layout:
    """Each device's share of the activations: the batch and sequence first (as the compiled
    step's activations are laid out, [batch, seq, ...]), then what the rules leave to the heads,
    the feed-forward and the vocabulary (tensor parallelism)."""
    cfg = model_cfg
    axis = sharding.pipeline_axis(preset.rules)
    stages = mesh.shape[axis] if axis else 1
    B = train_cfg.batch_size // train_cfg.microbatches // max(settings.microbatches, 1)
    T = train_cfg.seq_len or cfg.context_len
    H = cfg.head_dim
    b, t, n, _ = local_shape(preset, mesh, ("batch", "seq", "heads", "kv"),
                             (B, T, cfg.num_heads, H))
    k = local_shape(preset, mesh, ("batch", "seq", "kv_heads", "kv"), (B, T, cfg.kv_heads, H))[2]
    f = local_shape(preset, mesh, ("batch", "seq", "mlp"), (B, T, cfg.expert_dim))[2]
    v = local_shape(preset, mesh, ("batch", "seq", "vocab"), (B, T, cfg.padded_vocab))[2]
    if n % k:  # a split that leaves whole query groups nowhere: every device keeps its own
        k = n
    return Layout(preset=preset, mesh=mesh, pipeline=settings, stages=stages, rows=b,
                  positions=t, heads=n, kv_heads=k, mlp=f, vocab=v,
                  batch_ways=B // b, seq_ways=T // t, model_ways=cfg.num_heads // n)


def state_bytes(layout: Layout, state) -> int:
    """Bytes one device holds of an (abstract) NNX state laid out by the preset."""
    rows = sharding.describe(layout.preset, layout.mesh, state)
    return sum(r["bytes_per_device"] for r in rows)
