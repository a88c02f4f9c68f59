"""Whether a command line may resume a run, and what it goes on with.

A resumed run starts from what its config.json saved. The command line may be the one that
started the run with `--resume` added: what it says about *what the run is* (the model, apart
from how it runs, and the identity fields below) must agree with the saved run, or the refusal
names the differences in plain words; what it says about *how to go on* applies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minigpt import models
from minigpt.config import EXECUTION_FIELDS, ModelConfig, TrainConfig
from minigpt.runs import RunDir, RunError, SavedRun

# Train fields that say which run this is: a resumed run keeps them.
IDENTITY_FIELDS = ("data", "seed", "recipe", "init_from", "optimizer", "lora_rank", "lora_alpha",
                   "lora_targets", "document_mask")


# What a 0 means where a field takes it as "the default", said beside it in a refusal.
ZERO_MEANS = {"num_kv_heads": "as many as the query heads", "head_size": "embed_dim / num_heads",
              "expert_mlp_dim": "mlp_dim", "shared_expert_mlp_dim": "none",
              "moe_capacity_factor": "dropless", "seq_len": "the model's context",
              "lora_rank": "no adapters", "pipeline_microbatches": "two per stage",
              "decay_steps": "at the last step", "time_budget": "none"}


def plain(name: str, value: Any) -> str:
    """A field's value as a refusal shows it: its repr, and for a 0 that means "the default",
    what it means."""
    if value == 0 and not isinstance(value, bool) and name in ZERO_MEANS:
        return f"{value!r} ({ZERO_MEANS[name]})"
    return repr(value)


def resume_configs(run: RunDir, wanted: ModelConfig | None, says: dict[str, Any],
                   model_changes: dict[str, Any]) -> tuple[ModelConfig, TrainConfig]:
    """The configs a resumed run goes on with, after checking the command line against it.

    `wanted` is the model the command line describes, resolved as for a new run (None: it names
    none, so the saved one); `says` the train fields it gives; `model_changes` its `--set
    model.*` changes. What the command line says the run *is* (the model, apart from how it runs:
    dtype, remat, scan, kernels; and the identity fields: data, seed, recipe, init_from,
    optimizer) must agree with the saved run, or RunError names the differences. What it says
    about how to go on applies. A time budget the run already turned into a step count is the
    same budget, not a new one.
    """
    saved = run.read()
    if saved.train is None:
        raise RunError(f"{run.path} holds imported weights, not a training run: start training "
                       f"from them with --init-from {run.path} --out NEW")
    wanted = models.replaced(wanted or saved.model, **model_changes)
    before, after = saved.model.flat(), wanted.flat()
    _refuse_differences(run, "model", {name: (before.get(name), after.get(name))
                                       for name in {**before, **after}
                                       if name not in EXECUTION_FIELDS})
    _refuse_differences(run, "run", {name: (getattr(saved.train, name), says[name])
                                     for name in IDENTITY_FIELDS if name in says})
    says = _settle_time_budget(run, saved, says)
    model_cfg = models.replaced(saved.model, **{
        k: v for k, v in model_changes.items() if k in EXECUTION_FIELDS})
    return model_cfg, dataclasses.replace(saved.train, **says)


def _refuse_differences(run: RunDir, what: str, pairs: dict[str, tuple[Any, Any]]) -> None:
    differing = {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}
    if differing:
        details = ", ".join(f"{name}: {plain(name, old)} -> {plain(name, new)}"
                            for name, (old, new) in differing.items())
        raise RunError(f"cannot resume {run.path} as a different {what} ({details}); drop those "
                       f"options or train into a new --out")


def _settle_time_budget(run: RunDir, saved: SavedRun, says: dict[str, Any]) -> dict[str, Any]:
    """A budget the saved run already turned into steps is the same budget, not a new one."""
    budget = says.get("time_budget")
    if not budget or saved.train.time_budget:  # none asked, or not yet decided: as given
        return says
    record = saved.record.get("time_budget") or {}
    if record.get("seconds") == budget:
        return {k: v for k, v in says.items() if k != "time_budget"}
    decided = (f"trained under a time budget of {record['seconds']:g} s, which fixed it at "
               f"{saved.train.steps} steps" if record else "trained without a time budget")
    raise RunError(f"{run.path} was {decided}: to train it further give --steps N instead of "
                   f"--time-budget")
