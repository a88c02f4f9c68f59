"""GPT-2: the architecture of OpenAI's GPT-2 (Radford et al., 2019), as nanoGPT writes it.

Learned token and position embeddings with dropout, pre-LayerNorm blocks (normalise the input
of each sublayer, add its output to the residual stream), GELU feed-forward of width 4D, a final
LayerNorm and an output head tied to the token embedding. Weights start from N(0, 0.02); the two
projections that write into the residual stream start 1/sqrt(2L) smaller, so the stream's
variance does not grow with depth.
"""

from __future__ import annotations

import functools
import math

import jax
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.models.decoder import BlockStack, DecoderLM
from minigpt.models.layers import (
    MLP,
    Attention,
    Embedding,
    LayerNorm,
    dropout,
    split_keys,
)

normal = nnx.initializers.normal(0.02)


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        residual = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        self.norm1 = LayerNorm(cfg, rngs=rngs)
        self.attention = Attention(cfg, use_bias=True, rope=False, init=normal,
                                   out_init=residual, rngs=rngs)
        self.norm2 = LayerNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, activation=functools.partial(jax.nn.gelu, approximate=True),
                       use_bias=True, init=normal, out_init=residual, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(self.norm1(x), attn, kv)
        x = x + dropout(y, self.rate, keys[0])
        x = x + dropout(self.mlp(self.norm2(x)), self.rate, keys[1])
        return x, kv


class GPT2(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.tokens = Embedding(cfg.padded_vocab, cfg.embed_dim, ("vocab", "embed"),
                                init=normal, dtype=cfg.dtype, rngs=rngs)
        self.positions = Embedding(cfg.context_len, cfg.embed_dim, (None, "embed"),
                                   init=normal, dtype=cfg.dtype, rngs=rngs)
        self.blocks = BlockStack(lambda r: TransformerBlock(cfg, rngs=r), cfg, rngs=rngs)
        self.final_norm = LayerNorm(cfg, rngs=rngs)

    def embed(self, tokens, positions, keys=None):
        x = self.tokens(tokens) + self.positions(positions)  # [B, T, D]
        return dropout(x, self.config.dropout, keys)

    def head(self, x):
        return self.tokens.attend(self.final_norm(x))  # tied: [..., V]
