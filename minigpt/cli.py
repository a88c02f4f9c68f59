"""The training command line: `python -m minigpt.train`'s flags, turned into the two configs.

A new run starts from the defaults, then the recipe (if any), then the flags, then `--set`.

A resumed run (`--resume`) starts from what its config.json saved. The command line may be the
one that started the run with `--resume` added (people press the up arrow): everything it says
about *what the run is* (the model with its `--set` changes, the recipe, the tokenizer, the data,
the seed) is resolved as for a new run and must agree with the saved run; a real difference is
refused, naming the fields. What it says about *how to go on* (steps, learning rate, preset,
evaluation and checkpoint intervals, how the model runs: dtype, remat, scan, kernels) applies.
A time budget already turned into a step count is not asked for again.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minigpt import runtime
from minigpt.checkpoint import CheckpointError
from minigpt.config import (
    EXECUTION_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    load_run_config,
    parse_duration,
    parse_overrides,
)
from minigpt.lock import RunLocked
from minigpt.metrics import TrainingDiverged
from minigpt.models import get_config
from minigpt.recipes import load_recipe
from minigpt.sharding import PresetError
from minigpt.token_files import DataError
from minigpt.tokenizer import TokenizerError, load_tokenizer

# What a user can cause, reported in one line with exit status 2 (3: training diverged).
USER_ERRORS = (ConfigError, PresetError, CheckpointError, DataError, TokenizerError, RunLocked)

# Train fields that say which run this is: a resumed run keeps them.
IDENTITY_FIELDS = ("data", "seed", "recipe", "init_from", "optimizer")

# Model fields a run started from another run's weights (--init-from) may change: how the model
# runs, and its dropout.
INIT_FROM_FIELDS = (*EXECUTION_FIELDS, "dropout")

FLAG_FIELDS = {"preset": "preset", "data": "data", "steps": "steps", "batch_size": "batch_size",
               "seq_len": "seq_len", "lr": "lr", "seed": "seed", "out": "out",
               "eval_every": "eval_every", "save_every": "save_every",
               "profile_steps": "profile_steps"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minigpt.train",
                                description="Train a model of the zoo under a parallelism preset.")
    p.add_argument("--recipe", help="a named way to train (a file in recipes/, e.g. "
                                    "stories-cpu, or a .toml path): model, tokenizer and "
                                    "settings; the other flags override it")
    p.add_argument("--time-budget", metavar="DURATION",
                   help="train for this long (e.g. 10m, 90s, 1h; compilation included) with "
                        "the learning-rate schedule fitted to it, instead of --steps")
    p.add_argument("--tokenizer", help="gpt2, a shipped vocabulary (tinystories-4k) or a "
                                       ".tiktoken file; sets the model's vocabulary to match")
    p.add_argument("--preset", help="parallelism preset: a name in presets/ or a .toml path "
                                    "(default fsdp)")
    p.add_argument("--model", help="model name from the zoo (default minigpt)")
    p.add_argument("--data", nargs="+", help="'tinystories', 'tinystories-v2' or text files")
    p.add_argument("--steps", type=int, help="train to this step (on --resume: a new end, see "
                                             "the README)")
    p.add_argument("--batch-size", type=int, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, help="training context (default: the model's)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="run directory (default runs/default)")
    p.add_argument("--init-from", metavar="RUN",
                   help="start a new run from RUN's latest weights (trained here, or imported "
                        "with python -m minigpt.hub): its model and tokenizer, a fresh "
                        "optimizer, step 0")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint "
                                                         "(the flags that started it may stay)")
    p.add_argument("--devices", type=int, default=0,
                   help="simulate this many CPU devices (try any preset on a laptop)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--no-sample", action="store_true",
                   help="do not tell a sample story at the end")
    p.add_argument("--profile-steps", help="'a:b': write a profiler trace of steps a..b-1 "
                                           "(into <out>/tensorboard, for its profile plugin)")
    job = p.add_argument_group("multi-process jobs (see python -m minigpt.launch to try one "
                               "on this machine)")
    job.add_argument("--coordinator", metavar="HOST:PORT",
                     help="address of process 0's coordinator; joins a multi-process job")
    job.add_argument("--num-processes", type=int, help="processes in the job")
    job.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    job.add_argument("--distributed", action="store_true",
                     help="join the job the cluster environment describes (SLURM, Open MPI, "
                          "Cloud TPU, Kubernetes, JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.dropout=0 --set lr=3e-4")
    return p


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
    source = Path(args.init_from)
    saved = load_run_config(source / "config.json")
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value:
            raise ConfigError(f"--init-from takes the model and tokenizer of {source}: drop "
                              f"{flag}")
    fixed = sorted(set(changes["model"]) - set(INIT_FROM_FIELDS))
    if fixed:
        raise ConfigError(f"--init-from keeps the model of {source}: only "
                          f"{', '.join(INIT_FROM_FIELDS)} may change (not {', '.join(fixed)})")
    name = (saved.get("train") or {}).get("model") or saved.get("imported", {}).get(
        "source", str(source))
    train_fields = dict(load_recipe(args.recipe).train_fields, recipe=load_recipe(
        args.recipe).name) if args.recipe else {}
    model_cfg = dataclasses.replace(saved["model"], **changes["model"])
    train_cfg = TrainConfig(**{**train_fields, **given, "model": name})
    return model_cfg, dataclasses.replace(train_cfg, **changes["train"])


def _resumed(args: argparse.Namespace, given: dict[str, Any],
             changes: dict[str, dict[str, Any]]) -> tuple[ModelConfig, TrainConfig]:
    out = Path(args.out or TrainConfig.out)
    saved = load_run_config(out / "config.json")
    if "train" not in saved:
        raise ConfigError(f"{out} holds imported weights, not a training run: start training "
                          f"from them with --init-from {out} --out NEW")
    saved_model = saved["model"]
    saved_train = TrainConfig(**{**saved["train"], "data": tuple(saved["train"]["data"])})
    # The model the command line names, resolved as a new run would resolve it; a command line
    # that names none names the saved one.
    says: dict[str, Any] = {}
    if args.recipe:
        recipe = load_recipe(args.recipe)
        wanted, _ = recipe_configs(args.recipe, model=args.model)
        # The recipe names the run, but its training settings are the ones the run saved when
        # it started: a recipe edited since (stories-cpu moved from AdamW to Muon, and to
        # other rates) must not switch an optimizer whose state the checkpoints hold, or make
        # the learning rate jump. Flags and --set still say how to go on. So with the shape
        # its [model] table gives (stories-cpu went from 4 layers to 2): the checkpoints hold
        # the shape the run started with.
        says.update(recipe=recipe.name, model=args.model or recipe.model)
        if says["model"] == saved_train.model:
            wanted = saved_model
    elif args.model:
        wanted = get_config(args.model)
        says["model"] = args.model
    else:
        wanted = saved_model
    wanted = dataclasses.replace(_with_tokenizer(wanted, args.tokenizer), **changes["model"])
    _refuse_differences(out, "model", {
        f.name: (getattr(saved_model, f.name), getattr(wanted, f.name))
        for f in dataclasses.fields(ModelConfig) if f.name not in EXECUTION_FIELDS})
    says.update(given)
    says.update(changes["train"])
    _refuse_differences(out, "run", {name: (getattr(saved_train, name), says[name])
                                     for name in IDENTITY_FIELDS if name in says})
    _settle_time_budget(out, saved, saved_train, says)
    model_cfg = dataclasses.replace(saved_model, **{
        k: v for k, v in changes["model"].items() if k in EXECUTION_FIELDS})
    return model_cfg, dataclasses.replace(saved_train, **says)


def _refuse_differences(out: Path, what: str, pairs: dict[str, tuple[Any, Any]]) -> None:
    differing = {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}
    if differing:
        details = ", ".join(f"{name}: {old!r} -> {new!r}"
                            for name, (old, new) in differing.items())
        raise ConfigError(f"cannot resume {out} as a different {what} ({details}); drop those "
                          f"options or train into a new --out")


def _settle_time_budget(out: Path, saved: dict[str, Any], saved_train: TrainConfig,
                        says: dict[str, Any]) -> None:
    """A budget the saved run already turned into steps is the same budget, not a new one."""
    budget = says.get("time_budget")
    if not budget or saved_train.time_budget:  # none asked, or not yet decided: as given
        return
    record = saved.get("time_budget") or {}
    if record.get("seconds") == budget:
        del says["time_budget"]
        return
    decided = (f"trained under a time budget of {record['seconds']:g} s, which fixed it at "
               f"{saved_train.steps} steps" if record else "trained without a time budget")
    raise ConfigError(f"{out} was {decided}: to train it further give --steps N instead of "
                      f"--time-budget")


def run(argv: Sequence[str] | None, train: Callable[..., dict[str, Any]]) -> int:
    """Parse the command line, set up the devices (and the job), resolve the configs and call
    `train` (`minigpt.train.train`); a user's error is one line on stderr and a nonzero exit."""
    args = build_parser().parse_args(argv)
    if args.devices:
        runtime.set_simulated_devices(args.devices)
    if args.distributed or any(v is not None for v in (
            args.coordinator, args.num_processes, args.process_id)):
        runtime.join_job(args.coordinator, args.num_processes, args.process_id)
    try:
        model_cfg, train_cfg = resolve_configs(args)
        summary = train(model_cfg, train_cfg, resume=args.resume, sample=not args.no_sample)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 130 if summary["interrupted"] else 0
