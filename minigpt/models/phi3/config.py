"""Phi-3's own setting: `Phi3Options`, what `ModelConfig.options` holds for it."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import ConfigError, FamilyOptions


@dataclass(frozen=True)
class Phi3Options(FamilyOptions):
    """`partial_rotary_factor`: the fraction of each head's features the rotary embedding
    turns (the first ones; Phi-4-mini's 0.75), the rest passed through; 1: all of them."""

    family = "phi3"
    partial_rotary_factor: float = 1.0

    def check(self) -> None:
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"model.phi3.partial_rotary_factor must be in (0, 1], got "
                              f"{self.partial_rotary_factor}")
