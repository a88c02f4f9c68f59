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

import minigpt.config as config
from minigpt.config import ConfigError, ModelConfig
from minigpt.files import unknown_name
from minigpt.models import execution
from minigpt.models.decoder import DecoderLM, count_params
from minigpt.models.family import Family, HubError
from minigpt.models.gemma3 import FAMILY as GEMMA3
from minigpt.models.gpt2 import FAMILY as GPT2
from minigpt.models.llama import FAMILY as LLAMA
from minigpt.models.minigpt import FAMILY as MINIGPT

# The registry: a family's folder and this line are all that adding one takes.
FAMILIES: dict[str, Family] = {f.name: f for f in (MINIGPT, GPT2, LLAMA, GEMMA3)}
config.FAMILIES.update(FAMILIES)  # their config fields and checks join every ModelConfig's

ARCHITECTURES: dict[str, Callable[..., DecoderLM]] = {
    name: family.module for name, family in FAMILIES.items()}
CONFIGS: dict[str, ModelConfig] = {
    name: cfg for family in FAMILIES.values() for name, cfg in family.zoo.items()}


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
    return family_of(config).module(execution.for_backend(config), rngs=rngs)


__all__ = ["ARCHITECTURES", "CONFIGS", "FAMILIES", "DecoderLM", "Family", "HubError",
           "build_model", "count_params", "family_of", "get_config"]
