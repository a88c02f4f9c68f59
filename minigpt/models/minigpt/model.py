"""MiniGPT: the model of the JAX AI Stack miniGPT tutorial, so results compare with it.

Learned token and position embeddings, post-LayerNorm blocks (normalise after each residual
sum, as in the original Transformer), ReLU feed-forward, dropout on each sublayer's output and
an untied output layer with a bias. Weights use Xavier-uniform initialisation, embeddings a
normal with variance 1/D, as the tutorial's Flax defaults do.
"""

from __future__ import annotations

import jax
from flax import nnx

from minigpt.config import ModelConfig
from minigpt.models.decoder import BlockStack, DecoderLM
from minigpt.models.layers import (
    MLP,
    Attention,
    Dense,
    Embedding,
    LayerNorm,
    dropout,
    split_keys,
)

xavier = nnx.initializers.xavier_uniform()
embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attention = Attention(cfg, use_bias=True, rope=False, init=xavier, out_init=xavier,
                                   rngs=rngs)
        self.norm1 = LayerNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, activation=jax.nn.relu, use_bias=True, init=xavier, out_init=xavier,
                       rngs=rngs)
        self.norm2 = LayerNorm(cfg, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(x, attn, kv)
        x = self.norm1(x + dropout(y, self.rate, keys[0]))
        x = self.norm2(x + dropout(self.mlp(x), self.rate, keys[1]))
        return x, kv


class MiniGPT(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.tokens = Embedding(cfg.padded_vocab, cfg.embed_dim, ("vocab", "embed"),
                                init=embed_init, dtype=cfg.dtype, rngs=rngs)
        self.positions = Embedding(cfg.context_len, cfg.embed_dim, (None, "embed"),
                                   init=embed_init, dtype=cfg.dtype, rngs=rngs)
        self.blocks = BlockStack(lambda r: TransformerBlock(cfg, rngs=r), cfg, rngs=rngs)
        # [V, D] like an embedding table: the faster layout for the matmuls of the fused loss,
        # which applies the head to [rows, D] chunks as well as to [B, T, D].
        self.output = Dense("...D,VD->...V", (cfg.padded_vocab, cfg.embed_dim), ("vocab", "embed"),
                            init=xavier, use_bias=True, dtype=cfg.dtype, rngs=rngs)

    def embed(self, tokens, positions, keys=None):
        # The tutorial applies no dropout to the embeddings.
        return self.tokens(tokens) + self.positions(positions)  # [B, T, D]

    def head(self, x):
        return self.output(x)  # [B, T, V]
