"""A Hugging Face config.json as a minigpt `ModelConfig`, and back.

`GPT2LMHeadModel` is `gpt2`; `LlamaForCausalLM` (Llama 2 and 3.x with their rope scaling,
TinyLlama, SmolLM2), `MistralForCausalLM`, `Qwen2ForCausalLM` (query, key and value biases),
`Qwen3ForCausalLM` (query and key norms), `MixtralForCausalLM` and `Qwen3MoeForCausalLM`
(experts) are `llama` with fields. Every field is checked (type, range) before any arithmetic
is done with it, and what minigpt does not implement is refused by name. Writing goes back to the
class that computes the model. Which tensors each architecture has is
`minigpt.hub.architectures`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.config import ConfigError, ModelConfig, check_value
from minigpt.hub.architectures import HubError

# The file being read, as refusals name it (the checkpoint's own config.json).
_FILE = contextvars.ContextVar("config_file", default="config.json")


def model_config(hf: dict[str, Any], file: str = "config.json") -> ModelConfig:
    """Our model config from a Hugging Face config.json (`file`, named in a refusal),
    refusing what we do not implement."""
    token = _FILE.set(str(file))
    try:
        return _model_config(hf)
    finally:
        _FILE.reset(token)


def _model_config(hf: dict[str, Any]) -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf)
    if kind in ("llama", "mistral"):
        return _llama_config(hf)
    if kind == "mixtral":  # a Mistral whose feed-forward is experts, their weights renormalised
        return _llama_config(hf, **_experts(hf, "num_local_experts", "intermediate_size"),
                             norm_topk_prob=True)
    if kind == "qwen3_moe":
        _refuse(hf, "use_sliding_window", lambda v: not v,
                "minigpt's llama attends to the whole context (no sliding window)")
        _refuse(hf, "mlp_only_layers", lambda v: not v,
                "minigpt's mixture of experts makes every layer sparse")
        _refuse(hf, "decoder_sparse_step", lambda v: v == 1,
                "minigpt's mixture of experts makes every layer sparse")
        hf = {**hf, "sliding_window": None, "head_dim": hf.get("head_dim") or 128}
        return _llama_config(hf, qk_norm=True, norm_topk_prob=_flag(hf, "norm_topk_prob", False),
                             **_experts(hf, "num_experts", "moe_intermediate_size"))
    if kind in ("qwen2", "qwen3"):
        _refuse(hf, "use_sliding_window", lambda v: not v,
                "minigpt's llama attends to the whole context (no sliding window)")
        _refuse(hf, "layer_types", lambda v: v is None or set(v) <= {"full_attention"},
                "minigpt's llama attends to the whole context in every layer")
        # As transformers reads a Qwen config: `sliding_window` is ignored without
        # `use_sliding_window`; Qwen2 puts biases on the query, key and value projections;
        # Qwen3's heads are 128 wide unless `head_dim` says otherwise.
        hf = {**hf, "sliding_window": None}
        if kind == "qwen2":
            return _llama_config({**hf, "attention_bias": False}, qkv_bias=True)
        return _llama_config({**hf, "head_dim": hf.get("head_dim") or 128}, qk_norm=True)
    raise HubError(f"{_FILE.get()} has model_type {kind!r}: minigpt imports 'gpt2' "
                   f"(GPT2LMHeadModel), 'llama' (LlamaForCausalLM: Llama 2 and 3, TinyLlama, "
                   f"SmolLM2), 'mistral', 'mixtral', 'qwen2', 'qwen3' and 'qwen3_moe'")


def _typed(hf: dict[str, Any], field: str, kind: type) -> bool:
    """Whether config.json's `field` is of `kind`, by the one type check every config value
    passes (`minigpt.config.check_value`: ints not bools, finite numbers, true or false)."""
    try:
        check_value(field, kind, hf[field])
    except ConfigError:
        return False
    return True


def _number(hf: dict[str, Any], field: str, default: Any, kind: type = int) -> Any:
    """A number config.json gives (or its default): of the right type and positive, checked
    before any arithmetic is done with it."""
    if hf.get(field) is None:
        return default
    if not (_typed(hf, field, kind) and 0 < hf[field] < 1e30):
        raise HubError(f"{_FILE.get()} has {field} = {json.dumps(hf[field])}: expected a "
                       f"positive {'integer' if kind is int else 'number'}")
    return hf[field]


def _flag(hf: dict[str, Any], field: str, default: bool) -> bool:
    """A true-or-false field of config.json (or its default); a string such as "false" is
    refused, not read as Python reads it (a non-empty string is true)."""
    if hf.get(field) is None:
        return default
    if not _typed(hf, field, bool):
        raise HubError(f"{_FILE.get()} has {field} = {json.dumps(hf[field])}: expected true or "
                       f"false")
    return hf[field]


def _refuse(hf: dict[str, Any], field: str, allowed: Callable[[Any], bool], why: str) -> None:
    if field in hf and not allowed(hf[field]):
        raise HubError(f"{_FILE.get()} has {field} = {json.dumps(hf[field])}: {why}")


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    for field in ("scale_attn_weights", "tie_word_embeddings"):
        _flag(hf, field, True)
    for field in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        _flag(hf, field, False)
    _refuse(hf, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
            "minigpt's gpt2 uses the tanh approximation of GELU (gelu_new)")
    _refuse(hf, "scale_attn_weights", lambda v: v is True, "minigpt scales attention scores")
    _refuse(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v,
            "minigpt's gpt2 does not scale attention by layer")
    _refuse(hf, "add_cross_attention", lambda v: not v, "minigpt's gpt2 is a decoder only")
    _refuse(hf, "tie_word_embeddings", lambda v: v is True,
            "minigpt's gpt2 ties its output head to the token embedding")
    D = _number(hf, "n_embd", 768)
    return _built(arch="gpt2", vocab_size=_number(hf, "vocab_size", 50257),
                  context_len=_number(hf, "n_positions", _number(hf, "n_ctx", 1024)),
                  embed_dim=D, num_heads=_number(hf, "n_head", 12),
                  mlp_dim=_number(hf, "n_inner", 4 * D), num_layers=_number(hf, "n_layer", 12),
                  dropout=0.0, norm_eps=_number(hf, "layer_norm_epsilon", 1e-5, float))


def _experts(hf: dict[str, Any], count: str, width: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json (transformers 5
    writes the expert count as `num_local_experts` for both)."""
    experts = _number(hf, "num_local_experts", _number(hf, count, 0))
    if not experts:
        raise HubError(f"{_FILE.get()} gives no {count}: how many experts?")
    coef = hf.get("router_aux_loss_coef", 0.001)
    if not (_typed(hf, "router_aux_loss_coef", float) if "router_aux_loss_coef" in hf
            else True) or not 0 <= coef < 1e3:
        raise HubError(f"{_FILE.get()} has router_aux_loss_coef = {json.dumps(coef)}: expected "
                       f"a number from 0 to 1000")
    return {"num_experts": experts, "experts_per_token": _number(hf, "num_experts_per_tok", 2),
            "expert_mlp_dim": _number(hf, width, _number(hf, "intermediate_size", 0)),
            "router_aux_loss_coef": float(coef)}


def _llama_config(hf: dict[str, Any], qk_norm: bool = False, qkv_bias: bool = False,
                  **experts: Any) -> ModelConfig:
    for field in ("mlp_bias", "use_sliding_window"):
        _flag(hf, field, False)
    _refuse(hf, "hidden_act", lambda v: v == "silu", "minigpt's llama uses SwiGLU with silu")
    _refuse(hf, "mlp_bias", lambda v: not v, "minigpt's llama has no MLP biases")
    D, N = _number(hf, "hidden_size", 4096), _number(hf, "num_attention_heads", 32)
    context = _number(hf, "max_position_embeddings", 2048)
    _refuse(hf, "sliding_window", lambda v: v is None or (isinstance(v, int) and v >= context),
            "minigpt's llama attends to the whole context (a sliding window shorter than the "
            "context is not implemented)")
    attention_bias = _flag(hf, "attention_bias", False)
    head_dim = _number(hf, "head_dim", D // N)
    return _built(arch="llama", vocab_size=_number(hf, "vocab_size", 32000),
                  context_len=context, embed_dim=D,
                  num_heads=N, num_kv_heads=_number(hf, "num_key_value_heads", N),
                  mlp_dim=_number(hf, "intermediate_size", 11008),
                  num_layers=_number(hf, "num_hidden_layers", 32), dropout=0.0,
                  norm_eps=_number(hf, "rms_norm_eps", 1e-6, float),
                  head_size=0 if head_dim * N == D else head_dim,
                  tie_embeddings=_flag(hf, "tie_word_embeddings", False), qk_norm=qk_norm,
                  qkv_bias=qkv_bias or attention_bias, out_bias=attention_bias,
                  **_rope_fields(hf), **experts)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5 writes them as `rope_parameters` (theta and scaling
    together), earlier versions as `rope_theta` and `rope_scaling` (its kind as `rope_type`, or
    `type` in older files). Llama 3's "llama3" scaling and "linear" are implemented; others
    ("dynamic", "yarn", "longrope", ...) are refused by name."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HubError(f"{_FILE.get()} has rope settings {json.dumps(rope)[:80]}: expected an "
                       f"object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = _number(rope, "rope_theta", _number(hf, "rope_theta", 1e4, float), float)
    if kind == "default":
        return {"rope_theta": theta}
    if kind not in ("llama3", "linear"):
        raise HubError(f"{_FILE.get()} has rope_type {json.dumps(kind)}: minigpt implements "
                       f"plain rotary embeddings and the 'llama3' and 'linear' scalings")
    fields = {"rope_theta": theta, "rope_scaling": kind,
              "rope_factor": _number(rope, "factor", 1.0, float)}
    if kind == "llama3":
        fields |= {"rope_low_freq": _number(rope, "low_freq_factor", 1.0, float),
                   "rope_high_freq": _number(rope, "high_freq_factor", 4.0, float),
                   "rope_original_context": _number(rope, "original_max_position_embeddings",
                                                    8192)}
    return fields


HEAD, EMBEDDINGS = "lm_head.weight", ("model.embed_tokens.weight", "transformer.wte.weight",
                                      "wte.weight")


def head_as_transformers_reads(cfg: ModelConfig, checkpoint) -> ModelConfig:
    """The config as transformers 5 applies `tie_word_embeddings` to the file's tensors: a tied
    model whose file also holds an `lm_head.weight` different from the embedding is loaded
    untied (transformers' `tie_weights` keeps both, with a warning), an equal one tied. A
    llama then imports with its own head; minigpt's gpt2 always ties, and is refused."""
    names = [n for n in EMBEDDINGS if n in checkpoint]
    if not (cfg.tie_embeddings or cfg.arch == "gpt2") or HEAD not in checkpoint or not names:
        return cfg
    if _equal(checkpoint, HEAD, names[0]):
        return cfg
    if cfg.arch == "gpt2":
        raise HubError(f"{_FILE.get()} ties the output head to the embedding, but the weights' "
                       f"{HEAD} differs from {names[0]}: transformers keeps them apart, and "
                       f"minigpt's gpt2 cannot (its head is its embedding)")
    return dataclasses.replace(cfg, tie_embeddings=False)


def _equal(checkpoint, a: str, b: str) -> bool:
    """Whether two tensors of the file hold the same values (exactly, as torch.equal),
    compared a block of rows at a time so neither is read whole."""
    if checkpoint.shape(a) != checkpoint.shape(b):
        return False
    x, y = checkpoint[a], checkpoint[b]
    rows = max(1, (1 << 22) // max(1, math.prod(x.shape[1:])))
    return all(np.array_equal(np.asarray(x[i:i + rows], np.float32),
                              np.asarray(y[i:i + rows], np.float32))
               for i in range(0, x.shape[0], rows))


def _experts_config(cfg: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts as the Hugging Face class that computes it: Qwen3-MoE (query and
    key norms, top-k weights renormalised or not), or Mixtral (renormalised, no norms)."""
    if cfg.qkv_bias or cfg.out_bias or cfg.shared_expert_mlp_dim:
        raise HubError("a mixture of experts with attention biases or a shared expert has no "
                       "Hugging Face class minigpt writes (Mixtral and Qwen3-MoE have neither)")
    experts = {"num_experts_per_tok": cfg.experts_per_token,
               "router_aux_loss_coef": cfg.router_aux_loss_coef,
               "output_router_logits": False, "sliding_window": None}
    if cfg.qk_norm:
        return {**llama, **experts, "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe", "num_experts": cfg.num_experts,
                "num_local_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_dim,
                "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_sliding_window": False,
                "attention_bias": False}
    if not cfg.norm_topk_prob:
        raise HubError("Mixtral renormalises its top-k weights: a mixture of experts without "
                       "norm_topk_prob and without query and key norms has no Hugging Face "
                       "class minigpt writes")
    return {**llama, **experts, "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "num_local_experts": cfg.num_experts,
            "intermediate_size": cfg.expert_dim}


def _built(**fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise HubError(f"{_FILE.get()} describes a model minigpt cannot build: {error}") from None


def hf_config(cfg: ModelConfig, eos: int | list[int] | None,
              bos: int | None) -> dict[str, Any]:
    """The config.json transformers needs for our model."""
    common = {"vocab_size": cfg.vocab_size, "torch_dtype": "float32",
              "bos_token_id": bos, "eos_token_id": eos}
    if cfg.arch == "gpt2":
        if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
            raise HubError("GPT-2's heads must split its width exactly: this model sets "
                           "head_size, which GPT2LMHeadModel cannot express")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_positions": cfg.context_len, "n_embd": cfg.embed_dim,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.mlp_dim,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": True, **common}
    if cfg.arch != "llama":
        raise HubError(f"a {cfg.arch!r} model cannot be exported: no Hugging Face class "
                       f"computes it (minigpt's own architecture normalises after each "
                       f"sublayer); gpt2 and llama models can")
    if cfg.out_bias and not cfg.qkv_bias:
        raise HubError("a llama with a bias on the attention's output projection alone has no "
                       "Hugging Face class (Llama's attention_bias puts one on all four)")
    rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope |= {"low_freq_factor": cfg.rope_low_freq, "high_freq_factor": cfg.rope_high_freq,
                 "original_max_position_embeddings": cfg.rope_original_context}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
             "max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
             # both spellings: transformers 5 reads the first, earlier versions the others
             "rope_parameters": rope, "rope_theta": cfg.rope_theta,
             "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
             if cfg.rope_scaling else None,
             "hidden_act": "silu", "attention_bias": cfg.out_bias, "mlp_bias": False,
             "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, **common}
    if cfg.num_experts:
        return _experts_config(cfg, llama)
    if cfg.qk_norm or (cfg.qkv_bias and not cfg.out_bias):  # Qwen3 (query and key norms)
        qwen = {"use_sliding_window": False, "sliding_window": None,  # or Qwen2 (qkv biases)
                "layer_types": ["full_attention"] * cfg.num_layers}
        if cfg.qk_norm:
            if cfg.qkv_bias != cfg.out_bias:
                raise HubError("Qwen3's attention_bias puts biases on all four projections or "
                               "none: this model's cannot be written as Qwen3ForCausalLM")
            return {**llama, **qwen, "architectures": ["Qwen3ForCausalLM"],
                    "model_type": "qwen3"}
        return {**llama, **qwen, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    return llama

