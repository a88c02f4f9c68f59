"""Configuration: frozen dataclasses for the model (`model`: what `config.json` in a run
directory stores) and the training run (`train`), each checking its invariants when built, so a
bad value fails at the command line rather than inside a compiled step. `--set key=value`
(minigpt.train.cli) parses against the field's declared type (`values.check_value`, the one type
check behind every way a value arrives).
"""

from minigpt.config.model import (
    CONTEXT_STRATEGIES,
    DTYPES,
    EXECUTION_FIELDS,
    KERNELS,
    LORA_TARGETS,
    MOE_FIELDS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    REMAT_POLICIES,
    ROPE_SCALINGS,
    FamilyOptions,
    ModelConfig,
)
from minigpt.config.train import TrainConfig, parse_step_range
from minigpt.config.values import ConfigError, check_value

__all__ = ["CONTEXT_STRATEGIES", "DTYPES", "EXECUTION_FIELDS", "KERNELS", "LORA_TARGETS",
           "MOE_FIELDS", "OPTIMIZERS", "PIPELINE_SCHEDULES", "REMAT_POLICIES", "ROPE_SCALINGS",
           "ConfigError", "FamilyOptions", "ModelConfig", "TrainConfig", "check_value",
           "parse_step_range"]
