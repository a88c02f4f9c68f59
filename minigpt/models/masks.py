"""Documents in a window: which keys a query may see, and where each token sits in its document.

Training packs several documents into each window. A batch may say which document each position
belongs to, `segments` [B, T] (int32; equal ids in a run of positions are one document, 0 is
padding: it attends only to other padding and is never trained), so that attention stays inside
each document and positions restart at each one: every document then gives the logits it would
give alone. These two functions are what every attention path and every embedding of positions
asks; NumPy's twin for host batches is `minigpt.data.documents`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
