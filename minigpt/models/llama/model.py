"""Llama: the decoder of Touvron et al. (2023) at small scale.

RMSNorm before each sublayer, rotary position embeddings on queries and keys (no learned
positions), grouped-query attention (several query heads share one key/value head, which
shrinks the KV cache), a SwiGLU feed-forward (silu(x W_gate) * x W_up, then W_down), no biases,
a final RMSNorm and an output head, untied unless `tie_embeddings` (SmolLM2 ties it). With
`options.qk_norm` each query and key head is RMS-normalised before the rotary embedding, as in Qwen3
(Yang et al., 2025), which keeps attention scores from growing and lets small models learn
faster (bench/RESULTS.md). With `num_experts` the feed-forward of every layer is a mixture of
experts instead (`minigpt.models.moe`: Mixtral, Qwen3-MoE, OLMoE).
"""

from __future__ import annotations

import math

import jax
from flax import nnx

import minigpt.models.fp8 as fp8
import minigpt.models.kernels as kernels
from minigpt.config import ModelConfig
from minigpt.models.decoder import BlockStack, DecoderLM
from minigpt.models.layers import (
    Attention,
    Dense,
    Embedding,
    RMSNorm,
    dropout,
    split_keys,
)
from minigpt.models.moe import MoE

normal = nnx.initializers.normal(0.02)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, out_init, width: int = 0, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, width or cfg.mlp_dim
        common = dict(use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.gate = Dense("BTD,DF->BTF", (D, F), ("embed", "mlp"), init=normal, **common)
        self.up = Dense("BTD,DF->BTF", (D, F), ("embed", "mlp"), init=normal, **common)
        self.down = Dense("BTF,FD->BTD", (F, D), ("mlp", "embed"), init=out_init, **common)

    def __call__(self, x):
        # Adapters beside each, or FP8 products (model.fp8): each projection on its own
        if self.gate.lora is not None or self.up.lora is not None or fp8.active():
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))  # [B, T, D]
        dtype = self.gate.dtype
        hidden = kernels.active().gated_activation(  # silu(gate(x)) * up(x)
            x.astype(dtype), self.gate.kernel[...].astype(dtype), self.up.kernel[...].astype(dtype))
        return self.down(hidden)  # [B, T, D]


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        residual = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        self.norm1 = RMSNorm(cfg, rngs=rngs)
        own = cfg.options  # LlamaOptions
        self.attention = Attention(cfg, use_bias=own.qkv_bias, rope=True, init=normal,
                                   out_init=residual, qk_norm=own.qk_norm,
                                   out_bias=own.out_bias, rngs=rngs)
        self.norm2 = RMSNorm(cfg, rngs=rngs)
        if cfg.num_experts:
            shared = cfg.shared_expert_mlp_dim and SwiGLU(
                cfg, out_init=residual, width=cfg.shared_expert_mlp_dim, rngs=rngs)
            self.mlp = MoE(cfg, out_init=residual, shared=shared or None, rngs=rngs)
        else:
            self.mlp = SwiGLU(cfg, out_init=residual, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        """(x, kv), and for a mixture of experts (x, kv, the router's report: see
        `minigpt.models.moe`)."""
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(self.norm1(x), attn, kv)
        x = x + dropout(y, self.rate, keys[0])
        if not isinstance(self.mlp, MoE):
            return x + dropout(self.mlp(self.norm2(x)), self.rate, keys[1]), kv
        y, aux = self.mlp(self.norm2(x), dropless=kv is not None)  # decoding: dropless
        return x + dropout(y, self.rate, keys[1]), kv, aux


class Llama(DecoderLM):
    """The token embedding, the stacked blocks, a final RMSNorm and the output head (the
    embedding where tied). Families with Llama's frame and a block of their own (OLMo 2,
    Phi-3) subclass it with their `Block`."""

    Block = TransformerBlock

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.tokens = Embedding(cfg.padded_vocab, cfg.embed_dim, ("vocab", "embed"),
                                init=normal, dtype=cfg.dtype, rngs=rngs)
        self.blocks = BlockStack(lambda r: self.Block(cfg, rngs=r), cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        self.output = None if cfg.tie_embeddings else Dense(
            "...D,VD->...V", (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"), init=normal,
            use_bias=False, dtype=cfg.dtype, rngs=rngs)

    def embed(self, tokens, positions, keys=None):
        return self.tokens(tokens)  # [B, T, D]; positions enter through the rotary embedding

    def head(self, x):
        x = self.final_norm(x)
        return self.tokens.attend(x) if self.output is None else self.output(x)  # [..., V]
