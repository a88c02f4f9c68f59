"""A run: its directory, what it was asked for, and what that resolved to.

- `directory`: the run directory, the one module that knows its files, its config.json and its
  latest weights (`RunDir`, `load_run`, `LoadedRun`, `RunError`);
- `overrides`: what a user asks for before anything is resolved: recipes (recipes/*.toml),
  `--set key=value`, durations;
- `resolved`: a run's settings resolved once, every derived default turned into the value the
  run uses (`Resolved`), which config.json records beside what was asked.
"""

from minigpt.runs.directory import (
    CHECKPOINTS,
    CONFIG,
    DAMAGED,
    LOAD_ERRORS,
    LOCK,
    LOSS_PLOT,
    MAX_DEVICES,
    METRICS,
    TENSORBOARD,
    LoadedRun,
    RunDir,
    RunError,
    SavedRun,
    check_start,
    keep_vocabulary,
    load_run,
    with_recorded_template,
)

__all__ = ["CHECKPOINTS", "CONFIG", "DAMAGED", "LOAD_ERRORS", "LOCK", "LOSS_PLOT", "MAX_DEVICES",
           "METRICS", "TENSORBOARD", "LoadedRun", "RunDir", "RunError", "SavedRun",
           "check_start", "keep_vocabulary", "load_run", "with_recorded_template"]
