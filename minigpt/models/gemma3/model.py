"""Gemma 3 (text): Google DeepMind's decoder (Gemma Team, 2025) as `Gemma3ForCausalLM` computes it.

What sets it apart from Llama: every norm stores its scale as a difference from 1 (it starts at
0 and multiplies by 1 + w), and each sublayer is wrapped in two of them, one before and one
after (the attention's and the feed-forward's outputs are normalised before they join the
residual stream); queries and keys are RMS-normalised per head; queries are scaled by
1/sqrt(query_pre_attn_scalar) rather than 1/sqrt(H); the token embeddings are multiplied by
sqrt(D); the feed-forward is GeGLU (the tanh approximation of GELU, gated); the output head is
the embedding table. Five of every six layers are local (`model.sliding_window` with
`model.sliding_window_pattern` 6: a window of keys, rotary base
`model.gemma3.local_rope_theta`), the
sixth global (the whole context, base `model.rope_theta`, with any rope scaling).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.models.decoder import BlockStack, DecoderLM
from minigpt.models.layers import Attention, Dense, Embedding, RMSNorm, dropout, split_keys

normal = nnx.initializers.normal(0.02)
gelu = functools.partial(jax.nn.gelu, approximate=True)  # transformers' gelu_pytorch_tanh


class GeGLU(nnx.Module):
    """gelu(x W_gate) * (x W_up), then W_down."""

    def __init__(self, cfg: ModelConfig, *, out_init, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.mlp_dim
        common = dict(use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.gate = Dense("BTD,DF->BTF", (D, F), ("embed", "mlp"), init=normal, **common)
        self.up = Dense("BTD,DF->BTF", (D, F), ("embed", "mlp"), init=normal, **common)
        self.down = Dense("BTF,FD->BTD", (F, D), ("mlp", "embed"), init=out_init, **common)

    def __call__(self, x):
        return self.down(gelu(self.gate(x)) * self.up(x))  # [B, T, D]


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        residual = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        norm = functools.partial(RMSNorm, cfg, unit_offset=True, rngs=rngs)
        self.norm1, self.norm1_out, self.norm2, self.norm2_out = norm(), norm(), norm(), norm()
        self.attention = Attention(
            cfg, use_bias=False, rope=True, init=normal, out_init=residual, qk_norm=True,
            norm_offset=True,
            query_scale=(cfg.options.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
            local_rope_theta=cfg.options.local_rope_theta, rngs=rngs)
        self.mlp = GeGLU(cfg, out_init=residual, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(self.norm1(x), attn, kv)
        x = x + dropout(self.norm1_out(y), self.rate, keys[0])
        y = self.norm2_out(self.mlp(self.norm2(x)))
        return x + dropout(y, self.rate, keys[1]), kv


class Gemma3(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.tokens = Embedding(cfg.padded_vocab, cfg.embed_dim, ("vocab", "embed"),
                                init=normal, dtype=cfg.dtype, rngs=rngs)
        self.blocks = BlockStack(lambda r: TransformerBlock(cfg, rngs=r), cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg, unit_offset=True, rngs=rngs)

    def embed(self, tokens, positions, keys=None):
        x = self.tokens(tokens)  # [B, T, D]; positions enter through the rotary embedding
        return x * jnp.asarray(math.sqrt(self.config.embed_dim), x.dtype)

    def head(self, x):
        return self.tokens.attend(self.final_norm(x))  # tied: [..., V]
