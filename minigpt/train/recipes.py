"""Recipes: named ways to train, read from the small TOML files in recipes/.

A recipe names a zoo model (with optional field changes) and the training settings that suit it;
`python -m minigpt.train --recipe NAME` applies it and command-line flags override it
(`minigpt.train.cli`). Every field is checked against `ModelConfig` and `TrainConfig` when it is
read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    check_value,
    field_types,
)
from minigpt.files import read_named_toml, shipped_folder
from minigpt.train.budget import parse_duration

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
    train_fields = dict(data.get("train", {}))
    if isinstance(train_fields.get("time_budget"), str):
        train_fields["time_budget"] = parse_duration(train_fields["time_budget"])
    for table, cls, fields in (("model", ModelConfig, model_fields),
                               ("train", TrainConfig, train_fields)):
        types = field_types(cls)
        if set(fields) - set(types):
            raise ConfigError(f"recipe {path}: unknown [{table}] fields "
                              f"{sorted(set(fields) - set(types))}")
        if isinstance(fields.get("data"), list):
            fields["data"] = tuple(fields["data"])
        for name, value in fields.items():
            check_value(f"recipe {path}: {table}.{name}", types[name], value)
    return Recipe(name=path.stem, description=str(data.get("description", "")), model=model,
                  model_fields=model_fields, train_fields=train_fields)
