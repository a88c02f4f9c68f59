"""Gemma 3's own settings: `Gemma3Options`, what `ModelConfig.options` holds for it."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import ConfigError, FamilyOptions


@dataclass(frozen=True)
class Gemma3Options(FamilyOptions):
    """Queries scaled by 1/sqrt(query_pre_attn_scalar) (0: the head size), and the local
    layers' rotary base (0: rope_theta, the global layers')."""

    family = "gemma3"
    query_pre_attn_scalar: float = 0.0
    local_rope_theta: float = 0.0

    def check(self) -> None:
        if self.query_pre_attn_scalar < 0 or self.local_rope_theta < 0:
            raise ConfigError("model.gemma3.query_pre_attn_scalar and "
                              "model.gemma3.local_rope_theta must be >= 0 (0: the head size, "
                              "and the global layers' base)")
