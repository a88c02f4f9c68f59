"""The Phi-3 family (and Phi-4-mini): Microsoft's decoder (`model.Phi3`: Llama's block with a
partial rotary embedding), its own setting (`Phi3Options`), a zoo size that trains on a CPU,
and its Hugging Face mapping (`hub`: `Phi3ForCausalLM`, fused projections)."""

from __future__ import annotations

from minigpt.config import ConfigError, ModelConfig
from minigpt.models.family import Family
from minigpt.models.phi3.config import Phi3Options
from minigpt.models.phi3.hub import MAPPING
from minigpt.models.phi3.model import Phi3, rotary_dim

ZOO = {
    # For tests and a laptop: llama-tiny's width, Phi-4-mini's partial rotary embedding (12
    # of each head's 16 features turned) and tied head, TinyStories' vocabulary.
    "phi3-tiny": dict(tokenizer="tinystories-4k", vocab_size=4096, context_len=128,
                      embed_dim=128, num_heads=8, num_kv_heads=4, mlp_dim=256, num_layers=2,
                      norm_eps=1e-5, dropout=0.0, tie_embeddings=True,
                      options=Phi3Options(partial_rotary_factor=0.75)),
}


def check(cfg: ModelConfig) -> None:
    turned = rotary_dim(cfg)
    if turned < 2 or turned % 2:
        raise ConfigError(f"model.phi3.partial_rotary_factor {cfg.options.partial_rotary_factor}"
                          f" turns {turned} of a head's {cfg.head_dim} features: the rotary "
                          f"embedding turns them in pairs, so it must be an even number")


FAMILY = Family(name="phi3", module=Phi3, zoo=ZOO, options=Phi3Options, check=check,
                gated_mlp=True, hub=MAPPING,
                about="Microsoft's Phi-3 and Phi-4-mini: Llama's block, a partial rotary "
                      "embedding, fused projections in its checkpoints")
