"""The GPT-2 family: OpenAI's GPT-2 as nanoGPT writes it (`model.GPT2`), its zoo sizes, and its
Hugging Face mapping (`hub`: `GPT2LMHeadModel`). Its output head is always the token
embedding."""

from __future__ import annotations

from minigpt.models.family import Family
from minigpt.models.gpt2.hub import MAPPING
from minigpt.models.gpt2.model import GPT2

_GPT2 = dict(norm_eps=1e-5, dropout=0.0)

ZOO = {
    # GPT-2's 124M shape (12 layers, 12 heads, width 768, context 1024).
    "gpt2-small": dict(**_GPT2, context_len=1024, embed_dim=768, num_heads=12, mlp_dim=3072,
                       num_layers=12),
    "gpt2-mini": dict(**_GPT2, context_len=256, embed_dim=256, num_heads=8, mlp_dim=1024,
                      num_layers=4),
    "gpt2-tiny": dict(**_GPT2, context_len=128, embed_dim=64, num_heads=8, mlp_dim=256,
                      num_layers=2),
}

FAMILY = Family(name="gpt2", module=GPT2, zoo=ZOO, hub=MAPPING,
                about="OpenAI's GPT-2: learned positions, pre-norm, GELU, tied head")
