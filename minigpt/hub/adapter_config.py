"""adapter_config.json, PEFT's description of a LoRA adapter, read at one door.

Every field PEFT 0.21's `LoraConfig` writes is in one of three tables: what the adapter
computes and minigpt's LoRA implements (`r`, `lora_alpha`, `lora_dropout`, `target_modules`,
`use_rslora`), typed and range-checked as the train.lora_* settings are
(`minigpt.config.values.check_value`); what describes the adapter or how it was first initialised
(loading its weights replaces that), accepted; and the variants minigpt does not compute
(DoRA, activated LoRA, layer replication, trainable tokens, biases, per-module ranks, ...),
refused by name when set. A field PEFT did not have then is refused too unless it is unset
(null, false, empty): it may change what the adapter computes. Each refusal is one line naming
the file and the field; nothing is allocated or written before it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from minigpt.config.values import ConfigError, check_value
from minigpt.files import read_json_object
from minigpt.hub.architectures import HubError
from minigpt.hub.safetensors import WeightsError, resolve_inside
from minigpt.models import lora

CONFIG = "adapter_config.json"

# Fields that describe the adapter, or say how its weights were first drawn (which loading them
# replaces): read as they are, or not at all.
DESCRIPTIVE = ("task_type", "peft_type", "auto_mapping", "peft_version",
               "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
               "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
               "corda_config", "lora_ga_config", "runtime_config", "ensure_weight_tying",
               "layers_pattern")
# The variants of LoRA minigpt does not compute, by what they are: refused when set.
VARIANTS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "alora_invocation_tokens": "activated LoRA (aLoRA, adapters switched on by tokens)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trained token embeddings",
    "lora_bias": "a bias on lora_B",
    "use_qalora": "QA-LoRA",
    "fan_in_fan_out": "Conv1D (transposed) weights",
    "bias": "trained biases",
    "modules_to_save": "fully trained extra modules",
    "layers_to_transform": "adapters on some layers only",
    "rank_pattern": "a rank per module",
    "alpha_pattern": "an alpha per module",
    "exclude_modules": "excluded modules",
    "target_parameters": "adapters on parameters",
    "megatron_config": "Megatron layers",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
COMPUTED = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")
# Initialisations that leave the base weights as they are (the others, PiSSA, OLoRA, CorDA,
# LoftQ, LoRA-GA, change them when the adapter is made: its weights then fit another base).
PLAIN_INITS = (True, False, "gaussian", "eva")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """A checked adapter_config.json: rank, the scale's alpha (rsLoRA's alpha * sqrt(r) / r
    folded into alpha / r), dropout, the target module names (or ALL_LINEAR), and what it
    says of its base."""

    path: Path
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    base: str | None
    revision: str | None
    peft_version: str | None


def _unset(value: Any) -> bool:
    return value in (None, False, "none") or value == {} or value == []


def read_adapter_config(directory: Path) -> AdapterConfig:
    """The adapter a PEFT folder's adapter_config.json describes, every field checked (HubError,
    one line naming the file and the field)."""
    path = _inside(directory)
    config = read_json_object(path, HubError, missing=(
        f"{directory} has no {CONFIG}: is it a PEFT adapter folder?"))
    if config.get("peft_type") != "LORA":
        raise HubError(f"{path} has peft_type {json.dumps(config.get('peft_type'))}: minigpt "
                       f"reads LoRA adapters (peft_type \"LORA\") only")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise HubError(f"{path} has task_type {json.dumps(config['task_type'])}: minigpt's "
                       f"models are causal language models (CAUSAL_LM)")
    for field, value in config.items():
        if field in VARIANTS and not _unset(value):
            raise HubError(f"{path} sets {field} = {json.dumps(value)[:60]}: that is "
                           f"{VARIANTS[field]}, which minigpt's LoRA does not compute")
        if field not in (*DESCRIPTIVE, *VARIANTS, *COMPUTED) and not _unset(value):
            raise HubError(f"{path} sets {field} = {json.dumps(value)[:60]}, a field minigpt "
                           f"does not know (a newer PEFT's variant?): it may change what the "
                           f"adapter computes, so the adapter is not read")
    if config.get("init_lora_weights", True) not in PLAIN_INITS:
        raise HubError(f"{path} has init_lora_weights = "
                       f"{json.dumps(config['init_lora_weights'])[:40]}: that initialisation "
                       f"changes the base weights, so the adapter fits those, not its base; "
                       f"convert it to plain LoRA with PEFT first")
    return _typed(path, config)


def _typed(path: Path, config: dict[str, Any]) -> AdapterConfig:
    """The computed fields, each type-checked as the configs' fields are, then ranged."""
    values = {"r": config.get("r", 8), "lora_alpha": config.get("lora_alpha", 8),
              "lora_dropout": config.get("lora_dropout", 0.0),
              "use_rslora": config.get("use_rslora", False)}
    try:
        for field, kind in (("r", int), ("lora_alpha", float), ("lora_dropout", float),
                            ("use_rslora", bool)):
            check_value(f"{path}: {field}", kind, values[field])
        for field in ("base_model_name_or_path", "revision", "peft_version"):
            if config.get(field) is not None:
                check_value(f"{path}: {field}", str, config[field])
    except ConfigError as error:
        raise HubError(str(error)) from None
    r, alpha, dropout = values["r"], values["lora_alpha"], values["lora_dropout"]
    if r <= 0 or alpha <= 0 or not 0 <= dropout < 1:
        raise HubError(f"{path} needs r > 0 (got {r}), lora_alpha > 0 (got {alpha}) and "
                       f"lora_dropout in [0, 1) (got {dropout})")
    targets = config.get("target_modules")
    if targets == ALL_LINEAR:
        targets = [ALL_LINEAR]
    elif isinstance(targets, str):
        raise HubError(f"{path} gives target_modules as a pattern ({json.dumps(targets)[:60]}): "
                       f"minigpt reads a list of module names (or \"all-linear\"), not a "
                       f"regular expression from a file")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise HubError(f"{path} has target_modules = {json.dumps(targets)[:60]}: expected a "
                       f"list of module names")
    # rsLoRA scales by alpha / sqrt(r): the same as alpha * sqrt(r) / r.
    alpha = float(alpha) * (math.sqrt(r) if values["use_rslora"] else 1.0)
    try:
        lora.check_scale(f"{path}: lora_alpha", alpha, r)
    except ConfigError as error:
        raise HubError(str(error)) from None
    return AdapterConfig(path=path, rank=r, alpha=alpha, dropout=float(dropout),
                         targets=tuple(targets), base=config.get("base_model_name_or_path"),
                         revision=config.get("revision"), peft_version=config.get("peft_version"))


def matched(targets: tuple[str, ...], key: str) -> bool:
    """Whether PEFT adapts the module named `key` (e.g. model.layers.3.self_attn.q_proj) for
    these target_modules: a name equal to it or ending it after a dot."""
    return any(key == t or key.endswith(f".{t}") for t in targets)


def _inside(directory: Path) -> Path:
    try:
        return resolve_inside(directory, CONFIG, f"{directory}'s {CONFIG}")
    except WeightsError as error:
        raise HubError(str(error)) from None
