"""What one device holds of a step under a preset: the mesh, the trainer's checks, local sizes.

A `Share` is a run's layout on a device count without devices: the mesh is an abstract one
(`jax.sharding.AbstractMesh`, sizes and names only), so a plan for 64 devices runs on a laptop.
Whether the preset applies is decided by the checks the trainer runs, in its order
(`sharding.resolve_mesh_shape`, `resolved.layout`, `sharding.check_divisible`), so a
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
from minigpt.runs import resolved


@dataclasses.dataclass(frozen=True)
class Share:
    """A run's layout on a device count (over an abstract mesh), checked, with the local sizes
    of one device's work."""

    layout: sharding.Layout  # pipeline microbatches resolved (0 where the preset has no stages)
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
    def preset(self) -> sharding.Preset:
        return self.layout.preset

    @property
    def mesh(self) -> jax.sharding.AbstractMesh:
        return self.layout.mesh

    @property
    def pipeline(self) -> sharding.Pipeline:
        return self.layout.pipeline

    @property
    def stages(self) -> int:
        return self.layout.stages

    @property
    def devices(self) -> int:
        return self.mesh.size

    def ways(self, logical: str) -> int:
        """How many pieces the rules cut a logical axis into on this mesh (unsized)."""
        return self.layout.ways(logical)


def abstract_mesh(preset: sharding.Preset, devices: int) -> jax.sharding.AbstractMesh:
    """The mesh the preset makes of `devices` devices, as sizes and names (PresetError where
    its shape does not fit them, the trainer's message)."""
    shape = sharding.resolve_mesh_shape(preset, devices)
    return jax.sharding.AbstractMesh(tuple(shape), tuple(preset.mesh_axes))


def check(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset,
          devices: int, abstract_state) -> Share:
    """The share of `preset` on `devices` devices for this run, or the trainer's refusal
    (PresetError or ConfigError, one line) where it cannot apply."""
    on = sharding.Layout(preset, abstract_mesh(preset, devices))
    layout = resolved.layout(model_cfg, train_cfg, on)
    sharding.check_divisible(layout, abstract_state)
    return local_sizes(model_cfg, train_cfg, layout)


def local_shape(layout: sharding.Layout, axes: tuple, shape: tuple[int, ...]) -> list[int]:
    """The shape one device holds of an array with these logical axes and this global shape."""
    spec = layout.spec(axes, shape)
    return [size // sharding.ways(layout.mesh, entry) for size, entry in zip(shape, spec)]


def local_sizes(model_cfg: ModelConfig, train_cfg: TrainConfig,
                layout: sharding.Layout) -> Share:
    """Each device's share of the activations: the batch and sequence first (as the compiled
    step's activations are laid out, [batch, seq, ...]), then what the rules leave to the heads,
    the feed-forward and the vocabulary (tensor parallelism)."""
    cfg = model_cfg
    B = train_cfg.batch_size // train_cfg.microbatches // max(layout.pipeline.microbatches, 1)
    T = resolved.seq_len(model_cfg, train_cfg)
    H = cfg.head_dim
    b, t, n, _ = local_shape(layout, ("batch", "seq", "heads", "kv"), (B, T, cfg.num_heads, H))
    k = local_shape(layout, ("batch", "seq", "kv_heads", "kv"), (B, T, cfg.kv_heads, H))[2]
    f = local_shape(layout, ("batch", "seq", "mlp"), (B, T, cfg.expert_dim))[2]
    v = local_shape(layout, ("batch", "seq", "vocab"), (B, T, cfg.padded_vocab))[2]
    if n % k:  # a split that leaves whole query groups nowhere: every device keeps its own
        k = n
    return Share(layout=layout, rows=b, positions=t, heads=n, kv_heads=k, mlp=f, vocab=v,
                 batch_ways=B // b, seq_ways=T // t, model_ways=cfg.num_heads // n)


def state_bytes(share: Share, state) -> int:
    """Bytes one device holds of an (abstract) NNX state laid out by the preset."""
    return sum(r["bytes_per_device"] for r in sharding.describe(share.layout, state))
