"""The Hugging Face architectures' tensors, in minigpt's terms: one table read both ways.

For each of our parameters, the Hugging Face tensor it is (`Tensor`: its name, with the layer
and, for experts, the expert as placeholders) and the transposes, splits and vocabulary padding
between the two layouts. GPT-2 is `gpt2`; every Llama-family checkpoint (Llama 2 and 3, Mistral,
Qwen2, Qwen3, Mixtral, Qwen3-MoE) is `llama` with fields, so one table serves them all. How their
config.json maps to a `ModelConfig` and back is `minigpt.hub.configs`; `minigpt.hub.convert`
moves the weights: this module only says where they go."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from minigpt.config import ModelConfig


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

    @property
    def stack_depth(self) -> int:
        """Leading axes of ours that are one file tensor each: layers ({i}), then experts
        ({e}, an expert's weights stacked [layers, experts, ...])."""
        return ("{i}" in self.name) + ("{e}" in self.name)


def instances(tensor: Tensor, cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The (layer, expert) indices of the file tensors one of our parameters is made of."""
    counts = [cfg.num_layers, cfg.num_experts][:tensor.stack_depth]
    return [tuple(int(i) for i in ids) for ids in np.ndindex(*counts)]


def hf_name(tensor: Tensor, ids: tuple[int, ...]) -> str:
    """The file's name of the tensor at (layer, expert) `ids`."""
    return tensor.name.format(**dict(zip("ie", ids)))


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
    if cfg.num_experts:  # the feed-forward is experts: Qwen3-MoE's names, or Mixtral's
        out = [t for t in out if t.path[:3] != (*block, "mlp")]
        E, X = cfg.num_experts, cfg.expert_dim
        moe = (*block, "mlp")
        sparse, weights = (("mlp", ("gate_proj", "up_proj", "down_proj")) if cfg.qk_norm
                           else ("block_sparse_moe", ("w1", "w3", "w2")))
        expert = f"{layer}.{sparse}.experts.{{e}}"
        out += [Tensor((*moe, "router", "kernel"), f"{layer}.{sparse}.gate.weight", (E, D),
                       transpose=True),
                *[Tensor((*moe, "experts", ours, "kernel"), f"{expert}.{hf}.weight", shape,
                         transpose=True)
                  for ours, hf, shape in zip(("gate", "up", "down"), weights,
                                             ((X, D), (X, D), (D, X)))]]
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
