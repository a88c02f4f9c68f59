"""The registry of model families, declared (`FAMILIES`), and what a config needs it for: a
config checked against its family (`checked`: the family's settings filled in where none are
given, the shared fields it does not read refused, its own rules), read from config.json's
"model" table in this layout or the one before families kept their own settings (`from_dict`),
and changed by name as `--set` and recipes change it (`replaced`, `settable_fields`).

`ModelConfig` checks what every family shares by itself; what depends on the family is here,
where the families are, so that the configuration imports nothing of the models.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from minigpt.config import ConfigError, FamilyOptions, ModelConfig
from minigpt.config.model import MOE_FIELDS, option_types
from minigpt.config.values import field_types
from minigpt.models.family import Family
from minigpt.models.gemma3 import FAMILY as GEMMA3
from minigpt.models.gpt2 import FAMILY as GPT2
from minigpt.models.llama import FAMILY as LLAMA
from minigpt.models.minigpt import FAMILY as MINIGPT
from minigpt.models.olmo2 import FAMILY as OLMO2
from minigpt.models.olmo3 import FAMILY as OLMO3
from minigpt.models.phi3 import FAMILY as PHI3

# A family's folder and its lines here are all that adding one takes.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    MINIGPT,
    GPT2,
    LLAMA,
    GEMMA3,
    OLMO2,
    OLMO3,
    PHI3,
)}


def checked(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its family's settings (their defaults where it gives none), after refusing
    the shared fields its family does not read (so no setting is silently ignored) and
    applying the family's own checks. An architecture no family registered is left as it is:
    `build_model` names the known ones."""
    family = FAMILIES.get(cfg.arch)
    if family is None:
        return cfg
    if cfg.options is None and family.options is not None:
        cfg = dataclasses.replace(cfg, options=family.options())
    elif type(cfg.options) is not (family.options or type(None)):
        raise ConfigError(f"model.options holds {type(cfg.options).__name__}: the {cfg.arch} "
                          f"architecture's settings are "
                          f"{family.options.__name__ if family.options else 'none'}")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    owned = {name for other in FAMILIES.values() for name in other.shared}
    changed = [name for name in sorted(owned - family.shared)
               if getattr(cfg, name) != defaults[name]]
    if changed:
        owners = sorted({other.name for other in FAMILIES.values()
                         if set(changed) & other.shared})
        names = ", ".join(f"model.{name}" for name in changed)
        what = (f"{names}: a mixture of experts is" if set(changed) <= set(MOE_FIELDS) else
                f"{names} {'is' if len(changed) == 1 else 'are'}")
        raise ConfigError(f"{what} a {' or '.join(owners)} option; the {cfg.arch} "
                          f"architecture has none")
    if family.check is not None:
        family.check(cfg)
    return cfg


def from_dict(values: dict[str, Any]) -> ModelConfig:
    """A config from config.json's "model" table (or a recipe's): its family's settings under
    the family's name, or among the others as runs from before kept them; JSON's lists as the
    tuples the fields declare."""
    types = field_types(ModelConfig)
    arch = values.get("arch", ModelConfig.arch)
    section = values.get(arch) if isinstance(arch, str) and arch not in types else None
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"model.{arch} must be a table of the {arch} family's settings, got "
                          f"{section!r}")
    if values.get("options") is not None:  # (a null one, as dataclasses.asdict writes, is none)
        raise ConfigError(f"unknown ModelConfig field 'options': a family's settings go under "
                          f"its name (\"{arch}\": {{...}})")
    twice = sorted(set(values) & set(section or {}))
    if twice:
        raise ConfigError(f"model.{twice[0]} is given twice, among the shared fields and in "
                          f"model.{arch}: keep one")
    shared = {name: tuple(value) if isinstance(value, list) and
              typing.get_origin(types[name]) is tuple else value
              for name, value in values.items() if name in types and name != "options"}
    own = {name: value for name, value in values.items() if name not in types and name != arch}
    own.update({f"{arch}.{name}": value for name, value in (section or {}).items()})
    return replaced(checked(ModelConfig(**shared)), **own)


def replaced(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    """`cfg` with some fields changed and checked: shared ones by name, the family's by name
    too (`qk_norm`) or as `family.field` (`llama.qk_norm`), as `--set` and recipes give them;
    another family's refused, naming it."""
    types = field_types(ModelConfig)
    shared = {name: value for name, value in changes.items() if name in types}
    arch = shared.get("arch", cfg.arch)
    options = shared.pop("options", cfg.options if arch == cfg.arch else None)
    own = {}
    for name, value in changes.items():
        family, dot, field = name.rpartition(".")
        if name in types:
            continue
        if dot and family != arch:
            raise ConfigError(f"model.{name} is a {family} setting; the {arch} architecture's "
                              f"own are {_own_names(arch)}")
        own[field] = value
    if own:
        kind = _options_class(arch)
        stray = sorted(set(own) - set(option_types(kind) if kind else ()))
        owners = sorted({f.name for f in FAMILIES.values() if f.options and
                         set(stray) & set(option_types(f.options))})
        if stray and not owners:
            raise ConfigError(f"unknown ModelConfig fields {stray}")
        if stray:
            raise ConfigError(f"{', '.join(f'model.{n}' for n in stray)} "
                              f"{'is' if len(stray) == 1 else 'are'} a {' or '.join(owners)} "
                              f"option; the {arch} architecture has none")
        current = {} if options is None else dataclasses.asdict(options)
        options = _options(kind, {**current, **own})
    return checked(dataclasses.replace(cfg, **shared, options=options))


def settable_fields() -> dict[str, Any]:
    """Every model field a recipe or `--set` may name, with its declared type: the shared ones,
    and each family's as `family.field` and (as before families kept their own) by its name
    alone."""
    types = {name: kind for name, kind in field_types(ModelConfig).items() if name != "options"}
    for family in FAMILIES.values():
        if family.options is not None:
            for name, kind in option_types(family.options).items():
                types[f"{family.name}.{name}"] = kind
                types.setdefault(name, kind)
    return types


def _options_class(arch: Any) -> type[FamilyOptions] | None:
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    return None if family is None else family.options


def _own_names(arch: str) -> str:
    kind = _options_class(arch)
    return ", ".join(f"model.{arch}.{name}" for name in option_types(kind)) if kind else "none"


def _options(kind: type[FamilyOptions], values: dict[str, Any]) -> FamilyOptions:
    types = option_types(kind)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"model.{kind.family}: unknown settings {unknown}; the {kind.family} "
                          f"family's are {sorted(types)}")
    return kind(**{name: tuple(value) if isinstance(value, list) and
                   typing.get_origin(types[name]) is tuple else value
                   for name, value in values.items()})
