"""PEFT's LoRA adapter files, out of a run with adapters and into a run beside its base.

A PEFT adapter folder holds `adapter_config.json` (rank `r`, `lora_alpha`, the `target_modules`,
`base_model_name_or_path`, ...) and `adapter_model.safetensors`, one `lora_A.weight` [r, in] and
one `lora_B.weight` [out, r] per adapted `nn.Linear`, named
`base_model.model.<the module's name in the base model>.lora_A.weight`. `peft.PeftModel.
from_pretrained(base, FOLDER)` puts them on `base` and computes W x + B A x * alpha / r, which is
minigpt's adapter (`minigpt.models.lora`) with A and B transposed and their feature axes
flattened.

Which of our projections is which PEFT module is one table (`modules`), read both ways; it is
derived from the architecture's weight table (`minigpt.hub.architectures`), so the adapter of a
projection is named after the tensor its kernel is: our `blocks.layers.attention.query` in
layer i is `model.layers.{i}.self_attn.q_proj`. The llama family (Llama, Mistral, Qwen2/3)
has one `nn.Linear` per projection; GPT-2's fused `c_attn` is not covered, and is refused.

`export_adapter` writes a run's adapters with `base_model_name_or_path` set to what its base
weights were imported from; `import_adapter` checks a PEFT folder against the run it adapts
(configuration, names, shapes, dtypes, all before anything is written) and makes a run holding
that run's weights and the adapter, which `python -m minigpt.train --init-from` continues.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt.checkpoint import Checkpointer
from minigpt.config import ConfigError, ModelConfig
from minigpt.files import write_chunks_atomic, write_text_atomic
from minigpt.hub.adapter_config import (
    ALL_LINEAR,
    CONFIG,
    AdapterConfig,
    matched,
    read_adapter_config,
)
from minigpt.hub.architectures import HubError
from minigpt.hub.convert import _new_directory, check_out
from minigpt.hub.safetensors import SafetensorsFile, WeightsError, encode, resolve_inside
from minigpt.models import family_of, lora
from minigpt.runs import LOAD_ERRORS, RunDir, keep_vocabulary, load_run

WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
READABLE = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Module:
    """One adaptable projection: our Dense's path and name (`target`), the PEFT module it is
    (with `{i}` for the layer in a stacked one), and that nn.Linear's (out, in) features."""

    target: str
    path: tuple[str, ...]
    name: str
    features: tuple[int, int]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    def keys(self, layer: int) -> tuple[str, str]:
        """The PEFT file's names of this module's A and B in `layer`."""
        module = PREFIX + self.name.format(i=layer)
        return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def modules(cfg: ModelConfig) -> list[Module]:
    """The table: every projection a PEFT adapter of this architecture may adapt."""
    family = family_of(cfg)
    if family.hub is None or not family.hub.peft:
        raise HubError(f"PEFT adapters are written and read for llama-family runs (Llama, "
                       f"Mistral, Qwen2, Qwen3); a {cfg.arch} run's adapters can be exported "
                       f"merged into its weights (without --adapter)")
    return [Module(t.path[-2], t.path[:-1], t.name.removesuffix(".weight"), t.hf_shape)
            for t in family.hub.tensors(cfg) if t.path[-1] == "kernel" and t.part == (0, 1)]


def to_peft(a: np.ndarray, b: np.ndarray, module: Module) -> tuple[np.ndarray, np.ndarray]:
    """One layer's A [in..., r] and B [r, out...] as PEFT's lora_A [r, in] and lora_B [out, r]
    (vocabulary padding rows dropped)."""
    r = a.shape[-1]
    return a.reshape(-1, r).T, b.reshape(r, -1).T[:module.features[0]]


def to_ours(lora_a: np.ndarray, lora_b: np.ndarray, a_shape: tuple[int, ...],
            b_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_peft`: one layer's A and B in our shapes (padding rows zero)."""
    r = a_shape[-1]
    rows = np.zeros((math.prod(b_shape[1:]), r), np.float32)
    rows[:lora_b.shape[0]] = lora_b
    return lora_a.T.reshape(a_shape).astype(np.float32), rows.T.reshape(b_shape)


def _by_path(model: nnx.Module, cfg: ModelConfig) -> list[tuple[Module, lora.Adapter]]:
    """Each adapter of the model with its row of the table."""
    table = {m.path: m for m in modules(cfg)}
    missing = [".".join(path) for path, _ in lora.adapted(model) if path not in table]
    if missing:
        raise HubError(f"the adapters of {', '.join(missing)} have no PEFT module name in a "
                       f"{cfg.arch} checkpoint: export the run merged, without --adapter")
    return [(table[path], dense.lora) for path, dense in lora.adapted(model)]


# --- out --------------------------------------------------------------------------------------

def base_name(run: str | Path) -> tuple[str, str | None]:
    """What a run's adapters adapt, as PEFT names a base model: (the Hugging Face id or folder
    the base run was imported from, or that run's own path; its revision)."""
    saved = RunDir(run).read()
    base = (saved.record.get("adapters") or {}).get("base")
    if not base:
        raise HubError(f"{run}'s adapters adapt weights no other run holds (it trained from "
                       f"scratch, or folded earlier adapters in): export it merged, without "
                       f"--adapter")
    imported = RunDir(base).read().imported
    if imported:
        return imported["source"], imported.get("revision")
    return str(Path(base).absolute()), None


def export_adapter(run: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a run's adapters as a PEFT adapter folder `out`; returns a summary."""
    out = Path(out)
    check_out(out)
    try:
        saved = RunDir(run).read()
        adapters = saved.adapters
        if adapters is None:
            raise HubError(f"{run} has no adapters (it trained every weight): export it "
                           f"without --adapter")
        table, (base, revision) = modules(saved.model), base_name(run)
        loaded = load_run(run, "dp")
    except LOAD_ERRORS as error:
        raise HubError(str(error)) from None
    tensors = {}
    for module, adapter in _by_path(loaded.model, loaded.config):
        a, b = (np.asarray(jax.device_get(p.get_value())) for p in (adapter.a, adapter.b))
        for i in range(loaded.config.num_layers if module.stacked else 1):
            pair = to_peft(a[i], b[i], module) if module.stacked else to_peft(a, b, module)
            for key, value in zip(module.keys(i), pair):
                tensors[key] = np.ascontiguousarray(value, dtype=np.float32)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "revision": revision, "r": adapters.rank, "lora_alpha": adapters.alpha,
              "lora_dropout": saved.train.lora_dropout if saved.train else 0.0,
              "target_modules": sorted({m.name.rsplit(".", 1)[-1] for m in table
                                        if m.target in adapters.targets}),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    with _new_directory(out) as staging:
        write_chunks_atomic(staging / WEIGHTS, encode(tensors, {"format": "pt"}))
        write_text_atomic(staging / CONFIG, json.dumps(config, indent=2) + "\n")
    return {"out": out, "step": loaded.step, "base": base, "tensors": len(tensors),
            "bytes": sum(t.nbytes for t in tensors.values())}


# --- in ---------------------------------------------------------------------------------------

def read_config(directory: Path, cfg: ModelConfig) -> tuple[lora.Adapters, AdapterConfig]:
    """The adapters a PEFT folder's adapter_config.json describes (checked at its door,
    `adapter_config`), on the projections of this run's model its target_modules name as
    PEFT matches them; refusing modules the model does not have as projections, and adapters
    on some layers of a projection only (minigpt adapts a projection in every layer)."""
    config = read_adapter_config(directory)
    table = modules(cfg)
    layers = {m.target: range(cfg.num_layers if m.stacked else 1) for m in table}
    if config.targets == (ALL_LINEAR,):  # every linear layer but the output head, as PEFT
        chosen = {m.target for m in table if m.name != "lm_head"}
    else:
        hits = {m.target: [i for i in layers[m.target]
                           if matched(config.targets, m.name.format(i=i))] for m in table}
        partial = sorted(t for t, found in hits.items() if 0 < len(found) < len(layers[t]))
        if partial:
            raise HubError(f"{config.path} adapts {partial[0]} in some layers only: minigpt "
                           f"adapts a projection in every layer")
        chosen = {t for t, found in hits.items() if found}
        names = [m.name.format(i=i) for m in table for i in layers[m.target]]
        unknown = [t for t in config.targets if not any(matched((t,), n) for n in names)]
        if unknown:
            raise HubError(f"{config.path} adapts {', '.join(unknown[:4])}, which minigpt's "
                           f"{cfg.arch} does not have as projections (it has "
                           f"{', '.join(sorted({m.name.rsplit('.', 1)[-1] for m in table}))})")
    try:
        adapters = lora.Adapters(rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                                 targets=tuple(sorted(chosen)))
    except ConfigError as error:
        raise HubError(f"{config.path}: {error}") from None
    return adapters, config


def _check_base(config: AdapterConfig, base: Path, say) -> str:
    """Refuse an adapter whose config names another base than the run's weights came from;
    returns how they were matched (config.json records it). A name, a path or a Hub id equal
    to what the base run was imported from (or the same folder) is the same base; the same
    folder name alone (a copy elsewhere, a Hub id beside a local folder) is taken, and said:
    adapter_config.json carries no fingerprint of its base, so nothing more can be compared
    than the name, the revision and the tensors' shapes (checked before anything is read)."""
    imported = RunDir(base).read().imported or {}
    known = {k for k in (imported.get("source"), imported.get("directory")) if k} or {
        str(base.absolute())}
    if not config.base:
        return "unnamed"  # PEFT writes none for a base built in memory
    theirs, ours = config.revision, imported.get("revision")
    if theirs and ours and theirs != ours:
        raise HubError(f"{config.path} names its base {config.base!r} at revision {theirs!r}, "
                       f"but {base} holds revision {ours!r}: import the base at that revision")
    if config.base in known or any(
            Path(config.base).exists() and Path(k).exists()
            and Path(config.base).resolve() == Path(k).resolve() for k in known):
        return "name"
    if Path(config.base).name in {Path(k).name for k in known}:
        say(f"the adapter names its base {config.base!r} and {base} was imported from "
            f"{sorted(known)[0]!r}: matched by folder name and tensor shapes only")
        return "folder name and shapes"
    raise HubError(f"{config.path}: the adapter was made for {config.base!r} (its "
                   f"base_model_name_or_path), but {base} holds the weights of "
                   f"{sorted(known)[0]!r}: import it onto a run of its own base")


def import_adapter(source: str | Path, base: str | Path, out: str | Path, *,
                   preset_name: str = "dp") -> dict[str, Any]:
    """A new run `out` holding the weights of `base` (a run imported from the adapter's base
    model) and the PEFT adapter in folder `source`, at step 0 without optimizer state; returns
    a summary. Everything is checked before `out` is written, and the adapter's sizes (its rank,
    the tensors' shapes) before anything is allocated."""
    source, base, out = Path(source), Path(base), Path(out)
    check_out(out)
    if not source.is_dir():
        raise HubError(f"{source} is not a folder (a PEFT adapter folder holds {CONFIG} and "
                       f"{WEIGHTS})")
    try:
        saved = RunDir(base).read()
        if saved.adapters is not None:
            raise HubError(f"--base {base} carries adapters of its own: give the run of the "
                           f"base model itself")
        adapters, config = read_config(source, saved.model)
        matched_by = _check_base(config, base, lambda m: warnings.warn(m, stacklevel=2))
        weights = SafetensorsFile(resolve_inside(source, WEIGHTS, f"{source}'s {WEIGHTS}"))
        _check_weights(weights, saved.model, adapters, source)
        loaded = load_run(base, preset_name)
    except (*LOAD_ERRORS, WeightsError) as error:
        raise HubError(str(error)) from None
    model, cfg = loaded.model, loaded.config
    lora.attach(model, adapters, key=jax.random.key(0))
    _read_weights(weights, model, cfg)
    with _new_directory(out) as staging:
        tokenizer = keep_vocabulary(cfg.tokenizer, base, staging)
        record = {"source": str(source), "base": str(base.absolute()),
                  "peft_version": config.peft_version, "base_matched_by": matched_by}
        RunDir(staging).write(dataclasses.replace(cfg, tokenizer=tokenizer), None,
                              imported=record,
                              adapters={**adapters.record(), "base": str(base.absolute())})
        checkpointer = Checkpointer(staging / "checkpoints", async_save=False)
        checkpointer.save(0, model, None, data_state={}, rng=jax.random.key(0))
        checkpointer.wait()
        checkpointer.close()
    return {"out": out, "adapters": adapters, "tensors": len(weights.keys())}


def _check_weights(weights: SafetensorsFile, cfg: ModelConfig, adapters: lora.Adapters,
                   source: Path) -> None:
    """Every tensor the adapters need is in the file with PEFT's shape for their rank (lora_A
    [r, in], lora_B [out, r]) and a float dtype, and nothing is left over: checked from the
    header alone, before any array exists."""
    wanted = set()
    for module in (m for m in modules(cfg) if m.target in adapters.targets):
        out_features, in_features = module.features
        for i in range(cfg.num_layers if module.stacked else 1):
            for key, shape in zip(module.keys(i), ((adapters.rank, in_features),
                                                   (out_features, adapters.rank))):
                if key not in weights:
                    raise HubError(f"{source / WEIGHTS} lacks {key}")
                if weights.shape(key) != shape or str(weights.dtype(key)) not in READABLE:
                    raise HubError(f"{source / WEIGHTS}: {key} is {weights.dtype(key)} "
                                   f"{list(weights.shape(key))}, but a rank-{adapters.rank} "
                                   f"adapter of this run's model needs float {list(shape)}: it "
                                   f"was made for another base model, or its r is wrong")
                wanted.add(key)
    extra = sorted(set(weights.keys()) - wanted)
    if extra:
        raise HubError(f"{source / WEIGHTS} holds tensors this adapter config does not "
                       f"describe ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")


def _read_weights(weights: SafetensorsFile, model: nnx.Module, cfg: ModelConfig) -> None:
    """Every adapter of `model` from the PEFT file (checked by `_check_weights`), each array
    replicated on the mesh its kernel is on."""
    replicated = jax.NamedSharding(jax.tree.leaves(nnx.state(model))[0].sharding.mesh, jax.P())
    for module, adapter in _by_path(model, cfg):
        layers = cfg.num_layers if module.stacked else 1
        a_shape, b_shape = (tuple(p.shape[1:] if module.stacked else p.shape)
                            for p in (adapter.a, adapter.b))
        pairs = [to_ours(*(np.asarray(weights[k], np.float32) for k in module.keys(i)),
                         a_shape, b_shape) for i in range(layers)]
        for param, values in zip((adapter.a, adapter.b), zip(*pairs)):
            array = np.stack(values) if module.stacked else values[0]
            param.set_value(jax.device_put(array, replicated))
