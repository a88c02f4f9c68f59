"""Phi-3 in the Hugging Face layout: `Phi3ForCausalLM` (`model_type` "phi3"), as
microsoft/Phi-3-mini-4k-instruct (a sliding window, untied) and microsoft/Phi-4-mini-instruct
(`partial_rotary_factor` 0.75, tied, grouped key/value heads) spell their config.json. Its
tensors fuse the query, key and value projections (`qkv_proj`: q, then k, then v rows) and the
gate and up projections (`gate_up_proj`: gate, then up), cut apart and joined back by the
table. LongRoPE scaling (the 128k models') is refused by name until minigpt implements it."""

from __future__ import annotations

from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import HFConfig, HubMapping, Tensor
from minigpt.models.phi3.config import Phi3Options


def tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    block, layer = ("blocks", "layers"), "model.layers.{i}"
    qkv, gate_up = f"{layer}.self_attn.qkv_proj.weight", f"{layer}.mlp.gate_up_proj.weight"
    out = [
        Tensor(("tokens", "table"), "model.embed_tokens.weight", (V, D), padded=True),
        Tensor((*block, "norm1", "scale"), f"{layer}.input_layernorm.weight", (D,)),
        Tensor((*block, "norm2", "scale"), f"{layer}.post_attention_layernorm.weight", (D,)),
        *[Tensor((*block, "attention", ours, "kernel"), qkv, (q + 2 * kv, D), transpose=True,
                 part=(i, (q, kv, kv))) for i, ours in enumerate(("query", "key", "value"))],
        Tensor((*block, "attention", "out", "kernel"), f"{layer}.self_attn.o_proj.weight",
               (D, q), transpose=True),
        *[Tensor((*block, "mlp", ours, "kernel"), gate_up, (2 * F, D), transpose=True,
                 part=(i, 2)) for i, ours in enumerate(("gate", "up"))],
        Tensor((*block, "mlp", "down", "kernel"), f"{layer}.mlp.down_proj.weight", (D, F),
               transpose=True),
        Tensor(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if not cfg.tie_embeddings:
        out.append(Tensor(("output", "kernel"), "lm_head.weight", (V, D), padded=True))
    return out


def read(hf: HFConfig) -> ModelConfig:
    hf.refuse("hidden_act", lambda v: v == "silu", "minigpt's phi3 uses SwiGLU with silu")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise hf.fail(f"has rope settings {str(rope)[:80]}: expected an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise hf.fail(f"has rope_type {kind!r}: minigpt's phi3 rotates without scaling "
                      f"(LongRoPE, the 128k-context models', is not implemented)")
    D, N = hf.number("hidden_size", 3072), hf.number("num_attention_heads", 32)
    head_dim = hf.number("head_dim", D // N)
    context = hf.number("max_position_embeddings", 4096)
    window = hf.number("sliding_window", 0)
    fraction = HFConfig(rope, hf.file).number(
        "partial_rotary_factor", hf.number("partial_rotary_factor", 1.0, float), float)
    return hf.built(arch="phi3", vocab_size=hf.number("vocab_size", 32064),
                    context_len=context, embed_dim=D, num_heads=N,
                    num_kv_heads=hf.number("num_key_value_heads", N),
                    mlp_dim=hf.number("intermediate_size", 8192),
                    num_layers=hf.number("num_hidden_layers", 32), dropout=0.0,
                    norm_eps=hf.number("rms_norm_eps", 1e-5, float),
                    head_size=0 if head_dim * N == D else head_dim,
                    tie_embeddings=hf.flag("tie_word_embeddings", False),
                    rope_theta=HFConfig(rope, hf.file).number(
                        "rope_theta", hf.number("rope_theta", 10000.0, float), float),
                    sliding_window=window if window < context else 0,
                    options=Phi3Options(partial_rotary_factor=float(fraction)))


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    fraction = cfg.options.partial_rotary_factor
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.context_len,
            "original_max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": fraction},
            "rope_theta": cfg.rope_theta, "partial_rotary_factor": fraction,
            "sliding_window": cfg.sliding_window or None, "hidden_act": "silu",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
            # transformers' class defaults to Phi-3's id 32000, past a smaller table's rows
            "pad_token_id": None,
            "tie_word_embeddings": cfg.tie_embeddings, **common}


MAPPING = HubMapping(model_types=("phi3",), read=read, write=write, tensors=tensors,
                     tied=lambda cfg: cfg.tie_embeddings)
