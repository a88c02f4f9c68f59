"""The training command line: `python -m minigpt.train`'s flags, turned into the two configs.

A new run starts from the defaults, then the recipe (if any), then the flags, then `--set`.

A resumed run (`--resume`) starts from what its config.json saved. The command line may be the
one that started the run with `--resume` added (people press the up arrow): what it says about
*what the run is* is resolved as for a new run and checked against the saved run, and what it
says about *how to go on* applies (the rules are `minigpt.train.resuming`). A run trained
on simulated devices resumes on as many unless `--devices` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minigpt import models, plan, runtime
from minigpt.config import (
    EXECUTION_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
)
from minigpt.errors import exit_code
from minigpt.models import get_config
from minigpt.runs import RunDir, RunError
from minigpt.runs.overrides import load_recipe, parse_duration, parse_overrides, recipe_configs
from minigpt.tokenizer import load_tokenizer
from minigpt.train.flags import build_parser
from minigpt.train.resuming import resume_configs

# Model fields a run started from another run's weights (--init-from) may change: how the model
# runs, and its dropout.
INIT_FROM_FIELDS = (*EXECUTION_FIELDS, "dropout")

FLAG_FIELDS = {"preset": "preset", "data": "data", "steps": "steps", "batch_size": "batch_size",
               "seq_len": "seq_len", "lr": "lr", "seed": "seed", "out": "out",
               "eval_every": "eval_every", "save_every": "save_every",
               "profile_steps": "profile_steps", "objective": "objective",
               "reference": "reference", "log_every": "log_every"}


def _train_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The train fields the flags (not --set) give."""
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()
             if getattr(args, flag) is not None}
    if "data" in given:
        given["data"] = tuple(given["data"])
    if args.reward:
        given["rewards"] = tuple(args.reward)
    if args.time_budget is not None:
        if args.steps is not None:
            raise ConfigError("give --steps or --time-budget, not both")
        given["time_budget"] = parse_duration(args.time_budget)
    elif args.steps is not None:
        given["time_budget"] = 0.0  # a step count given on the command line wins over a recipe
    return given


def resolve_configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """The configs the command line asks for: a new run's, or (--resume) the saved run's with
    the command line checked against it and applied (see the module docstring)."""
    given = _train_flags(args)
    changes = parse_overrides(args.set)
    if args.init_from:
        given["init_from"] = args.init_from
    if args.resume:
        return _resumed(args, given, changes)
    if args.init_from:
        return _started_from(args, given, changes)
    if args.recipe:
        model_cfg, train_cfg = recipe_configs(args.recipe, model=args.model, **given)
    else:
        model_cfg = get_config(args.model or TrainConfig.model)
        train_cfg = TrainConfig(**{**given, "model": args.model or TrainConfig.model})
    model_cfg = _with_tokenizer(model_cfg, args.tokenizer)
    return (models.replaced(model_cfg, **changes["model"]),
            dataclasses.replace(train_cfg, **changes["train"]))


def _with_tokenizer(model_cfg: ModelConfig, tokenizer: str | None) -> ModelConfig:
    if not tokenizer:
        return model_cfg
    return dataclasses.replace(model_cfg, tokenizer=tokenizer,
                               vocab_size=load_tokenizer(tokenizer).n_rows)


def _started_from(args: argparse.Namespace, given: dict[str, Any],
                  changes: dict[str, dict[str, Any]]) -> tuple[ModelConfig, TrainConfig]:
    """A new run whose model (and tokenizer) is that of the run it starts from."""
    source = RunDir(args.init_from)
    saved = source.read()
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value:
            raise ConfigError(f"--init-from takes the model and tokenizer of {source.path}: drop "
                              f"{flag}")
    fixed = sorted(set(changes["model"]) - set(INIT_FROM_FIELDS))
    if fixed:
        raise ConfigError(f"--init-from keeps the model of {source.path}: only "
                          f"{', '.join(INIT_FROM_FIELDS)} may change (not {', '.join(fixed)})")
    name = saved.train.model if saved.train else (saved.imported or {}).get(
        "source", str(source.path))
    train_fields = dict(load_recipe(args.recipe).train_fields, recipe=load_recipe(
        args.recipe).name) if args.recipe else {}
    model_cfg = models.replaced(saved.model, **changes["model"])
    # --set with the flags: checks across fields (a batch of whole GRPO groups) see both
    return model_cfg, TrainConfig(**{**train_fields, **given, **changes["train"], "model": name})


def _resumed(args: argparse.Namespace, given: dict[str, Any],
             changes: dict[str, dict[str, Any]]) -> tuple[ModelConfig, TrainConfig]:
    run = RunDir(args.out or TrainConfig.out)
    saved = run.read()
    # The model the command line names, resolved as a new run would resolve it; a command line
    # that names none names the saved one.
    says: dict[str, Any] = {}
    wanted = None
    if args.recipe:
        recipe = load_recipe(args.recipe)
        # The recipe names the run, but its training settings are the ones the run saved when
        # it started: a recipe edited since must not switch an optimizer whose state the
        # checkpoints hold, or make the learning rate jump; nor change the shape its [model]
        # table gives (stories-cpu went from 4 layers to 2 and 3): the checkpoints hold the
        # shape the run started with. Flags and --set still say how to go on.
        says.update(recipe=recipe.name, model=args.model or recipe.model)
        if saved.train is None or says["model"] != saved.train.model:
            wanted = recipe_configs(args.recipe, model=args.model)[0]
    elif args.model:
        wanted = get_config(args.model)
        says["model"] = args.model
    if args.tokenizer:
        wanted = _with_tokenizer(wanted or saved.model, args.tokenizer)
    return resume_configs(run, wanted, {**says, **given, **changes["train"]}, changes["model"])


def _set_devices(args: argparse.Namespace) -> None:
    """Simulate --devices CPU devices; a resumed run given none gets as many as it was trained
    on, and says so (unless JAX already runs: `train` called from Python keeps its devices)."""
    if args.devices or not args.resume:
        if args.devices:
            runtime.set_simulated_devices(args.devices)
        return
    out = Path(args.out or TrainConfig.out)
    try:
        used = RunDir(out).read().record.get("devices") or {}
    except RunError:
        return  # the resume itself says what is wrong
    # Several CPU devices in one process can only have been simulated.
    if used.get("platform") != "cpu" or used.get("processes") != 1 or used.get("count", 1) < 2:
        return
    try:
        runtime.set_simulated_devices(used["count"])
    except RuntimeError:
        return
    # stdout, as the trainer's other lines: a refusal after it stays the one line on stderr
    print(f"resuming {out} on {used['count']} simulated CPU devices, as it was trained "
          f"(--devices N for another count)", flush=True)


def run(argv: Sequence[str] | None, train: Callable[..., dict[str, Any]]) -> int:
    """Parse the command line, set up the devices (and the job), resolve the configs and call
    `train` (`minigpt.train.train`); a user's error is one line on stderr and a nonzero exit."""
    args = build_parser().parse_args(argv)
    _set_devices(args)
    if args.distributed or any(v is not None for v in (
            args.coordinator, args.num_processes, args.process_id)):
        runtime.join_job(args.coordinator, args.num_processes, args.process_id)
    def go() -> int:
        model_cfg, train_cfg = resolve_configs(args)
        memory = args.device_memory and plan.parse_size(args.device_memory)
        with plan.budget(memory or None):  # what --preset auto chooses for
            summary = train(model_cfg, train_cfg, resume=args.resume, sample=not args.no_sample,
                            check_memory=not args.no_memory_check)
        return 130 if summary["interrupted"] else 0

    with runtime.plain_warnings():
        return exit_code(go)
