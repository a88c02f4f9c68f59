"""The Llama family in the Hugging Face layout: `LlamaForCausalLM` (Llama 2 and 3.x with their rope
scaling, TinyLlama, SmolLM2), `MistralForCausalLM` (a sliding window), `Qwen2ForCausalLM`
(query, key and value biases), `Qwen3ForCausalLM` (query and key norms), `MixtralForCausalLM`
and `Qwen3MoeForCausalLM` (experts) are all `llama` with fields. Their config.json as ours and
back (writing goes to the class that computes the model), and the table of their tensors."""

from __future__ import annotations

import json
from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import HFConfig, HubError, HubMapping, Tensor
from minigpt.models.llama.config import LlamaOptions

MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")


def tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    block, layer = ("blocks", "layers"), "model.layers.{i}"
    out = [
        Tensor(("tokens", "table"), "model.embed_tokens.weight", (V, D), padded=True),
        Tensor((*block, "norm1", "scale"), f"{layer}.input_layernorm.weight", (D,)),
        Tensor((*block, "norm2", "scale"), f"{layer}.post_attention_layernorm.weight", (D,)),
        *[Tensor((*block, "attention", ours, "kernel"), f"{layer}.self_attn.{hf}.weight",
                 (rows, D), transpose=True)
          for ours, hf, rows in (("query", "q_proj", q), ("key", "k_proj", kv),
                                 ("value", "v_proj", kv))],
        Tensor((*block, "attention", "out", "kernel"), f"{layer}.self_attn.o_proj.weight",
               (D, q), transpose=True),
        Tensor((*block, "mlp", "gate", "kernel"), f"{layer}.mlp.gate_proj.weight", (F, D),
               transpose=True),
        Tensor((*block, "mlp", "up", "kernel"), f"{layer}.mlp.up_proj.weight", (F, D),
               transpose=True),
        Tensor((*block, "mlp", "down", "kernel"), f"{layer}.mlp.down_proj.weight", (D, F),
               transpose=True),
        Tensor(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if cfg.num_experts:  # the feed-forward is experts: Qwen3-MoE's names, or Mixtral's
        out = [t for t in out if t.path[:3] != (*block, "mlp")]
        E, X = cfg.num_experts, cfg.expert_dim
        moe = (*block, "mlp")
        sparse, weights = (("mlp", ("gate_proj", "up_proj", "down_proj")) if cfg.options.qk_norm
                           else ("block_sparse_moe", ("w1", "w3", "w2")))
        expert = f"{layer}.{sparse}.experts.{{e}}"
        out += [Tensor((*moe, "router", "kernel"), f"{layer}.{sparse}.gate.weight", (E, D),
                       transpose=True),
                *[Tensor((*moe, "experts", ours, "kernel"), f"{expert}.{hf}.weight", shape,
                         transpose=True)
                  for ours, hf, shape in zip(("gate", "up", "down"), weights,
                                             ((X, D), (X, D), (D, X)))]]
    if cfg.options.qk_norm:  # Qwen3
        out += [Tensor((*block, "attention", f"{x}_norm", "scale"),
                       f"{layer}.self_attn.{x}_norm.weight", (cfg.head_dim,)) for x in "qk"]
    if cfg.options.qkv_bias:  # Qwen2
        out += [Tensor((*block, "attention", ours, "bias"), f"{layer}.self_attn.{hf}.bias",
                       (rows,)) for ours, hf, rows in (("query", "q_proj", q),
                                                       ("key", "k_proj", kv),
                                                       ("value", "v_proj", kv))]
    if cfg.options.out_bias:
        out.append(Tensor((*block, "attention", "out", "bias"), f"{layer}.self_attn.o_proj.bias",
                          (D,)))
    if not cfg.tie_embeddings:
        out.append(Tensor(("output", "kernel"), "lm_head.weight", (V, D), padded=True))
    return out


# --- config.json in ---------------------------------------------------------------------------

def read(hf: HFConfig) -> ModelConfig:
    kind = hf.get("model_type")
    if kind in ("llama", "mistral"):
        return _llama(hf)
    if kind == "mixtral":  # a Mistral whose feed-forward is experts, their weights renormalised
        return _llama(hf, **_experts(hf, "num_local_experts", "intermediate_size"),
                      norm_topk_prob=True)
    _refuse_qwen_windows(hf)
    hf.fields = {**hf.fields, "sliding_window": None}  # read only with use_sliding_window
    if kind == "qwen3_moe":
        hf.refuse("mlp_only_layers", lambda v: not v,
                  "minigpt's mixture of experts makes every layer sparse")
        hf.refuse("decoder_sparse_step", lambda v: v == 1,
                  "minigpt's mixture of experts makes every layer sparse")
        hf.fields = {**hf.fields, "head_dim": hf.get("head_dim") or 128}
        return _llama(hf, qk_norm=True, norm_topk_prob=hf.flag("norm_topk_prob", False),
                      **_experts(hf, "num_experts", "moe_intermediate_size"))
    # As transformers reads a Qwen config: Qwen2 puts biases on the query, key and value
    # projections; Qwen3's heads are 128 wide unless `head_dim` says otherwise.
    if kind == "qwen2":
        hf.fields = {**hf.fields, "attention_bias": False}
        return _llama(hf, qkv_bias=True)
    hf.fields = {**hf.fields, "head_dim": hf.get("head_dim") or 128}
    return _llama(hf, qk_norm=True)


def _refuse_qwen_windows(hf: HFConfig) -> None:
    """Qwen's sliding window is for some layers (below `max_window_layers`), in a layout minigpt
    does not implement; `sliding_window` alone is ignored without `use_sliding_window`, as
    transformers ignores it."""
    hf.refuse("use_sliding_window", lambda v: not v,
              "Qwen's window applies to some layers only, which minigpt does not implement")
    hf.refuse("layer_types", lambda v: v is None or set(v) <= {"full_attention"},
              "minigpt's llama runs one kind of attention in every layer")


def _experts(hf: HFConfig, count: str, width: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json (transformers 5
    writes the expert count as `num_local_experts` for both)."""
    experts = hf.number("num_local_experts", hf.number(count, 0))
    if not experts:
        raise hf.fail(f"gives no {count}: how many experts?")
    coef = hf.get("router_aux_loss_coef", 0.001)
    if not (hf.typed("router_aux_loss_coef", float) if "router_aux_loss_coef" in hf
            else True) or not 0 <= coef < 1e3:
        raise hf.fail(f"has router_aux_loss_coef = {json.dumps(coef)}: expected a number from 0 "
                      f"to 1000")
    return {"num_experts": experts, "experts_per_token": hf.number("num_experts_per_tok", 2),
            "expert_mlp_dim": hf.number(width, hf.number("intermediate_size", 0)),
            "router_aux_loss_coef": float(coef)}


def _llama(hf: HFConfig, qk_norm: bool = False, qkv_bias: bool = False,
           **experts: Any) -> ModelConfig:
    for field in ("mlp_bias", "use_sliding_window"):
        hf.flag(field, False)
    hf.refuse("hidden_act", lambda v: v == "silu", "minigpt's llama uses SwiGLU with silu")
    hf.refuse("mlp_bias", lambda v: not v, "minigpt's llama has no MLP biases")
    D, N = hf.number("hidden_size", 4096), hf.number("num_attention_heads", 32)
    context = hf.number("max_position_embeddings", 2048)
    window = hf.number("sliding_window", 0)  # Mistral's: every layer's (none past the context)
    attention_bias = hf.flag("attention_bias", False)
    head_dim = hf.number("head_dim", D // N)
    return hf.built(arch="llama", vocab_size=hf.number("vocab_size", 32000),
                    context_len=context, embed_dim=D,
                    num_heads=N, num_kv_heads=hf.number("num_key_value_heads", N),
                    mlp_dim=hf.number("intermediate_size", 11008),
                    num_layers=hf.number("num_hidden_layers", 32), dropout=0.0,
                    norm_eps=hf.number("rms_norm_eps", 1e-6, float),
                    head_size=0 if head_dim * N == D else head_dim,
                    tie_embeddings=hf.flag("tie_word_embeddings", False),
                    options=LlamaOptions(qk_norm=qk_norm, qkv_bias=qkv_bias or attention_bias,
                                         out_bias=attention_bias),
                    sliding_window=window if window < context else 0,
                    **rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling") or {},
                                  hf.number("rope_theta", 1e4, float)), **experts)


def rope_fields(hf: HFConfig, rope: Any, theta: float,
                kinds: tuple[str, ...] = ("llama3", "linear")) -> dict[str, Any]:
    """The rotary settings of one kind of layer: transformers 5 writes them as `rope_parameters`
    (theta and scaling together), earlier versions as `rope_theta` and `rope_scaling` (its kind
    as `rope_type`, or `type` in older files). `kinds` are the scalings the family implements;
    others ("dynamic", "yarn", "longrope", ...) are refused by name."""
    if not isinstance(rope, dict):
        raise hf.fail(f"has rope settings {json.dumps(rope)[:80]}: expected an object")
    rope = HFConfig(rope, hf.file)
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.number("rope_theta", theta, float)
    if kind == "default":
        return {"rope_theta": theta}
    if kind not in kinds:
        scalings = " and ".join(f"{json.dumps(k)}" for k in kinds)
        also = f" and the {scalings} scaling(s)" if kinds else ", unscaled,"
        raise hf.fail(f"has rope_type {json.dumps(kind)}: minigpt implements plain rotary "
                      f"embeddings{also} for this family")
    fields = {"rope_theta": theta, "rope_scaling": kind,
              "rope_factor": rope.number("factor", 1.0, float)}
    if kind == "llama3":
        fields |= {"rope_low_freq": rope.number("low_freq_factor", 1.0, float),
                   "rope_high_freq": rope.number("high_freq_factor", 4.0, float),
                   "rope_original_context": rope.number("original_max_position_embeddings",
                                                        8192)}
    return fields


# --- config.json out --------------------------------------------------------------------------

def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """Our rotary settings as transformers writes `rope_parameters`."""
    rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope |= {"low_freq_factor": cfg.rope_low_freq, "high_freq_factor": cfg.rope_high_freq,
                 "original_max_position_embeddings": cfg.rope_original_context}
    return rope


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    if cfg.options.out_bias and not cfg.options.qkv_bias:
        raise HubError("a llama with a bias on the attention's output projection alone has no "
                       "Hugging Face class (Llama's attention_bias puts one on all four)")
    if cfg.sliding_window_pattern:
        raise HubError("a llama whose layers alternate sliding and full attention has no "
                       "Hugging Face class (Mistral slides in every layer)")
    rope = rope_parameters(cfg)
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
             "max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
             # both spellings: transformers 5 reads the first, earlier versions the others
             "rope_parameters": rope, "rope_theta": cfg.rope_theta,
             "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
             if cfg.rope_scaling else None,
             "hidden_act": "silu", "attention_bias": cfg.options.out_bias, "mlp_bias": False,
             "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, **common}
    if cfg.sliding_window:
        if cfg.options.qk_norm or cfg.options.qkv_bias or cfg.num_experts:
            raise HubError("a sliding window is Mistral's, which has no query and key norms, "
                           "biases or experts: this model has no Hugging Face class")
        return {**llama, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": cfg.sliding_window}
    if cfg.num_experts:
        return _experts_config(cfg, llama)
    own = cfg.options
    if own.qk_norm or (own.qkv_bias and not own.out_bias):  # Qwen3 (query and key norms)
        qwen = {"use_sliding_window": False, "sliding_window": None,  # or Qwen2 (qkv biases)
                "layer_types": ["full_attention"] * cfg.num_layers}
        if cfg.options.qk_norm:
            if cfg.options.qkv_bias != cfg.options.out_bias:
                raise HubError("Qwen3's attention_bias puts biases on all four projections or "
                               "none: this model's cannot be written as Qwen3ForCausalLM")
            return {**llama, **qwen, "architectures": ["Qwen3ForCausalLM"],
                    "model_type": "qwen3"}
        return {**llama, **qwen, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    return llama


def _experts_config(cfg: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts as the Hugging Face class that computes it: Qwen3-MoE (query and
    key norms, top-k weights renormalised or not), or Mixtral (renormalised, no norms)."""
    if cfg.options.qkv_bias or cfg.options.out_bias or cfg.shared_expert_mlp_dim:
        raise HubError("a mixture of experts with attention biases or a shared expert has no "
                       "Hugging Face class minigpt writes (Mixtral and Qwen3-MoE have neither)")
    experts = {"num_experts_per_tok": cfg.experts_per_token,
               "router_aux_loss_coef": cfg.router_aux_loss_coef,
               "output_router_logits": False, "sliding_window": None}
    if cfg.options.qk_norm:
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


MAPPING = HubMapping(model_types=MODEL_TYPES, read=read, write=write, tensors=tensors,
                     tied=lambda cfg: cfg.tie_embeddings, peft=True)
