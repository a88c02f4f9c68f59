"""Training: `python -m minigpt.train` and `minigpt.train(model_cfg, train_cfg)`.

The package's modules: `trainer` (the run's story: the `train` function), `cli` (its command
line), `recipes` (named ways to train, from recipes/*.toml), `steps` (the compiled train and
eval steps), `optimizer` (AdamW, Muon), `lr_schedule` (warm-up, hold, cosine), `budget` (time
budgets), `metrics` (metrics.jsonl, TensorBoard, progress, plot, profiler), `flops` (model FLOPs
and device peaks for MFU) and `lock` (one trainer per run directory).

`minigpt.train` is this package and its `train` function at once: `minigpt.train(...)` and
`minigpt.train.train(...)` both train. `main` is the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from minigpt import CallableModule


def train(model_cfg, train_cfg, *, resume: bool = False, sample: bool = True) -> dict[str, Any]:
    """Train (or, with `resume`, continue) a model of config `model_cfg` as `train_cfg` says;
    returns a summary of the run (`minigpt.train.trainer.train`)."""
    from minigpt.train.trainer import train as run_training

    return run_training(model_cfg, train_cfg, resume=resume, sample=sample)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt.train`: the command line (`minigpt.train.cli`) around `train`."""
    import minigpt.train.cli as cli

    return cli.run(argv, train)


sys.modules[__name__].__class__ = CallableModule  # minigpt.train(...) calls train(...)
