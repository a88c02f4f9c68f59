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
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minigpt import plan, runtime
from minigpt.checkpoint import CheckpointError
from minigpt.config import (
    EXECUTION_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
)
from minigpt.data.token_files import DataError
from minigpt.files import write_fault
from minigpt.models import get_config
from minigpt.runs import RunDir, RunError
from minigpt.sharding import PresetError
from minigpt.tokenizer import TokenizerError, load_tokenizer
from minigpt.train.budget import parse_duration
from minigpt.train.flags import build_parser
from minigpt.train.lock import RunLocked
from minigpt.train.metrics import TrainingDiverged
from minigpt.train.recipes import load_recipe
from minigpt.train.resuming import resume_configs

# What a user can cause, reported in one line with exit status 2 (3: training diverged).
USER_ERRORS = (ConfigError, PresetError, CheckpointError, DataError, TokenizerError, RunLocked)

# Model fields a run started from another run's weights (--init-from) may change: how the model
# runs, and its dropout.
INIT_FROM_FIELDS = (*EXECUTION_FIELDS, "dropout")

FLAG_FIELDS = {"preset": "preset", "data": "data", "steps": "steps", "batch_size": "batch_size",
               "seq_len": "seq_len", "lr": "lr", "seed": "seed", "out": "out",
               "eval_every": "eval_every", "save_every": "save_every",
               "profile_steps": "profile_steps"}


def _parse_value(text: str, annotation: Any, key: str) -> Any:
    """Convert `text` to the type a dataclass field declares (str annotations resolved)."""
    origin = typing.get_origin(annotation)
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return tuple(_parse_value(part, item, key) for part in text.split(",") if part)
    if origin in (types.UnionType, typing.Union):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--set {key}: expected true or false, got {text!r}")
    try:
        return annotation(text)
    except ValueError:
        raise ConfigError(
            f"--set {key}: expected {annotation.__name__}, got {text!r}") from None


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """`key=value` strings (a key is `field`, `model.field` or `train.field`) as the changes they
    make: {"model": {field: value}, "train": {field: value}}, values of the declared types."""
    changes: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    hints = {"model": typing.get_type_hints(ModelConfig),
             "train": typing.get_type_hints(TrainConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        scope, _, name = key.rpartition(".")
        if scope == "data":  # the data's settings are train fields: data.truncate is
            scope, name = "train", f"data_{name}"  # train.data_truncate, data.root data_root
        scopes = [scope] if scope else [s for s in ("model", "train") if name in hints[s]]
        if not scopes or scopes[0] not in hints or name not in hints[scopes[0]]:
            known = sorted(f"model.{n}" for n in hints["model"]) + sorted(
                f"train.{n}" for n in hints["train"])
            raise ConfigError(f"--set: unknown field {key!r}; known fields: {', '.join(known)}")
        if len(scopes) > 1:
            raise ConfigError(f"--set: {name!r} is ambiguous; write model.{name} or train.{name}")
        changes[scopes[0]][name] = _parse_value(value, hints[scopes[0]][name], key)
    return changes


def _train_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The train fields the flags (not --set) give."""
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()
             if getattr(args, flag) is not None}
    if "data" in given:
        given["data"] = tuple(given["data"])
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
    return (dataclasses.replace(model_cfg, **changes["model"]),
            dataclasses.replace(train_cfg, **changes["train"]))


def _with_tokenizer(model_cfg: ModelConfig, tokenizer: str | None) -> ModelConfig:
    if not tokenizer:
        return model_cfg
    return dataclasses.replace(model_cfg, tokenizer=tokenizer,
                               vocab_size=load_tokenizer(tokenizer).n_vocab)


def recipe_configs(name_or_path: str, model: str | None = None,
                   **train_changes: Any) -> tuple[ModelConfig, TrainConfig]:
    """The configs a recipe (recipes/<name>.toml) describes, with `train_changes` on top.
    Another `model` replaces the recipe's (and drops its changes to the model's fields)."""
    recipe = load_recipe(name_or_path)
    model_cfg = get_config(model or recipe.model)
    if model in (None, recipe.model):
        model_cfg = dataclasses.replace(model_cfg, **recipe.model_fields)
    train_cfg = TrainConfig(**{**recipe.train_fields, "recipe": recipe.name, **train_changes,
                               "model": model or recipe.model})
    return model_cfg, train_cfg


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
    model_cfg = dataclasses.replace(saved.model, **changes["model"])
    train_cfg = TrainConfig(**{**train_fields, **given, "model": name})
    return model_cfg, dataclasses.replace(train_cfg, **changes["train"])


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
    try:
        with runtime.plain_warnings():
            model_cfg, train_cfg = resolve_configs(args)
            memory = args.device_memory and plan.parse_size(args.device_memory)
            with plan.budget(memory or None):  # what --preset auto chooses for
                summary = train(model_cfg, train_cfg, resume=args.resume,
                                sample=not args.no_sample)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a disk that fills, a folder made read-only: the machine's state
        if write_fault(e) is None:
            raise
        print(f"error: {write_fault(e)}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 130 if summary["interrupted"] else 0
