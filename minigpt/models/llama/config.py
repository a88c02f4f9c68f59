"""The Llama family's own settings: `LlamaOptions`, what `ModelConfig.options` holds for
it."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import FamilyOptions


@dataclass(frozen=True)
class LlamaOptions(FamilyOptions):
    """What Llama's relatives add to its attention. `qk_norm`: RMSNorm over each query and key
    head (a learned scale per head feature, shared by the heads) before the rotary embedding,
    as Qwen3 does (Hugging Face calls such a model Qwen3ForCausalLM); `qkv_bias`: biases on the
    query, key and value projections (Qwen2), and `out_bias` on the output projection too
    (Llama's `attention_bias`). Runs from before these fields have none of them."""

    family = "llama"
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
