"""The Hugging Face tensors of our parameters: each family's table (`minigpt.models.<family>.hub`,
one `Tensor` row per parameter) read both ways.

`tensors(cfg)` is the table of a config's family; `to_ours` turns a file's tensor into our
parameter's piece and `to_hf` the other way, so import and export walk the same rows and cannot
drift apart. How config.json maps to a `ModelConfig` and back is `minigpt.hub.configs`;
`minigpt.hub.convert` moves the weights: this module only says where they go."""

from __future__ import annotations

import numpy as np

from minigpt.config import ModelConfig
from minigpt.models import FAMILIES, family_of
from minigpt.models.family import HubError, HubMapping, Tensor, instances

__all__ = ["IGNORED_SUFFIXES", "HubError", "Tensor", "hf_name", "instances", "mapping",
           "tensors", "to_hf", "to_ours"]

# Buffers some files carry that are not parameters: GPT-2's causal masks, old rotary tables.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def mapping(cfg: ModelConfig) -> HubMapping:
    """The Hugging Face mapping of a config's family (HubError where it has none)."""
    family = family_of(cfg)
    if family.hub is None:
        raise HubError(f"a {cfg.arch!r} model cannot be exported: no Hugging Face class "
                       f"computes it ({family.about}); "
                       f"{', '.join(n for n, f in FAMILIES.items() if f.hub)} models can")
    return family.hub


def tensors(cfg: ModelConfig) -> list[Tensor]:
    """The table of a config's tensors."""
    return mapping(cfg).tensors(cfg)


def hf_name(tensor: Tensor, ids: tuple[int, ...]) -> str:
    """The table's name of the tensor at (layer, expert) `ids`."""
    return tensor.name.format(**dict(zip("ie", ids)))


def to_ours(tensor: Tensor, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A Hugging Face array as our parameter (per layer, vocabulary rows not yet padded): a
    view of `hf` where possible, so slicing it reads only the slice."""
    x = hf.T if tensor.transpose else hf
    start, stop = tensor.span(x.shape[-1])
    x = x[..., start:stop]
    rows = (tensor.hf_shape[0],) if tensor.padded else shape[:1]
    return x.reshape(rows + tuple(shape[1:]))


def to_hf(tensor: Tensor, ours: np.ndarray) -> np.ndarray:
    """The inverse of `to_ours` for one piece: our per-layer array as (a part of) the Hugging
    Face tensor, padding rows dropped."""
    if tensor.padded:
        ours = ours[:tensor.hf_shape[0]]
    shape = tensor.hf_shape[::-1] if tensor.transpose else tensor.hf_shape
    start, stop = tensor.span(shape[-1])
    shape = (*shape[:-1], stop - start)
    x = ours.reshape(shape)
    return x.T if tensor.transpose else x
