"""A Hugging Face config.json as a minigpt `ModelConfig`, and back: through the family whose
mapping imports its `model_type` (`minigpt.models.<family>.hub`), which checks every field it
reads (type, range) before any arithmetic is done with it and refuses by name what minigpt does
not implement. Writing goes to the class that computes the model. Which tensors each family has
is `minigpt.hub.architectures`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from minigpt.config import ConfigError, ModelConfig
from minigpt.hub.architectures import mapping
from minigpt.models import FAMILIES, checked
from minigpt.models.family import HFConfig, HubError

HEAD = "lm_head.weight"


def model_config(hf: dict[str, Any], file: str = "config.json") -> ModelConfig:
    """Our model config from a Hugging Face config.json (`file`, named in a refusal), refusing
    what we do not implement."""
    kind = hf.get("model_type")
    for family in FAMILIES.values():
        if family.hub is not None and kind in family.hub.model_types:
            cfg = family.hub.read(HFConfig(hf, str(file)))
            try:
                return checked(cfg)
            except ConfigError as error:
                raise HubError(f"{file} describes a model minigpt cannot build: "
                               f"{error}") from None
    known = "; ".join(f"{name}: {', '.join(repr(t) for t in f.hub.model_types)}"
                      for name, f in FAMILIES.items() if f.hub)
    raise HubError(f"{file} has model_type {kind!r}: minigpt imports these, by family: {known}")


def hf_config(cfg: ModelConfig, eos: int | list[int] | None, bos: int | None) -> dict[str, Any]:
    """The config.json transformers needs for our model."""
    return mapping(cfg).write(cfg, {"vocab_size": cfg.vocab_size, "torch_dtype": "float32",
                                    "bos_token_id": bos, "eos_token_id": eos})


def embedding_names(cfg: ModelConfig) -> list[str]:
    """The token embedding's name in each spelling files of the family use."""
    hub = mapping(cfg)
    table = hub.tensors(cfg)[0]  # every table starts with the token embedding
    return [hub.spelled(table.name, s) for s in hub.spellings]


def head_as_transformers_reads(cfg: ModelConfig, checkpoint) -> ModelConfig:
    """The config as transformers 5 applies `tie_word_embeddings` to the file's tensors: a tied
    model whose file also holds an `lm_head.weight` different from the embedding is loaded
    untied (transformers' `tie_weights` keeps both, with a warning), an equal one tied. A
    llama then imports with its own head; a family whose head is always the embedding (GPT-2,
    Gemma 3) is refused."""
    hub = mapping(cfg)
    names = [n for n in embedding_names(cfg) if n in checkpoint]
    if not hub.tied(cfg) or HEAD not in checkpoint or not names:
        return cfg
    if _equal(checkpoint, HEAD, names[0]):
        return cfg
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    if hub.tied(untied):  # the family's head is its embedding, whatever the config says
        raise HubError(f"the checkpoint ties the output head to the embedding, but its {HEAD} "
                       f"differs from {names[0]}: transformers keeps them apart, and minigpt's "
                       f"{cfg.arch} cannot (its head is its embedding)")
    return untied


def _equal(checkpoint, a: str, b: str) -> bool:
    """Whether two tensors of the file hold the same values (exactly, as torch.equal),
    compared a block of rows at a time so neither is read whole."""
    if checkpoint.shape(a) != checkpoint.shape(b):
        return False
    x, y = checkpoint[a], checkpoint[b]
    rows = max(1, (1 << 22) // max(1, math.prod(x.shape[1:])))
    return all(np.array_equal(np.asarray(x[i:i + rows], np.float32),
                              np.asarray(y[i:i + rows], np.float32))
               for i in range(0, x.shape[0], rows))
