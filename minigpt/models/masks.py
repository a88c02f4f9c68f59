"""What attention is given beside the queries, keys and values: one record, `AttentionInputs`.

Every attention path (the plain one, the CPU's blocked one, the fused kernels, the cached decode,
the ring over a split sequence, a pipeline stage) reads the same record, so a new kind of mask
is a field here and a few lines in each kernel, not a new argument through every layer:

- `positions` [B, T]: each token's place in its document (the rotary embedding's angle, and
  what a sliding window measures distances in);
- `segment_ids` [B, T] or None: which document each position belongs to (int32; equal ids in a
  run of positions are one document, 0 is padding: it attends only to other padding and is
  never trained), so that attention stays inside each document: every document then gives the
  logits it would give alone;
- `window`: 0 (every earlier key of the document), or W > 0: a query sees the W keys ending
  at its own (Mistral's and Gemma's sliding window, `kv > q - W`). Where a family alternates
  local and global layers, the block stack sets it layer by layer (`for_layer`); inside a scan
  it is a traced number, so every kernel takes it as data.

`document_positions` and `same_document` are what every path asks of the documents; NumPy's
twin for host batches is `minigpt.data.documents`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """What attention reads besides q, k and v (see the module docstring)."""

    positions: jax.Array  # [B, T] int32
    segment_ids: jax.Array | None = None  # [B, T] int32
    window: jax.Array | int = 0  # keys a query sees back, its own included; 0: all

    @property
    def windowed(self) -> bool:
        """Whether a window may apply (statically: a traced window might still be 0)."""
        return not (isinstance(self.window, int) and self.window == 0)

    def for_layer(self, windows: tuple[int, ...], layer) -> AttentionInputs:
        """The inputs of layer `layer` (an index, traced in a scan) of a stack whose layers'
        windows are `windows` (0: full attention); itself where no layer has one."""
        if not any(windows):
            return self
        if len(set(windows)) == 1:
            return dataclasses.replace(self, window=windows[0])
        return dataclasses.replace(self, window=jnp.asarray(windows, jnp.int32)[layer])

    def take(self, order) -> AttentionInputs:
        """The inputs with their positions taken in `order` along the sequence."""
        return dataclasses.replace(
            self, positions=self.positions[:, order],
            segment_ids=None if self.segment_ids is None else self.segment_ids[:, order])

    def mask(self, k_positions: jax.Array | None = None,
             k_segments: jax.Array | None = None) -> jax.Array | None:
        """Which keys each query may see for the documents and the window, [B, 1, T, S]
        booleans (causality apart: the kernels apply it), or None where nothing limits them.
        Keys default to the queries' own positions and documents (self-attention)."""
        k_positions = self.positions if k_positions is None else k_positions
        k_segments = self.segment_ids if k_segments is None else k_segments
        allowed = None
        if self.segment_ids is not None:
            allowed = same_document(self.segment_ids, k_segments)
        if self.windowed:
            near = within_window(self.positions, k_positions, self.window)
            allowed = near if allowed is None else allowed & near
        return None if allowed is None else allowed[:, None]


def within_window(q_positions: jax.Array, k_positions: jax.Array, window) -> jax.Array:
    """[B, T, S]: a key lies in the query's window (q - k < W; any key where W is 0)."""
    gap = q_positions[:, :, None] - k_positions[:, None, :]
    return (gap < window) | (window <= 0)


def document_positions(segments: jax.Array) -> jax.Array:
    """Each token's place in its document [B, T] for document ids [B, T]: positions restart
    at 0 where the id changes."""
    T = segments.shape[1]
    index = jnp.arange(T, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool),
                              segments[:, 1:] != segments[:, :-1]], axis=1)  # [B, T]
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # where each document starts
    return index - first


def same_document(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """Which keys a query may see by document: ids [B, T] and [B, S] -> [B, T, S] booleans."""
    return q_segments[:, :, None] == k_segments[:, None, :]
