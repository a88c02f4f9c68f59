"""The Llama family: the decoder of Touvron et al. at small scale (`model.Llama`) with the fields
its relatives add (Qwen's query and key norms and biases, Llama 3's rope scaling, Mistral's
sliding window, Mixtral's and Qwen3-MoE's experts), its zoo sizes, and its Hugging Face mapping
(`hub`)."""

from __future__ import annotations

import dataclasses

from minigpt.config import MOE_FIELDS, ConfigError, ModelConfig
from minigpt.models.family import Family
from minigpt.models.llama.config import LlamaOptions
from minigpt.models.llama.hub import MAPPING
from minigpt.models.llama.model import Llama

_LLAMA = dict(norm_eps=1e-5, dropout=0.0)
_STORIES = dict(tokenizer="tinystories-4k", vocab_size=4096)

ZOO = {
    # About 15M parameters, most of them in the two 50304 x 128 vocabulary tables.
    "llama-15m": dict(**_LLAMA, context_len=256, embed_dim=128, num_heads=8, num_kv_heads=4,
                      mlp_dim=384, num_layers=8),
    "llama-tiny": dict(**_LLAMA, context_len=128, embed_dim=128, num_heads=16, num_kv_heads=8,
                       mlp_dim=256, num_layers=2),
    # Sized for a laptop CPU and ten minutes (recipes/stories-cpu.toml), chosen by held-out
    # bits per byte after a fixed wall-clock budget (bench/bench_stories.py): TinyStories'
    # 4,096-token vocabulary, so the output layer is a small part of each step. Four layers
    # unrolled compile as fast as a scan and step 7% faster at this shape (bench/RESULTS.md).
    "llama-cpu": dict(**_LLAMA, **_STORIES, context_len=256, embed_dim=128, num_heads=4,
                      num_kv_heads=4, mlp_dim=384, num_layers=4, scan_layers=False),
    # A mixture of experts for tests: every layer sparse, 8 SwiGLU experts of width 64 (top 2)
    # and a shared expert as Qwen2-MoE has; TinyStories' small vocabulary keeps it quick.
    "moe-tiny": dict(**_LLAMA, **_STORIES, context_len=128, embed_dim=64, num_heads=8,
                     num_kv_heads=4, mlp_dim=128, num_layers=2, num_experts=8,
                     experts_per_token=2, expert_mlp_dim=64, shared_expert_mlp_dim=64),
    # llama-cpu with each feed-forward made 8 experts of half its width, 2 per token: the same
    # parameters per token (and FLOPs, the router aside) as llama-cpu, 4x its feed-forward
    # parameters in all (bench/bench_moe.py compares them).
    "moe-cpu": dict(**_LLAMA, **_STORIES, context_len=256, embed_dim=128, num_heads=4,
                    num_kv_heads=4, mlp_dim=384, num_layers=4, scan_layers=False,
                    num_experts=8, experts_per_token=2, expert_mlp_dim=192),
}

# Rotary scaling (Llama 3.1+'s "llama3", "linear"), and what Qwen and Mixtral add.
ROPE_FIELDS = frozenset({"rope_scaling", "rope_factor", "rope_low_freq", "rope_high_freq",
                         "rope_original_context"})
SHARED = frozenset({*ROPE_FIELDS, *MOE_FIELDS})

def check_experts(cfg: ModelConfig) -> None:
    """A mixture of experts' settings: in range, and only for a model with experts."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in MOE_FIELDS}
    changed = [f"model.{name}" for name, default in defaults.items()
               if getattr(cfg, name) != default]
    if cfg.num_experts < 0:
        raise ConfigError(f"model.num_experts must be >= 0 (0: dense), got "
                          f"{cfg.num_experts}")
    if not cfg.num_experts:
        if changed:
            raise ConfigError(f"{', '.join(changed)}: a mixture-of-experts setting, for a "
                              f"model with model.num_experts > 0")
        return
    if not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise ConfigError(f"model.experts_per_token ({cfg.experts_per_token}) must be "
                          f"between 1 and model.num_experts ({cfg.num_experts})")
    if cfg.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor must be > 0 (capacity dispatch) or 0 "
                          f"(dropless), got {cfg.moe_capacity_factor}")
    if min(cfg.expert_mlp_dim, cfg.shared_expert_mlp_dim) < 0:
        raise ConfigError("model.expert_mlp_dim and model.shared_expert_mlp_dim must be >= 0")
    if cfg.router_aux_loss_coef < 0 or cfg.router_z_loss_coef < 0:
        raise ConfigError("model.router_aux_loss_coef and model.router_z_loss_coef must be "
                          ">= 0")
    if cfg.decoder_sparse_step < 1 or any(
            not 0 <= i < cfg.num_layers for i in cfg.mlp_only_layers):
        raise ConfigError(f"model.decoder_sparse_step must be >= 1 and model.mlp_only_layers "
                          f"name layers 0..{cfg.num_layers - 1}")
    dense = [i for i in range(cfg.num_layers) if i in cfg.mlp_only_layers
             or (i + 1) % cfg.decoder_sparse_step]
    if dense:
        raise ConfigError(
            f"model.decoder_sparse_step {cfg.decoder_sparse_step} and model.mlp_only_layers "
            f"{list(cfg.mlp_only_layers)} make layer(s) {dense} dense: minigpt stacks one "
            f"kind of layer, so every layer of a mixture of experts is sparse "
            f"(decoder_sparse_step=1, no mlp_only_layers)")


FAMILY = Family(name="llama", module=Llama, zoo=ZOO, options=LlamaOptions, shared=SHARED,
                check=check_experts, gated_mlp=True, hub=MAPPING,
                about="Llama and its relatives: RMSNorm, rotary positions, grouped-query "
                      "attention, SwiGLU (Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE)")
