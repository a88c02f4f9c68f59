"""The Hugging Face architectures minigpt reads and writes, in minigpt's terms.

`GPT2LMHeadModel` is `gpt2`, `LlamaForCausalLM` is `llama`, and `Qwen3ForCausalLM` is `llama` with
`qk_norm` (query and key norms; otherwise Llama's decoder): for each, how config.json maps to a
`ModelConfig` (refusing, by name, what the architecture does not implement) and back, and which
Hugging Face tensor each of our parameters is, with the transposes, splits and vocabulary padding
between the two layouts. `minigpt.hub.convert` moves the weights; this module only says where they
go."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.config import ConfigError, ModelConfig


class HubError(RuntimeError):
    """An import or export cannot be done; the message says why and what to do."""


# --- what each architecture's tensors are called, and how they map to ours -------------------

@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters and the Hugging Face tensor it comes from.

    `path` is the parameter in `nnx.state(model)`; stacked block parameters ([layers, ...])
    come from one tensor per layer, named with `{i}`. The Hugging Face tensor (`hf_shape`) is
    transposed if `transpose` (PyTorch's Linear stores [out, in]), cut into `part[1]` equal
    pieces along its last axis and piece `part[0]` kept (GPT-2 fuses the query, key and value
    projections), reshaped to our per-layer shape, and its rows padded to our padded
    vocabulary if `padded`.
    """

    path: tuple[str, ...]
    name: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    part: tuple[int, int] = (0, 1)
    padded: bool = False

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name


def gpt2_tensors(cfg: ModelConfig) -> list[Tensor]:
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


def llama_tensors(cfg: ModelConfig) -> list[Tensor]:
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
    if cfg.qk_norm:  # Qwen3
        out += [Tensor((*block, "attention", f"{x}_norm", "scale"),
                       f"{layer}.self_attn.{x}_norm.weight", (cfg.head_dim,)) for x in "qk"]
    if cfg.qkv_bias:  # Qwen2
        out += [Tensor((*block, "attention", ours, "bias"), f"{layer}.self_attn.{hf}.bias",
                       (rows,)) for ours, hf, rows in (("query", "q_proj", q),
                                                       ("key", "k_proj", kv),
                                                       ("value", "v_proj", kv))]
    if cfg.out_bias:
        out.append(Tensor((*block, "attention", "out", "bias"), f"{layer}.self_attn.o_proj.bias",
                          (D,)))
    if not cfg.tie_embeddings:
        out.append(Tensor(("output", "kernel"), "lm_head.weight", (V, D), padded=True))
    return out


TENSORS: dict[str, Callable[[ModelConfig], list[Tensor]]] = {"gpt2": gpt2_tensors,
                                                            "llama": llama_tensors}
# Buffers some files carry that are not parameters: GPT-2's causal masks, old rotary tables.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def to_ours(tensor: Tensor, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A Hugging Face array as our parameter (per layer, vocabulary rows not yet padded): a
    view of `hf` where possible, so slicing it reads only the slice."""
    x = hf.T if tensor.transpose else hf
    which, pieces = tensor.part
    width = x.shape[-1] // pieces
    x = x[..., which * width:(which + 1) * width]
    rows = (tensor.hf_shape[0],) if tensor.padded else shape[:1]
    return x.reshape(rows + tuple(shape[1:]))


def to_hf(tensor: Tensor, ours: np.ndarray) -> np.ndarray:
    """The inverse of `to_ours` for one piece: our per-layer array as (a part of) the Hugging
    Face tensor, padding rows dropped."""
    if tensor.padded:
        ours = ours[:tensor.hf_shape[0]]
    shape = tensor.hf_shape[::-1] if tensor.transpose else tensor.hf_shape
    shape = (*shape[:-1], shape[-1] // tensor.part[1])
    x = ours.reshape(shape)
    return x.T if tensor.transpose else x


# --- reading a Hugging Face directory -------------------------------------------------------

def model_config(hf: dict[str, Any]) -> ModelConfig:
    """Our model config from a Hugging Face config.json, refusing what we do not implement."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf)
    if kind in ("llama", "mistral"):
        return _llama_config(hf)
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
    raise HubError(f"config.json has model_type {kind!r}: minigpt imports 'gpt2' "
                   f"(GPT2LMHeadModel), 'llama' (LlamaForCausalLM: Llama 2 and 3, TinyLlama, "
                   f"SmolLM2), 'mistral', 'qwen2' and 'qwen3'")


def _number(hf: dict[str, Any], field: str, default: Any, kind: type = int) -> Any:
    """A number config.json gives (or its default): of the right type and positive, checked
    before any arithmetic is done with it."""
    value = hf.get(field)
    if value is None:
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e30
    if not ok:
        raise HubError(f"config.json has {field} = {json.dumps(value)}: expected a positive "
                       f"{'integer' if kind is int else 'number'}")
    return value


def _refuse(hf: dict[str, Any], field: str, allowed: Callable[[Any], bool], why: str) -> None:
    if field in hf and not allowed(hf[field]):
        raise HubError(f"config.json has {field} = {json.dumps(hf[field])}: {why}")


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
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


def _llama_config(hf: dict[str, Any], qk_norm: bool = False,
                  qkv_bias: bool = False) -> ModelConfig:
    _refuse(hf, "hidden_act", lambda v: v == "silu", "minigpt's llama uses SwiGLU with silu")
    _refuse(hf, "mlp_bias", lambda v: not v, "minigpt's llama has no MLP biases")
    D, N = _number(hf, "hidden_size", 4096), _number(hf, "num_attention_heads", 32)
    context = _number(hf, "max_position_embeddings", 2048)
    _refuse(hf, "sliding_window", lambda v: v is None or (isinstance(v, int) and v >= context),
            "minigpt's llama attends to the whole context (a sliding window shorter than the "
            "context is not implemented)")
    attention_bias = hf.get("attention_bias", False)
    if not isinstance(attention_bias, bool):
        raise HubError(f"config.json has attention_bias = {json.dumps(attention_bias)}: "
                       f"expected true or false")
    head_dim = _number(hf, "head_dim", D // N)
    return _built(arch="llama", vocab_size=_number(hf, "vocab_size", 32000),
                  context_len=context, embed_dim=D,
                  num_heads=N, num_kv_heads=_number(hf, "num_key_value_heads", N),
                  mlp_dim=_number(hf, "intermediate_size", 11008),
                  num_layers=_number(hf, "num_hidden_layers", 32), dropout=0.0,
                  norm_eps=_number(hf, "rms_norm_eps", 1e-6, float),
                  head_size=0 if head_dim * N == D else head_dim,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=qk_norm,
                  qkv_bias=qkv_bias or attention_bias, out_bias=attention_bias,
                  **_rope_fields(hf))


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5 writes them as `rope_parameters` (theta and scaling
    together), earlier versions as `rope_theta` and `rope_scaling` (its kind as `rope_type`, or
    `type` in older files). Llama 3's "llama3" scaling and "linear" are implemented; others
    ("dynamic", "yarn", "longrope", ...) are refused by name."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HubError(f"config.json has rope settings {json.dumps(rope)[:80]}: expected an "
                       f"object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = _number(rope, "rope_theta", _number(hf, "rope_theta", 1e4, float), float)
    if kind == "default":
        return {"rope_theta": theta}
    if kind not in ("llama3", "linear"):
        raise HubError(f"config.json has rope_type {json.dumps(kind)}: minigpt implements "
                       f"plain rotary embeddings and the 'llama3' and 'linear' scalings")
    fields = {"rope_theta": theta, "rope_scaling": kind,
              "rope_factor": _number(rope, "factor", 1.0, float)}
    if kind == "llama3":
        fields |= {"rope_low_freq": _number(rope, "low_freq_factor", 1.0, float),
                   "rope_high_freq": _number(rope, "high_freq_factor", 4.0, float),
                   "rope_original_context": _number(rope, "original_max_position_embeddings",
                                                    8192)}
    return fields


def _built(**fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise HubError(f"config.json describes a model minigpt cannot build: {error}") from None


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

