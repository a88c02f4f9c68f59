"""What a model family is: one folder, `minigpt.models.<family>`, and one line in the registry.

A `Family` holds everything minigpt knows of an architecture: the module that computes it, its
zoo entries, its own settings (a `FamilyOptions` subclass: `ModelConfig.options`), the shared
config fields it reads (the others refused, so no setting is silently ignored) and its checks,
whether its feed-forward is gated (what a token costs, `minigpt.models.flops`), and its
Hugging Face mapping (`HubMapping`): which config.json
`model_type`s it imports and how their fields become ours and back, and a table of its tensors
(`Tensor`, one row per parameter, read both ways by `minigpt.hub`). Adding a family is a
folder holding these and a line in `minigpt.models.FAMILIES`.

`HFConfig` reads a checkpoint's config.json for a family's mapping: every field checked (type,
range) before any arithmetic is done with it, and a refusal names the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.config import ConfigError, FamilyOptions, ModelConfig
from minigpt.config.values import check_value
from minigpt.errors import UserError


class HubError(UserError, RuntimeError):
    """An import or export cannot be done; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters and the Hugging Face tensor it comes from.

    `path` is the parameter in `nnx.state(model)`; stacked block parameters ([layers, ...])
    come from one tensor per layer, named with `{i}` (and experts with `{e}`). The Hugging Face
    tensor (`hf_shape`) is transposed if `transpose` (PyTorch's Linear stores [out, in]), cut
    along its last axis into `part[1]` equal pieces, or pieces of the widths `part[1]` lists,
    and piece `part[0]` kept (GPT-2 fuses the query, key and value projections in equal
    thirds; Phi-3 its grouped ones, of q, k and v widths), reshaped to our per-layer shape, and
    its rows padded to our padded vocabulary if `padded`.
    """

    path: tuple[str, ...]
    name: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    part: tuple[int, int | tuple[int, ...]] = (0, 1)
    padded: bool = False

    def span(self, width: int) -> tuple[int, int]:
        """Where this piece lies along the file tensor's last axis (of `width`, transposed)."""
        which, pieces = self.part
        widths = pieces if isinstance(pieces, tuple) else (width // pieces,) * pieces
        return sum(widths[:which]), sum(widths[:which + 1])

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    @property
    def stack_depth(self) -> int:
        """Leading axes of ours that are one file tensor each: layers ({i}), then experts
        ({e}, an expert's weights stacked [layers, experts, ...])."""
        return ("{i}" in self.name) + ("{e}" in self.name)


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types`


def layer_types(cfg: ModelConfig) -> list[str]:
    """`layer_types` as transformers writes them for a config's windows."""
    pattern = cfg.sliding_window_pattern
    return [FULL if not cfg.sliding_window or (pattern and (i + 1) % pattern == 0) else SLIDING
            for i in range(cfg.num_layers)]


class HFConfig:
    """A Hugging Face config.json (`fields`) as a family's mapping reads it, refusing in one
    line (HubError naming `file` and the field) what is not of the expected type or range, or
    what the family does not implement."""

    def __init__(self, fields: dict[str, Any], file: str = "config.json"):
        self.fields, self.file = fields, str(file)

    def __contains__(self, field: str) -> bool:
        return field in self.fields

    def get(self, field: str, default: Any = None) -> Any:
        return self.fields.get(field, default)

    def typed(self, field: str, kind: type) -> bool:
        """Whether the field is of `kind` (the configs' one type check, `check_value`)."""
        try:
            check_value(field, kind, self.fields[field])
        except ConfigError:
            return False
        return True

    def number(self, field: str, default: Any, kind: type = int) -> Any:
        """A positive number the file gives (or its default), checked before any arithmetic."""
        if self.fields.get(field) is None:
            return default
        if not (self.typed(field, kind) and 0 < self.fields[field] < 1e30):
            raise HubError(f"{self.file} has {field} = {json.dumps(self.fields[field])}: "
                           f"expected a positive {'integer' if kind is int else 'number'}")
        return self.fields[field]

    def flag(self, field: str, default: bool) -> bool:
        """A true-or-false field (or its default); a string such as "false" is refused, not
        read as Python reads it (a non-empty string is true)."""
        if self.fields.get(field) is None:
            return default
        if not self.typed(field, bool):
            raise HubError(f"{self.file} has {field} = {json.dumps(self.fields[field])}: "
                           f"expected true or false")
        return self.fields[field]

    def refuse(self, field: str, allowed: Callable[[Any], bool], why: str) -> None:
        """Refuse a value of `field` that `allowed` rejects, saying `why`."""
        if field in self.fields and not allowed(self.fields[field]):
            raise HubError(f"{self.file} has {field} = {json.dumps(self.fields[field])}: {why}")

    def fail(self, why: str) -> HubError:
        return HubError(f"{self.file} {why}")

    def windows(self, layers: int, window: int, pattern: int) -> tuple[int, int]:
        """(window, pattern) of `layer_types`, as `ModelConfig.sliding_window` and
        `sliding_window_pattern` say them: every N-th layer full and the others sliding
        (Gemma 3's N = 6, OLMo 3's 4), every layer sliding (pattern 0), or none (no window);
        without `layer_types`, every `pattern`-th layer full (the family's default). Other
        orders are refused."""
        types = self.get("layer_types")
        if types is None:
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        if not (isinstance(types, list) and len(types) == layers and
                set(types) <= {SLIDING, FULL}):
            raise self.fail(f"has layer_types {str(types)[:80]}: expected one of {SLIDING!r} "
                            f"and {FULL!r} per layer ({layers})")
        if FULL not in types:
            return window, 0
        if SLIDING not in types:
            return 0, 0
        for n in range(2, layers + 1):
            if types == [FULL if (i + 1) % n == 0 else SLIDING for i in range(layers)]:
                return window, n
        raise self.fail("has layer_types in an order minigpt does not implement: every N-th "
                        "layer full and the others sliding")

    def built(self, **fields: Any) -> ModelConfig:
        """Our config from the fields a mapping read; one line where we cannot build it."""
        try:
            return ModelConfig(**fields)
        except ConfigError as error:
            raise HubError(f"{self.file} describes a model minigpt cannot build: "
                           f"{error}") from None


@dataclasses.dataclass(frozen=True)
class HubMapping:
    """How a family's checkpoints look in the Hugging Face layout.

    `model_types`: the config.json `model_type`s it imports; `read(HFConfig)` our config from
    one (refusing what we do not implement, by name); `write(cfg, common)` the config.json of
    the class that computes ours (`common`: vocabulary size, dtype, begin and end ids);
    `tensors(cfg)` the table of its tensors; `spellings`: how files may spell the table's names,
    each (a name's start, what a file puts there instead), the first what export writes
    (GPT-2's "transformer." before every name); `ignored`: starts of names a file may hold
    that are not this family's weights (a multimodal checkpoint's vision tower); `tied(cfg)`:
    whether the output head is the embedding (the file's `lm_head.weight` then optional);
    `peft`: whether PEFT adapters are written and read for it; `begins_with_end`: whether
    its texts begin with the end token where the tokenizer names no begin token (GPT-2's
    <|endoftext|>); `tokenizer(cfg)`: the zoo tokenizer its checkpoints mean when they carry no
    tokenizer.json (GPT-2's own files: tiktoken's "gpt2"), or None."""

    model_types: tuple[str, ...]
    read: Callable[[HFConfig], ModelConfig]
    write: Callable[[ModelConfig, dict[str, Any]], dict[str, Any]]
    tensors: Callable[[ModelConfig], list[Tensor]]
    tied: Callable[[ModelConfig], bool]
    spellings: tuple[tuple[str, str], ...] = (("", ""),)
    ignored: tuple[str, ...] = ()
    peft: bool = False
    begins_with_end: bool = False
    tokenizer: Callable[[ModelConfig], str | None] = lambda cfg: None

    def spelled(self, name: str, spelling: tuple[str, str]) -> str:
        """A table name as a file with this spelling names it."""
        start, instead = spelling
        return instead + name[len(start):] if name.startswith(start) else name


@dataclasses.dataclass(frozen=True)
class Family:
    """An architecture family (see the module docstring)."""

    name: str  # ModelConfig.arch
    module: Callable[..., Any]  # (config, *, rngs) -> the DecoderLM
    # Its zoo entries, as the fields of each (`minigpt.models` builds them once the registry
    # is declared: building a config checks it against its family)
    zoo: dict[str, dict[str, Any]]
    options: type[FamilyOptions] | None = None  # the settings only it reads
    # the fields several families share that it reads (ModelConfig's others refuse for some)
    shared: frozenset[str] = frozenset()
    check: Callable[[ModelConfig], None] | None = None
    gated_mlp: bool = False  # its feed-forward has a gate projection (SwiGLU, GeGLU)
    hub: HubMapping | None = None
    about: str = ""  # what it is, in a few words, for listings and refusals


def instances(tensor: Tensor, cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The (layer, expert) indices of the file tensors one of our parameters is made of."""
    counts = [cfg.num_layers, cfg.num_experts][:tensor.stack_depth]
    return [tuple(int(i) for i in ids) for ids in np.ndindex(*counts)]
