"""GPT-2 in the Hugging Face layout (`GPT2LMHeadModel`): its config.json fields as ours and back,
and its tensors, one row per parameter (`minigpt.hub` reads the table both ways)."""

from __future__ import annotations

from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import HFConfig, HubError, HubMapping, Tensor


def tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V, P = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.context_len
    block = ("blocks", "layers")
    qkv = [Tensor((*block, "attention", proj, kind), f"h.{{i}}.attn.c_attn.{hf}", shape,
                  part=(n, 3))
           for n, proj in enumerate(("query", "key", "value"))
           for kind, hf, shape in (("kernel", "weight", (D, 3 * D)), ("bias", "bias", (3 * D,)))]
    return [
        Tensor(("tokens", "table"), "wte.weight", (V, D), padded=True),
        Tensor(("positions", "table"), "wpe.weight", (P, D)),
        *[Tensor((*block, norm, kind), f"h.{{i}}.{hf}.{hk}", (D,))
          for norm, hf in (("norm1", "ln_1"), ("norm2", "ln_2"))
          for kind, hk in (("scale", "weight"), ("bias", "bias"))],
        *qkv,
        Tensor((*block, "attention", "out", "kernel"), "h.{i}.attn.c_proj.weight", (D, D)),
        Tensor((*block, "attention", "out", "bias"), "h.{i}.attn.c_proj.bias", (D,)),
        Tensor((*block, "mlp", "up", "kernel"), "h.{i}.mlp.c_fc.weight", (D, F)),
        Tensor((*block, "mlp", "up", "bias"), "h.{i}.mlp.c_fc.bias", (F,)),
        Tensor((*block, "mlp", "down", "kernel"), "h.{i}.mlp.c_proj.weight", (F, D)),
        Tensor((*block, "mlp", "down", "bias"), "h.{i}.mlp.c_proj.bias", (D,)),
        Tensor(("final_norm", "scale"), "ln_f.weight", (D,)),
        Tensor(("final_norm", "bias"), "ln_f.bias", (D,)),
    ]


def read(hf: HFConfig) -> ModelConfig:
    for field in ("scale_attn_weights", "tie_word_embeddings"):
        hf.flag(field, True)
    for field in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        hf.flag(field, False)
    hf.refuse("activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
              "minigpt's gpt2 uses the tanh approximation of GELU (gelu_new)")
    hf.refuse("scale_attn_weights", lambda v: v is True, "minigpt scales attention scores")
    hf.refuse("scale_attn_by_inverse_layer_idx", lambda v: not v,
              "minigpt's gpt2 does not scale attention by layer")
    hf.refuse("add_cross_attention", lambda v: not v, "minigpt's gpt2 is a decoder only")
    hf.refuse("tie_word_embeddings", lambda v: v is True,
              "minigpt's gpt2 ties its output head to the token embedding")
    D = hf.number("n_embd", 768)
    return hf.built(arch="gpt2", vocab_size=hf.number("vocab_size", 50257),
                    context_len=hf.number("n_positions", hf.number("n_ctx", 1024)),
                    embed_dim=D, num_heads=hf.number("n_head", 12),
                    mlp_dim=hf.number("n_inner", 4 * D), num_layers=hf.number("n_layer", 12),
                    dropout=0.0, norm_eps=hf.number("layer_norm_epsilon", 1e-5, float))


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
        raise HubError("GPT-2's heads must split its width exactly: this model sets head_size, "
                       "which GPT2LMHeadModel cannot express")
    if cfg.sliding_window:
        raise HubError("GPT2LMHeadModel attends to the whole context: a gpt2 model with "
                       "model.sliding_window has no Hugging Face class")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_positions": cfg.context_len, "n_embd": cfg.embed_dim,
            "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.mlp_dim,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": True, **common}


MAPPING = HubMapping(model_types=("gpt2",), read=read, write=write, tensors=tensors,
                     tied=lambda cfg: True, spellings=(("", "transformer."), ("", "")),
                     # GPT-2's own files carry no tokenizer.json: they mean tiktoken's
                     begins_with_end=True,
                     tokenizer=lambda cfg: "gpt2" if cfg.vocab_size == 50257 else None)
