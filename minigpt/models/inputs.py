"""What a model is given, checked, and a batch as its loss reads it.

Token ids [B, T] and the arrays beside them (document ids, positions, targets) are checked at
the model's door (`check_inputs`: a wrong shape names its argument instead of failing as a
broadcast inside); `loss_batch` turns a batch's loss mask into per-position weights and its
document ids into positions; `in_run_order` lays a batch out in the order the model runs its
positions (under a preset that splits the sequence with load balancing, each device's two
chunks). Dimension letters as in `minigpt.models.layers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minigpt import parallel
from minigpt.errors import UserError
from minigpt.models.masks import document_positions


class InputError(UserError, ValueError):
    """Arrays given to a model that it cannot read; the message names the argument."""


def check_inputs(tokens, **per_token) -> None:
    """Refuse (InputError, naming the argument) token ids that are not an integer [B, T] array,
    and arrays given beside them (`segment_ids`, `positions`) that are not integers of the same
    shape: inside the model they would fail as broadcasting errors naming neither."""
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"tokens must be integer ids [batch, positions], got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} {shape}")
    for name, value in per_token.items():
        if value is None:
            continue
        got = getattr(value, "shape", None)
        if got != tuple(shape) or not jnp.issubdtype(value.dtype, jnp.integer):
            raise InputError(f"{name} must be integers of the tokens' shape {tuple(shape)} (one "
                             f"per token), got {getattr(value, 'dtype', type(value).__name__)} "
                             f"{got}")


def loss_batch(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch as the loss reads it. "positions" (each token's place in its document) come from
    "segment_ids" where the batch gives ids but no positions. Which targets are trained: a
    "loss_mask" [B, T] (1 trained, 0 not; with ids but no mask, every target but padding's,
    id 0) becomes "weights", scaled so that they average 1 over the batch: the loss is then a
    mean over positions, as without a mask, whatever microbatches or pipeline stages it is
    split into, and equals the mean over the trained targets of the whole batch. A batch that
    already has "weights" is returned as it is."""
    if "weights" in batch or ("loss_mask" not in batch and "segment_ids" not in batch):
        return batch
    batch = dict(batch)
    segments = batch.get("segment_ids")
    if segments is not None and "positions" not in batch:
        batch["positions"] = document_positions(segments)
    mask = batch.pop("loss_mask", None)
    mask = (segments != 0) if mask is None else mask
    mask = mask.astype(jnp.float32)
    batch["weights"] = mask * (mask.size / jnp.maximum(jnp.sum(mask), 1.0))
    return batch


def in_run_order(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch of [B, T] arrays with its positions in the order the model runs them
    (`parallel.sequence_order`: under a preset that splits the sequence with load balancing,
    each device's two chunks; elsewhere as given)."""
    order = parallel.sequence_order(next(iter(batch.values())).shape[1])
    return batch if order is None else {k: v[:, order] for k, v in batch.items()}


def positions_in(order: np.ndarray | None, B: int, T: int) -> jax.Array:
    """Every token's place in its sequence [B, T], for tokens in `order` (None: 0..T-1)."""
    return jnp.broadcast_to(jnp.asarray(np.arange(T) if order is None else order, jnp.int32),
                            (B, T))
