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


def train(model_cfg=None, train_cfg=None, *, resume: bool = False, sample: bool = True,
          check_memory: bool = True) -> dict[str, Any]:
    """Train (or, with `resume`, continue) a model as `train_cfg` (a `TrainConfig`) says;
    returns a summary of the run (`minigpt.train.trainer.train`).

    The model is the zoo entry `train_cfg.model` names, or `model_cfg` (a `ModelConfig`: a zoo
    entry changed, or one of your own); `minigpt.train(TrainConfig(...))` gives only the
    first. Given both, a `model_cfg` of another architecture than the zoo entry the name
    means is refused (ConfigError): the run would record one model and train another. A run the
    planner expects not to fit the devices' memory is refused before anything is allocated
    (`check_memory=False` tries it anyway)."""
    from minigpt.config import ConfigError, ModelConfig, TrainConfig
    from minigpt.models import CONFIGS
    from minigpt.train.trainer import train as run_training

    if isinstance(model_cfg, TrainConfig) and train_cfg is None:
        model_cfg, train_cfg = None, model_cfg
    if train_cfg is None:
        raise ConfigError("minigpt.train needs a TrainConfig: minigpt.train(TrainConfig(...)) "
                          "or minigpt.train(model_config, TrainConfig(...))")
    if model_cfg is None:
        model_cfg = CONFIGS.get(train_cfg.model)
        if model_cfg is None:
            raise ConfigError(f"TrainConfig.model {train_cfg.model!r} is not a zoo model: give "
                              f"its ModelConfig too, minigpt.train(model_config, train_config)")
    zoo = CONFIGS.get(train_cfg.model)
    if isinstance(model_cfg, ModelConfig) and zoo is not None and zoo.arch != model_cfg.arch:
        raise ConfigError(f"TrainConfig.model is {train_cfg.model!r} (a {zoo.arch} model) but "
                          f"the ModelConfig given is a {model_cfg.arch} model: name the model "
                          f"you train, or give only the TrainConfig")
    return run_training(model_cfg, train_cfg, resume=resume, sample=sample,
                        check_memory=check_memory)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt.train`: the command line (`minigpt.train.cli`) around `train`."""
    import minigpt.train.cli as cli

    return cli.run(argv, train)


sys.modules[__name__].__class__ = CallableModule  # minigpt.train(...) calls train(...)
