"""The Gemma 3 family (text): its module (`model.Gemma3`), a zoo size for tests, its own
config fields (the query scale, the local layers' rotary base) and its Hugging Face mapping
(`hub`: `Gemma3ForCausalLM`, and the text weights of `Gemma3ForConditionalGeneration`)."""

from __future__ import annotations

from minigpt.config import ConfigError, ModelConfig
from minigpt.models.family import Family
from minigpt.models.gemma3.config import Gemma3Options
from minigpt.models.gemma3.hub import MAPPING
from minigpt.models.gemma3.model import Gemma3

ZOO = {
    # For tests on CPU: six layers, five local (a window of 16) and one global, as Gemma 3's
    # pattern; TinyStories' vocabulary.
    "gemma3-tiny": dict(tokenizer="tinystories-4k", vocab_size=4096, context_len=128,
                        embed_dim=64, num_heads=4, num_kv_heads=2, head_size=16, mlp_dim=128,
                        num_layers=6, dropout=0.0, rope_theta=1e6, sliding_window=16,
                        sliding_window_pattern=6, tie_embeddings=True,
                        options=Gemma3Options(query_pre_attn_scalar=16.0,
                                              local_rope_theta=1e4)),
}

SHARED = frozenset({"rope_scaling", "rope_factor"})


def check(cfg: ModelConfig) -> None:
    if cfg.rope_scaling not in ("", "linear"):
        raise ConfigError(f"model.rope_scaling {cfg.rope_scaling!r}: Gemma 3 scales its global "
                          f"layers' rotary frequencies linearly or not at all")


FAMILY = Family(name="gemma3", module=Gemma3, zoo=ZOO, options=Gemma3Options, shared=SHARED,
                check=check, gated_mlp=True, hub=MAPPING,
                about="Google's Gemma 3 (text): norms around each sublayer, GeGLU, local and "
                      "global layers")
