"""The model zoo: named configurations and the architectures that build them.

`get_config("minigpt")` returns a frozen `ModelConfig`; `build_model(config, rngs=...)` builds the
NNX module its `arch` names. Adding an architecture means one file in this package and one line in
`ARCHITECTURES`; adding a size means one entry in `CONFIGS`.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from minigpt.config import ConfigError, ModelConfig
from minigpt.models.layers import DecoderLM, count_params
from minigpt.models.minigpt import MiniGPT

ARCHITECTURES: dict[str, Callable[..., DecoderLM]] = {
    "minigpt": MiniGPT,
}

CONFIGS: dict[str, ModelConfig] = {
    # The tutorial's model: vocab 50257, context 256, 8 blocks of width 256 with 8 heads.
    "minigpt": ModelConfig(arch="minigpt"),
    # Small enough for tests on CPU; every dimension a preset may split divides by 8.
    "minigpt-tiny": ModelConfig(arch="minigpt", context_len=128, embed_dim=64, num_heads=8,
                                mlp_dim=128, num_layers=2),
}


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ConfigError(f"unknown model {name!r}; the zoo has: {', '.join(CONFIGS)}")
    return CONFIGS[name]


def build_model(config: ModelConfig, *, rngs: nnx.Rngs) -> DecoderLM:
    if config.arch not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {config.arch!r}; "
                          f"known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[config.arch](config, rngs=rngs)


__all__ = ["ARCHITECTURES", "CONFIGS", "DecoderLM", "build_model", "count_params", "get_config"]
