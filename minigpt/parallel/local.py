"""Kernels the compiler cannot partition, run on each device's share of their operands.

A Pallas kernel (Splash attention on TPUs, `minigpt.models.attention`) is opaque to XLA's
partitioner: given operands split over devices, it would gather them whole onto every device.
`attention_on_each_device` runs such an attention kernel inside a `jax.shard_map` manual over
the mesh axes the active rules split its operands by (the batch, the heads), so each device
attends over its own rows and heads; outside a preset, or where nothing is split, it calls the
kernel as it is. Model code names logical axes only; the mesh axes come from the rules.
"""

from __future__ import annotations

import jax

from minigpt import sharding
from minigpt.errors import UserError
from minigpt.sharding.presets import mesh_axes_in, resolve_spec


class NotLocal(UserError, ValueError):
    """The operands are split in a way a per-device kernel cannot follow; the message says how."""


def attention_on_each_device(kernel, q: jax.Array, k: jax.Array, v: jax.Array,
                             segments: jax.Array | None = None) -> jax.Array:
    """`kernel(q, k, v[, segments])` on each device's rows and heads: q [B, T, N, H], k and v
    [B, S, K, H], document ids [B, T]; the output is laid out as q. Refused (NotLocal) where the
    rules split the sequence or the head features, or the query heads unlike the key/value heads
    (a device's query heads must find their key/value heads on the same device)."""
    args = (q, k, v) if segments is None else (q, k, v, segments)
    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.active().rules
    if mesh.empty or not rules:
        return kernel(*args)
    q_spec = resolve_spec(("batch", "seq", "heads", "kv"), rules, q.shape, mesh)
    kv_spec = resolve_spec(("batch", "seq", "kv_heads", "kv"), rules, k.shape, mesh)
    if q_spec[1] or q_spec[3] or kv_spec[1] or kv_spec[3]:
        raise NotLocal("the preset splits the sequence or the head features over devices")
    if q_spec[2] != kv_spec[2] or q_spec[0] != kv_spec[0]:
        raise NotLocal("the preset splits the query heads and the key/value heads unlike")
    axes = {a for entry in q_spec for a in mesh_axes_in(entry)}
    if not axes:
        return kernel(*args)
    specs = (q_spec, kv_spec, kv_spec, jax.P(q_spec[0], None))[:len(args)]
    # check_vma off: a Pallas call does not say how its output varies over the mesh axes.
    return jax.shard_map(kernel, in_specs=specs, out_specs=q_spec, axis_names=axes,
                         check_vma=False)(*args)
