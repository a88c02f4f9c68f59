"""The minigpt family: the JAX AI Stack tutorial's model (`model.MiniGPT`), its zoo entries and
its one rule of its own. No Hugging Face class computes it (it normalises after each sublayer),
so it has no hub mapping: it cannot be exported, and nothing imports as it."""

from __future__ import annotations

from minigpt.config import ConfigError, ModelConfig
from minigpt.models.family import Family
from minigpt.models.minigpt.model import MiniGPT

_STORIES = dict(tokenizer="tinystories-4k", vocab_size=4096)

ZOO = {
    # The tutorial's model: vocab 50257, context 256, 8 blocks of width 256 with 8 heads.
    "minigpt": dict(),
    # The "-tiny" sizes are for tests on CPU: every dimension a preset may split divides by 8.
    "minigpt-tiny": dict(context_len=128, embed_dim=64, num_heads=8, mlp_dim=128, num_layers=2),
    # minigpt-tiny with 8 layers: one per stage when a pipeline preset spans 8 devices.
    "minigpt-tiny8": dict(context_len=128, embed_dim=64, num_heads=8, mlp_dim=128, num_layers=8),
    # Sized for a laptop CPU and ten minutes, as llama-cpu (minigpt.models.llama).
    "minigpt-cpu": dict(**_STORIES, dropout=0.0, context_len=256, embed_dim=128, num_heads=4,
                        mlp_dim=512, num_layers=4, scan_layers=False),
}


def check(cfg: ModelConfig) -> None:
    if cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings: minigpt's output layer is its own (with a "
                          "bias, as the tutorial's model has), not the embedding table: choose "
                          "gpt2 or llama for a tied head")


FAMILY = Family(name="minigpt", module=MiniGPT, zoo=ZOO, check=check,
                about="the JAX AI Stack tutorial's model: post-norm blocks, ReLU, untied head")
