"""What a user asks for, before anything is resolved: recipes, `--set key=value`, durations.

A recipe (a small TOML file in recipes/) names a zoo model (with optional field changes) and the
training settings that suit it; `python -m minigpt.train --recipe NAME` applies it and
command-line flags override it (`minigpt.train.cli`), `python -m minigpt.plan --recipe NAME`
plans it. `--set key=value` parses each value against the field's declared type
(`parse_overrides`). Every field is checked against `ModelConfig` and `TrainConfig` when it is
read; what the values then mean on these devices is `minigpt.runs.resolved`'s to decide.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.config.values import check_value, field_types
from minigpt.files import read_named_toml, shipped_folder
from minigpt.models import get_config, replaced, settable_fields

RECIPES_DIR = shipped_folder("recipes")


@dataclass(frozen=True)
class Recipe:
    """A named way to train: a zoo model (with optional field changes) and training settings,
    read from a small TOML file in recipes/. Command-line flags override what it says."""

    name: str
    description: str
    model: str
    model_fields: dict[str, Any]
    train_fields: dict[str, Any]


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe by name (recipes/<name>.toml) or by path, with every field checked."""
    path, data = read_named_toml(name_or_path, RECIPES_DIR, "recipe", ConfigError)
    unknown = sorted(set(data) - {"description", "model", "train"})
    if unknown or not isinstance(data.get("model"), dict) or "name" not in data["model"]:
        raise ConfigError(f"recipe {path}: expected `description`, a [model] table with `name` "
                          f"(a zoo entry) and optional field changes, and a [train] table"
                          + (f"; unknown keys {unknown}" if unknown else ""))
    model_fields = dict(data["model"])
    model = str(model_fields.pop("name"))
    for family, table in [(k, v) for k, v in model_fields.items() if isinstance(v, dict)]:
        del model_fields[family]  # [model.llama]: that family's own settings
        model_fields.update({f"{family}.{name}": value for name, value in table.items()})
    train_fields = dict(data.get("train", {}))
    if isinstance(train_fields.get("time_budget"), str):
        train_fields["time_budget"] = parse_duration(train_fields["time_budget"])
    for table, declared, fields in (("model", settable_fields(), model_fields),
                                    ("train", field_types(TrainConfig), train_fields)):
        if set(fields) - set(declared):
            raise ConfigError(f"recipe {path}: unknown [{table}] fields "
                              f"{sorted(set(fields) - set(declared))}")
        if isinstance(fields.get("data"), list):
            fields["data"] = tuple(fields["data"])
        for name, value in fields.items():
            check_value(f"recipe {path}: {table}.{name}", declared[name], value)
    return Recipe(name=path.stem, description=str(data.get("description", "")), model=model,
                  model_fields=model_fields, train_fields=train_fields)


def recipe_configs(name_or_path: str, model: str | None = None,
                   **train_changes: Any) -> tuple[ModelConfig, TrainConfig]:
    """The configs a recipe (recipes/<name>.toml) describes, with `train_changes` on top.
    Another `model` replaces the recipe's (and drops its changes to the model's fields)."""
    recipe = load_recipe(name_or_path)
    model_cfg = get_config(model or recipe.model)
    if model in (None, recipe.model):
        model_cfg = replaced(model_cfg, **recipe.model_fields)
    train_cfg = TrainConfig(**{**recipe.train_fields, "recipe": recipe.name, **train_changes,
                               "model": model or recipe.model})
    return model_cfg, train_cfg


def _parse_value(text: str, annotation: Any, key: str) -> Any:
    """Convert `text` to the type a dataclass field declares (str annotations resolved)."""
    origin = typing.get_origin(annotation)
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return tuple(_parse_value(part, item, key) for part in text.split(",") if part)
    if origin in (types.UnionType, typing.Union):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        # bool | str (model.remat, model.scan_layers): true and false are booleans, the rest
        # words the field checks itself
        words = ("1", "true", "yes", "on", "0", "false", "no", "off")
        annotation = bool if bool in kinds and text.lower() in words else next(
            (a for a in kinds if a is not bool), kinds[0])
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
    hints = {"model": settable_fields(), "train": typing.get_type_hints(TrainConfig)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        scope, _, name = key.rpartition(".")
        if scope.startswith("model.") and scope.count(".") == 1:  # model.llama.qk_norm
            scope, name = "model", f"{scope[6:]}.{name}"
        if scope == "data":  # the data's settings are train fields: data.truncate is
            scope, name = "train", f"data_{name}"  # train.data_truncate, data.root data_root
        scopes = [scope] if scope else [s for s in ("model", "train") if name in hints[s]]
        if not scopes or scopes[0] not in hints or name not in hints[scopes[0]]:
            known = sorted(f"model.{n}" for n in hints["model"]  # family fields as family.name
                           if "." in n or n in field_types(ModelConfig)) + sorted(
                f"train.{n}" for n in hints["train"])
            raise ConfigError(f"--set: unknown field {key!r}; known fields: {', '.join(known)}")
        if len(scopes) > 1:
            raise ConfigError(f"--set: {name!r} is ambiguous; write model.{name} or train.{name}")
        changes[scopes[0]][name] = _parse_value(value, hints[scopes[0]][name], key)
    return changes


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "10m", "1.5h" or "1h30m"."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}
    parts = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?\s*[hms]?\s*)+)", text or "")
    pieces = re.findall(r"(\d+(?:\.\d*)?)\s*([hms]?)", text) if parts else []
    if not pieces or (len(pieces) > 1 and any(unit == "" for _, unit in pieces)):
        raise ConfigError(f"expected a duration such as 600, 90s, 10m or 1h30m, got {text!r}")
    seconds = sum(float(n) * units[unit] for n, unit in pieces)
    if seconds <= 0:
        raise ConfigError(f"a time budget must be positive, got {text!r}")
    return seconds
