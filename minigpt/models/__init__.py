"""The model zoo: the architecture families and the named configurations they make.

Each family lives in a folder of its own (`minigpt.models.<family>`: its module, its zoo
entries, the config fields only it reads and its checks, its Hugging Face mapping; see
`minigpt.models.family`), and is registered by one line in `FAMILIES` below. `get_config("minigpt")`
returns a frozen `ModelConfig`; `build_model(config, rngs=...)` builds the NNX module its `arch`
names, its execution settings made concrete for the backend here. `python -m minigpt.models`
lists the zoo with parameter counts (and, for a mixture of experts, the parameters one token
uses).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from minigpt.config import ConfigError, ModelConfig
from minigpt.files import unknown_name
from minigpt.models import execution
from minigpt.models.decoder import DecoderLM, count_params
from minigpt.models.family import Family, HubError
from minigpt.models.registry import FAMILIES, checked, from_dict, replaced, settable_fields

ARCHITECTURES: dict[str, Callable[..., DecoderLM]] = {
    name: family.module for name, family in FAMILIES.items()}
CONFIGS: dict[str, ModelConfig] = {
    name: checked(ModelConfig(arch=family.name, **fields))
    for family in FAMILIES.values() for name, fields in family.zoo.items()}


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ConfigError(unknown_name("model", name, list(CONFIGS)))
    return CONFIGS[name]


def family_of(cfg: ModelConfig) -> Family:
    """The family a config's `arch` names (ConfigError naming the known ones)."""
    if cfg.arch not in FAMILIES:
        raise ConfigError(f"unknown architecture {cfg.arch!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[cfg.arch]


def build_model(config: ModelConfig, *, rngs: nnx.Rngs) -> DecoderLM:
    """The model a config describes, its execution settings made concrete for the backend
    here (`execution.for_backend`: no layer reads an "auto")."""
    family = family_of(config)
    return family.module(execution.for_backend(checked(config)), rngs=rngs)


__all__ = ["ARCHITECTURES", "CONFIGS", "FAMILIES", "DecoderLM", "Family", "HubError",
           "build_model", "checked", "count_params", "family_of", "from_dict", "get_config",
           "replaced", "settable_fields"]
