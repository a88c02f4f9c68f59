"""Configuration values checked against their fields' declared types: `check_value`, the one type
check behind every way a value arrives (flags, --set, recipes, config.json, imported configs,
adapter and tokenizer files), and `ConfigError`, what it and every config check raise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from minigpt.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value a user gave is invalid; the message says which and why."""


def check_value(where: str, annotation: Any, value: Any) -> None:
    """Refuse a value that is not of a field's declared type (`where` names the field, e.g.
    "model.num_layers" or "recipe stories-cpu: model.num_layers"): ints are ints (not bools),
    floats are finite numbers, strings are strings, tuples hold their declared items. The one
    type check behind every way a value arrives (flags, --set, recipes, config.json, imported
    configs)."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        ok = isinstance(value, tuple) and all(
            isinstance(v, item) and not isinstance(v, bool)
            and (item is not float or math.isfinite(v)) for v in value)
        kind = {str: "a list of strings", float: "a list of finite numbers"}.get(
            item, "a list of integers")
    elif annotation is bool:
        ok, kind = isinstance(value, bool), "true or false"
    elif annotation is int:
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
            value)
        kind = "a finite number"
    elif isinstance(annotation, types.UnionType):  # bool | str: either; the field says which
        ok = isinstance(value, annotation) and not (isinstance(value, float))
        kind = " or ".join(a.__name__ for a in typing.get_args(annotation))
    else:
        ok, kind = isinstance(value, annotation), annotation.__name__
    if not ok:
        raise ConfigError(f"{where} must be {kind}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A config class's fields and their declared types (annotations resolved)."""
    return typing.get_type_hints(cls)


def check_fields(config: Any, scope: str) -> None:
    """Check every field's type; a list where a tuple is declared (as JSON, TOML and Python
    callers give sequences) is taken as that tuple."""
    hints = field_types(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
            value = tuple(value)
            object.__setattr__(config, f.name, value)
        check_value(f"{scope}.{f.name}", hints[f.name], value)
