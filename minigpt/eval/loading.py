"""What is evaluated: a run's latest weights under a preset, and the errors evaluation reports.

Every evaluation (the harness's requests, bits per byte of a text) scores one run's model, laid
out by a preset over the devices as generation lays it out (`minigpt.runs.load_run`), and runs
its compiled programs inside that layout's context. `load` restores it; `Evaluated.active()`
enters the context. `EvalError` is what evaluation refuses: a file that is not there, a task
the harness does not know, settings that mean nothing; like every `minigpt.errors.UserError`
the command line prints it as one `error:` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import UserError
from minigpt.runs import LoadedRun, RunDir, RunError, load_run


class EvalError(UserError, ValueError):
    """Something evaluation cannot do as asked; the message says what to do instead."""


@dataclass
class Evaluated:
    """A run's model as evaluation uses it: the loaded run, and how far back it sees."""

    run: LoadedRun

    @property
    def model(self):
        return self.run.model

    @property
    def tokenizer(self):
        return self.run.tokenizer

    @property
    def context(self) -> int:
        """The most tokens the model attends over (its positions or its rotary training)."""
        return self.run.model.config.context_len

    def active(self):
        """Enter the run's layout: the mesh, the preset's rules, how to run them."""
        return self.run.layout.active()

    def ways(self, logical: str) -> int:
        """Into how many pieces the preset splits a logical axis (`batch`, `seq`, `layers`)."""
        return self.run.layout.ways(logical)


def load(run: str | Path, preset: str = "dp", *, dtype: str | None = None) -> Evaluated:
    """A run's latest weights laid out by `preset`; RunError (one line) for a directory that is
    not a run or holds no checkpoint yet. Adapters are merged into the weights they adapt:
    evaluation never trains them, and the merged model computes the same."""
    if not RunDir(run).path.is_dir():
        raise RunError(f"run directory {run} does not exist: give the --out of a training run "
                       f"or of python -m minigpt.hub import")
    return Evaluated(load_run(run, preset, merge_adapters=True, dtype=dtype))
