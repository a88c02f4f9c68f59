"""How to run what a preset lays out: settings of the program, never of the numbers (every choice
computes the same losses and gradients). They travel in the context model code runs in
(`minigpt.sharding.context`), which compiled programs are keyed on.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How a pipeline preset runs the block stack: settings of the program, never of the numbers
    (every choice computes the same losses and gradients)."""

    microbatches: int = 0  # M: pieces each batch goes through the stages in; 0: two per stage
    # minigpt.pipeline.schedules: "gpipe" or "1f1b"; "": 1f1b (faster at the default M in
    # bench/RESULTS.md, and its memory does not grow with M), or gpipe for the circular schedule
    schedule: str = ""
    repeats: int = 1  # R > 1: the circular schedule, each stage holding R chunks of layers

    def __post_init__(self) -> None:
        if not self.schedule:
            object.__setattr__(self, "schedule", "gpipe" if self.repeats > 1 else "1f1b")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How attention runs where the rules split `seq` over several devices
    (`minigpt.parallel.ring`): settings of the program, never of the numbers."""

    strategy: str = "ring"  # "ring" or "all_gather" (minigpt.config.CONTEXT_STRATEGIES)
    # The model runs its positions in dual-chunk order: of 2N chunks, device i holds chunks i
    # and 2N-1-i, so causal attention gives every device the same work.
    balanced: bool = True
    # Queries per tile of a pair of chunks (minigpt.parallel.blocks): the [tile, C] scores of a
    # tile stay in cache for small heads and keep the temporaries linear in the chunk length C.
    tile: int = 128


def default_microbatches(stages: int) -> int:
    """Pipeline microbatches when none are configured: 2 per stage (a GPipe bubble under 1/3)."""
    return 2 * stages


@dataclasses.dataclass(frozen=True)
class Experts:
    """How a mixture of experts' rows meet their experts where the rules split the experts
    over devices (`minigpt.parallel.experts`): "tokens" travel to their experts' devices and
    back by all-to-all, or the experts' "weights" are gathered to every device as FSDP does
    (what the compiler does unaided; bench/bench_moe.py measures both)."""

    move: str = "tokens"

    def __post_init__(self) -> None:
        if self.move not in ("tokens", "weights"):
            raise ValueError(f"experts move 'tokens' or 'weights', not {self.move!r}")
