"""OLMo 2: AI2's fully open decoder (Team OLMo, 2025) as `Olmo2ForCausalLM` computes it.

What sets it apart from Llama: no norm before a sublayer, one after each instead (the
attention's and the feed-forward's outputs are RMS-normalised before they join the residual
stream, `post_attention_layernorm` and `post_feedforward_layernorm`), and queries and keys
RMS-normalised over the whole projection (one scale per feature of every head, `q_norm` of
heads x head size) before the rotary embedding. The rest is Llama's: rotary positions,
grouped-query attention, SwiGLU, a final RMSNorm and an untied output head (or tied, as the
config says).
"""

from __future__ import annotations

import math

import jax
from flax import nnx

import minigpt.models.kernels as kernels
from minigpt.config import ModelConfig
from minigpt.models.execution import compute_dtype
from minigpt.models.layers import (
    Attention,
    RMSNorm,
    dropout,
    param,
    split_keys,
)
from minigpt.models.llama.model import Llama, SwiGLU

normal = nnx.initializers.normal(0.02)


class ProjectionNorm(nnx.Module):
    """RMSNorm over every head's features at once, [B, T, N, H] -> the same: a scale [N, H]
    (OLMo's `q_norm` and `k_norm`, of N x H features), statistics in float32."""

    def __init__(self, cfg: ModelConfig, heads: int, axis: str, *, rngs: nnx.Rngs):
        self.eps, self.dtype = cfg.norm_eps, compute_dtype(cfg.dtype)
        self.scale = param(rngs, nnx.initializers.ones, (heads, cfg.head_dim), (axis, "kv"))

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(*x.shape[:-2], -1)  # [B, T, N * H]
        y = kernels.active().normalize(flat, self.scale[...].reshape(-1), None, self.eps, False)
        return y.reshape(x.shape).astype(self.dtype)


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        residual = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        norms = (ProjectionNorm(cfg, cfg.num_heads, "heads", rngs=rngs),
                 ProjectionNorm(cfg, cfg.kv_heads, "kv_heads", rngs=rngs))
        self.attention = Attention(cfg, use_bias=False, rope=True, init=normal,
                                   out_init=residual, qk_norms=norms, rngs=rngs)
        self.norm1_out = RMSNorm(cfg, rngs=rngs)
        self.mlp = SwiGLU(cfg, out_init=residual, rngs=rngs)
        self.norm2_out = RMSNorm(cfg, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(x, attn, kv)
        x = x + dropout(self.norm1_out(y), self.rate, keys[0])
        return x + dropout(self.norm2_out(self.mlp(x)), self.rate, keys[1]), kv


class Olmo2(Llama):
    """Llama's frame around OLMo 2's block."""

    Block = TransformerBlock
