"""The OLMo 2 family: AI2's open decoder (`model.Olmo2`: norms after each sublayer, queries
and keys normalised over the whole projection), a zoo size that trains on a CPU, and its
Hugging Face mapping (`hub`: `Olmo2ForCausalLM`)."""

from __future__ import annotations

from minigpt.models.family import Family
from minigpt.models.olmo2.hub import MAPPING
from minigpt.models.olmo2.model import Olmo2

ZOO = {
    # For tests and a laptop: llama-tiny's shape with OLMo 2's block, TinyStories' vocabulary.
    "olmo2-tiny": dict(tokenizer="tinystories-4k", vocab_size=4096, context_len=128,
                       embed_dim=128, num_heads=16, num_kv_heads=8, mlp_dim=256, num_layers=2,
                       norm_eps=1e-6, dropout=0.0),
}

# Rotary scaling as Llama 3.1+ (transformers' Olmo2 takes any rope_parameters).
SHARED = frozenset({"rope_scaling", "rope_factor", "rope_low_freq", "rope_high_freq",
                    "rope_original_context"})

FAMILY = Family(name="olmo2", module=Olmo2, zoo=ZOO, shared=SHARED, gated_mlp=True,
                hub=MAPPING,
                about="AI2's OLMo 2: norms after each sublayer, queries and keys normalised "
                      "over the whole projection, SwiGLU")
