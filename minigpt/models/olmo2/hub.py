"""OLMo 2 in the Hugging Face layout: `Olmo2ForCausalLM` (`model_type` "olmo2"), as
allenai/OLMo-2-0425-1B spells its config.json (no `bos_token_id`; its tokenizer's `<|pad|>`).
Its config.json as ours and back, and the table of its tensors."""

from __future__ import annotations

from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import HFConfig, HubMapping, Tensor
from minigpt.models.llama.hub import rope_fields, rope_parameters


def tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V, H = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.kv_heads * H
    block, layer = ("blocks", "layers"), "model.layers.{i}"
    out = [
        Tensor(("tokens", "table"), "model.embed_tokens.weight", (V, D), padded=True),
        Tensor((*block, "norm1_out", "scale"), f"{layer}.post_attention_layernorm.weight", (D,)),
        Tensor((*block, "norm2_out", "scale"), f"{layer}.post_feedforward_layernorm.weight",
               (D,)),
        *[Tensor((*block, "attention", ours, "kernel"), f"{layer}.self_attn.{hf}.weight",
                 (rows, D), transpose=True)
          for ours, hf, rows in (("query", "q_proj", q), ("key", "k_proj", kv),
                                 ("value", "v_proj", kv))],
        Tensor((*block, "attention", "out", "kernel"), f"{layer}.self_attn.o_proj.weight",
               (D, q), transpose=True),
        *[Tensor((*block, "attention", f"{x}_norm", "scale"),
                 f"{layer}.self_attn.{x}_norm.weight", (rows,))
          for x, rows in (("q", q), ("k", kv))],
        *[Tensor((*block, "mlp", ours, "kernel"), f"{layer}.mlp.{ours}_proj.weight", shape,
                 transpose=True) for ours, shape in (("gate", (F, D)), ("up", (F, D)),
                                                     ("down", (D, F)))],
        Tensor(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if not cfg.tie_embeddings:
        out.append(Tensor(("output", "kernel"), "lm_head.weight", (V, D), padded=True))
    return out


def refuse_unimplemented(hf: HFConfig, family: str) -> None:
    """What OLMo 2 and 3 files may say that minigpt's block does not compute."""
    hf.refuse("hidden_act", lambda v: v == "silu", f"minigpt's {family} uses SwiGLU with silu")
    hf.refuse("attention_bias", lambda v: not v, f"{family}'s projections have no biases")
    hf.refuse("clip_qkv", lambda v: v is None,
              f"minigpt's {family} does not clip queries, keys and values")


def common_fields(hf: HFConfig, arch: str) -> dict[str, Any]:
    """The fields OLMo 2 and OLMo 3 spell alike (their defaults: transformers' config class)."""
    D, N = hf.number("hidden_size", 4096), hf.number("num_attention_heads", 32)
    head_dim = hf.number("head_dim", D // N)
    return dict(arch=arch, vocab_size=hf.number("vocab_size", 50304),
                context_len=hf.number("max_position_embeddings", 2048), embed_dim=D,
                num_heads=N, num_kv_heads=hf.number("num_key_value_heads", N),
                mlp_dim=hf.number("intermediate_size", 11008),
                num_layers=hf.number("num_hidden_layers", 32), dropout=0.0,
                norm_eps=hf.number("rms_norm_eps", 1e-5, float),
                head_size=0 if head_dim * N == D else head_dim,
                tie_embeddings=hf.flag("tie_word_embeddings", False))


def read(hf: HFConfig) -> ModelConfig:
    refuse_unimplemented(hf, "olmo2")
    rope = rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling") or {},
                       hf.number("rope_theta", 1e4, float))
    return hf.built(**common_fields(hf, "olmo2"), **rope)


def common_config(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields OLMo 2 and OLMo 3 write alike."""
    return {"hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, **common}


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2",
            "rope_parameters": rope_parameters(cfg), **common_config(cfg, common)}


MAPPING = HubMapping(model_types=("olmo2",), read=read, write=write, tensors=tensors,
                     tied=lambda cfg: cfg.tie_embeddings)
