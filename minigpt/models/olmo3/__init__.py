"""The OLMo 3 family: OLMo 2's block (`minigpt.models.olmo2.model.Olmo2`) with sliding-window
attention on all but every N-th layer, a zoo size that trains on a CPU, and its Hugging Face
mapping (`hub`: `Olmo3ForCausalLM`)."""

from __future__ import annotations

from minigpt.config import ConfigError, ModelConfig
from minigpt.models.family import Family
from minigpt.models.olmo2.model import Olmo2
from minigpt.models.olmo3.hub import MAPPING

ZOO = {
    # For tests and a laptop: olmo2-tiny with four layers, three local (a window of 16) to
    # one global, as OLMo 3 has them.
    "olmo3-tiny": dict(tokenizer="tinystories-4k", vocab_size=4096, context_len=128,
                       embed_dim=128, num_heads=16, num_kv_heads=8, mlp_dim=256, num_layers=4,
                       norm_eps=1e-6, dropout=0.0, sliding_window=16, sliding_window_pattern=4),
}


def check(cfg: ModelConfig) -> None:
    if cfg.rope_scaling:
        raise ConfigError(f"model.rope_scaling {cfg.rope_scaling!r}: minigpt's olmo3 rotates "
                          f"without scaling (OLMo 3's YaRN is not implemented)")


FAMILY = Family(name="olmo3", module=Olmo2, zoo=ZOO, check=check, gated_mlp=True, hub=MAPPING,
                about="AI2's OLMo 3: OLMo 2's block, sliding windows on three layers of four")
