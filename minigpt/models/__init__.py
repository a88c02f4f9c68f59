"""The model zoo: named configurations and the architectures that build them.

`get_config("minigpt")` returns a frozen `ModelConfig`; `build_model(config, rngs=...)` builds the
NNX module its `arch` names. Adding an architecture means one file in this package and one line in
`ARCHITECTURES`; adding a size means one entry in `CONFIGS`. `python -m minigpt.models` lists the
zoo with parameter counts (and, for a mixture of experts, the parameters one token uses).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from minigpt.config import ConfigError, ModelConfig
from minigpt.files import unknown_name
from minigpt.models.decoder import DecoderLM, count_params
from minigpt.models.gpt2 import GPT2
from minigpt.models.llama import Llama
from minigpt.models.minigpt import MiniGPT

ARCHITECTURES: dict[str, Callable[..., DecoderLM]] = {
    "minigpt": MiniGPT,
    "gpt2": GPT2,
    "llama": Llama,
}

_GPT2 = dict(arch="gpt2", norm_eps=1e-5, dropout=0.0)
_LLAMA = dict(arch="llama", norm_eps=1e-5, dropout=0.0)
_STORIES = dict(tokenizer="tinystories-4k", vocab_size=4096)

# The "-tiny" sizes are for tests on CPU: every dimension a preset may split divides by 8.
CONFIGS: dict[str, ModelConfig] = {
    # The tutorial's model: vocab 50257, context 256, 8 blocks of width 256 with 8 heads.
    "minigpt": ModelConfig(arch="minigpt"),
    "minigpt-tiny": ModelConfig(arch="minigpt", context_len=128, embed_dim=64, num_heads=8,
                                mlp_dim=128, num_layers=2),
    # minigpt-tiny with 8 layers: one per stage when a pipeline preset spans 8 devices.
    "minigpt-tiny8": ModelConfig(arch="minigpt", context_len=128, embed_dim=64, num_heads=8,
                                 mlp_dim=128, num_layers=8),
    # GPT-2's 124M shape (12 layers, 12 heads, width 768, context 1024).
    "gpt2-small": ModelConfig(**_GPT2, context_len=1024, embed_dim=768, num_heads=12,
                              mlp_dim=3072, num_layers=12),
    "gpt2-mini": ModelConfig(**_GPT2, context_len=256, embed_dim=256, num_heads=8,
                             mlp_dim=1024, num_layers=4),
    "gpt2-tiny": ModelConfig(**_GPT2, context_len=128, embed_dim=64, num_heads=8,
                             mlp_dim=256, num_layers=2),
    # About 15M parameters, most of them in the two 50304 x 128 vocabulary tables.
    "llama-15m": ModelConfig(**_LLAMA, context_len=256, embed_dim=128, num_heads=8,
                             num_kv_heads=4, mlp_dim=384, num_layers=8),
    "llama-tiny": ModelConfig(**_LLAMA, context_len=128, embed_dim=128, num_heads=16,
                              num_kv_heads=8, mlp_dim=256, num_layers=2),
    # Sized for a laptop CPU and ten minutes (recipes/stories-cpu.toml), chosen by held-out
    # bits per byte after a fixed wall-clock budget (bench/bench_stories.py): TinyStories'
    # 4,096-token vocabulary, so the output layer is a small part of each step. Four layers
    # unrolled compile as fast as a scan and step 7% faster at this shape (bench/RESULTS.md).
    "llama-cpu": ModelConfig(**_LLAMA, **_STORIES, context_len=256, embed_dim=128,
                             num_heads=4, num_kv_heads=4, mlp_dim=384, num_layers=4,
                             scan_layers=False),
    "minigpt-cpu": ModelConfig(arch="minigpt", **_STORIES, dropout=0.0, context_len=256,
                               embed_dim=128, num_heads=4, mlp_dim=512, num_layers=4,
                               scan_layers=False),
    # A mixture of experts for tests: every layer sparse, 8 SwiGLU experts of width 64 (top 2)
    # and a shared expert as Qwen2-MoE has; TinyStories' small vocabulary keeps it quick.
    "moe-tiny": ModelConfig(**_LLAMA, **_STORIES, context_len=128, embed_dim=64, num_heads=8,
                            num_kv_heads=4, mlp_dim=128, num_layers=2, num_experts=8,
                            experts_per_token=2, expert_mlp_dim=64, shared_expert_mlp_dim=64),
    # llama-cpu with each feed-forward made 8 experts of half its width, 2 per token: the same
    # parameters per token (and FLOPs, the router aside) as llama-cpu, 4x its feed-forward
    # parameters in all (bench/bench_moe.py compares them).
    "moe-cpu": ModelConfig(**_LLAMA, **_STORIES, context_len=256, embed_dim=128, num_heads=4,
                           num_kv_heads=4, mlp_dim=384, num_layers=4, scan_layers=False,
                           num_experts=8, experts_per_token=2, expert_mlp_dim=192),
}


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise ConfigError(unknown_name("model", name, list(CONFIGS)))
    return CONFIGS[name]


def build_model(config: ModelConfig, *, rngs: nnx.Rngs) -> DecoderLM:
    if config.arch not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {config.arch!r}; "
                          f"known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[config.arch](config, rngs=rngs)


__all__ = ["ARCHITECTURES", "CONFIGS", "DecoderLM", "build_model", "count_params", "get_config"]
