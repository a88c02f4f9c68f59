"""Gemma 3 (text) in the Hugging Face layout: `Gemma3ForCausalLM` (`model_type` "gemma3_text"), and
the text weights of a `Gemma3ForConditionalGeneration` checkpoint ("gemma3": the fields in its
`text_config`, the tensors under `language_model.`, the vision tower's left aside). Its
config.json as ours and back, and the table of its tensors."""

from __future__ import annotations

from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import FULL, SLIDING, HFConfig, HubError, HubMapping, Tensor, layer_types
from minigpt.models.gemma3.config import Gemma3Options
from minigpt.models.llama.hub import rope_fields


def tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V, H = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.kv_heads * H
    block, layer = ("blocks", "layers"), "model.layers.{i}"
    norms = (("norm1", "input_layernorm"), ("norm1_out", "post_attention_layernorm"),
             ("norm2", "pre_feedforward_layernorm"), ("norm2_out", "post_feedforward_layernorm"))
    return [
        Tensor(("tokens", "table"), "model.embed_tokens.weight", (V, D), padded=True),
        *[Tensor((*block, ours, "scale"), f"{layer}.{hf}.weight", (D,)) for ours, hf in norms],
        *[Tensor((*block, "attention", ours, "kernel"), f"{layer}.self_attn.{hf}.weight",
                 (rows, D), transpose=True)
          for ours, hf, rows in (("query", "q_proj", q), ("key", "k_proj", kv),
                                 ("value", "v_proj", kv))],
        Tensor((*block, "attention", "out", "kernel"), f"{layer}.self_attn.o_proj.weight",
               (D, q), transpose=True),
        *[Tensor((*block, "attention", f"{x}_norm", "scale"),
                 f"{layer}.self_attn.{x}_norm.weight", (H,)) for x in "qk"],
        *[Tensor((*block, "mlp", ours, "kernel"), f"{layer}.mlp.{ours}_proj.weight", shape,
                 transpose=True) for ours, shape in (("gate", (F, D)), ("up", (F, D)),
                                                     ("down", (D, F)))],
        Tensor(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]


def read(hf: HFConfig) -> ModelConfig:
    if hf.get("model_type") == "gemma3":  # a multimodal checkpoint: its text model
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise hf.fail("has model_type gemma3 but no text_config object: minigpt imports "
                          "the text model of a Gemma 3 checkpoint")
        tied = hf.flag("tie_word_embeddings", True)
        hf = HFConfig({**text, "tie_word_embeddings": text.get("tie_word_embeddings", tied)},
                      f"{hf.file} (text_config)")
    for field, why in (("attn_logit_softcapping", "minigpt's gemma3 does not cap scores"),
                       ("final_logit_softcapping", "minigpt's gemma3 does not cap logits")):
        hf.refuse(field, lambda v: v is None, why)
    hf.refuse("use_bidirectional_attention", lambda v: not v,
              "minigpt's gemma3 is causal (a bidirectional Gemma is an encoder)")
    hf.refuse("hidden_activation", lambda v: v == "gelu_pytorch_tanh",
              "minigpt's gemma3 gates with the tanh approximation of GELU")
    hf.refuse("attention_bias", lambda v: not v, "Gemma 3's projections have no biases")
    hf.refuse("tie_word_embeddings", lambda v: v is not False,
              "minigpt's gemma3 ties its output head to the token embedding")
    D, N = hf.number("hidden_size", 2304), hf.number("num_attention_heads", 8)
    layers = hf.number("num_hidden_layers", 26)
    head_dim = hf.number("head_dim", 256)
    window, pattern = hf.windows(layers, hf.number("sliding_window", 4096),
                                 hf.number("sliding_window_pattern", 6))
    global_rope, local_theta = _rope(hf)
    return hf.built(arch="gemma3", vocab_size=hf.number("vocab_size", 262_208),
                    context_len=hf.number("max_position_embeddings", 131_072), embed_dim=D,
                    num_heads=N, num_kv_heads=hf.number("num_key_value_heads", 4),
                    mlp_dim=hf.number("intermediate_size", 9216), num_layers=layers,
                    dropout=0.0, norm_eps=hf.number("rms_norm_eps", 1e-6, float),
                    head_size=0 if head_dim * N == D else head_dim, tie_embeddings=True,
                    sliding_window=window, sliding_window_pattern=pattern,
                    options=Gemma3Options(
                        query_pre_attn_scalar=float(hf.number("query_pre_attn_scalar", 256,
                                                              float)),
                        local_rope_theta=local_theta), **global_rope)


def _rope(hf: HFConfig) -> tuple[dict[str, Any], float]:
    """The global layers' rotary settings (with any scaling), and the local layers' base:
    `rope_parameters` per layer type (transformers 5), or `rope_theta`, `rope_scaling` and
    `rope_local_base_freq` (earlier files)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.number("rope_theta", 1e6,
                                                                          float)}
        local = {"rope_type": "default",
                 "rope_theta": hf.number("rope_local_base_freq", 1e4, float)}
    local_fields = rope_fields(hf, local, 1e4, kinds=())
    return rope_fields(hf, full, 1e6, kinds=("linear",)), float(local_fields["rope_theta"])


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    own = cfg.options  # Gemma3Options
    if not float(own.query_pre_attn_scalar).is_integer():
        raise HubError(f"model.gemma3.query_pre_attn_scalar {own.query_pre_attn_scalar:g}: "
                       f"transformers' Gemma 3 takes a whole number there")
    if cfg.sliding_window and not cfg.sliding_window_pattern:
        raise HubError("Gemma3ForCausalLM has global layers: a gemma3 model whose every layer "
                       "slides (model.sliding_window_pattern 0) has no Hugging Face class")
    types = layer_types(cfg)
    full = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        full["factor"] = cfg.rope_factor
    local = {"rope_type": "default", "rope_theta": own.local_rope_theta or cfg.rope_theta}
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {SLIDING: local, FULL: full},
            # an integer in transformers' config class (ours is a float: any scale imports)
            "query_pre_attn_scalar": round(own.query_pre_attn_scalar or cfg.head_dim),
            # transformers' class wants a window even where no layer slides: the whole context
            "sliding_window": cfg.sliding_window or cfg.context_len, "layer_types": types,
            "attention_bias": False, "attention_dropout": 0.0,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False, "tie_word_embeddings": True, **common}


# The multimodal checkpoints' layouts of the text weights: under `language_model.` as the Hub
# files hold them, or `model.language_model.` as transformers names them in memory.
SPELLINGS = (("", ""), ("", "language_model."), ("model.", "model.language_model."))
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
          "model.multi_modal_projector.")

MAPPING = HubMapping(model_types=("gemma3_text", "gemma3"), read=read, write=write,
                     tensors=tensors, tied=lambda cfg: True, spellings=SPELLINGS,
                     ignored=VISION)
