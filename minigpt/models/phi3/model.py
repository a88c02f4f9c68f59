"""Phi-3 (and Phi-4-mini): Microsoft's decoder (Abdin et al., 2024) as `Phi3ForCausalLM`
computes it. Llama's block: RMSNorm before each sublayer, rotary positions, grouped-query
attention, SwiGLU, a final RMSNorm; the rotary embedding turns the first
`partial_rotary_factor` of each head's features (Phi-4-mini: 0.75) and passes the rest; a
sliding window on every layer where the config names one (Phi-3-mini's 2,047). Its checkpoints
fuse the query, key and value projections and the gate and up projections, which minigpt keeps
apart (the fused tensors are cut and joined by its table, `hub`).
"""

from __future__ import annotations

import math

from flax import nnx

from minigpt.config import ModelConfig
from minigpt.models.layers import Attention, RMSNorm, dropout, split_keys
from minigpt.models.llama.model import Llama, SwiGLU

normal = nnx.initializers.normal(0.02)


def rotary_dim(cfg: ModelConfig) -> int:
    """The features of a head the rotary embedding turns, as transformers rounds them."""
    return int(cfg.head_dim * cfg.options.partial_rotary_factor)


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        residual = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        self.norm1 = RMSNorm(cfg, rngs=rngs)
        self.attention = Attention(cfg, use_bias=False, rope=True, init=normal,
                                   out_init=residual, rotary_dim=rotary_dim(cfg), rngs=rngs)
        self.norm2 = RMSNorm(cfg, rngs=rngs)
        self.mlp = SwiGLU(cfg, out_init=residual, rngs=rngs)
        self.rate = cfg.dropout

    def __call__(self, x, attn, kv, keys):
        keys = split_keys(keys, 2)  # per-row keys for the two dropouts
        y, kv = self.attention(self.norm1(x), attn, kv)
        x = x + dropout(y, self.rate, keys[0])
        return x + dropout(self.mlp(self.norm2(x)), self.rate, keys[1]), kv


class Phi3(Llama):
    """Llama's frame around Phi-3's block."""

    Block = TransformerBlock
