"""A run directory: the one module that knows its files, its config and its latest weights.

    <run>/config.json          what the run is: the model config (enough to rebuild the model),
                               the training config, the preset, tokenizer and data it used
    <run>/checkpoints/         Orbax checkpoints (`minigpt.checkpoint`)
    <run>/metrics.jsonl        one JSON record per logged step (`minigpt.train.metrics`)
    <run>/tensorboard/         the same as TensorBoard events, and profiler traces
    <run>/loss.png             the loss curve, when the run ends
    <run>/trainer.lock         while a trainer works on it (`minigpt.train.lock`)
    <run>/damaged-checkpoints/ checkpoints a resume could not read, moved aside unchanged
    <run>/vocabulary.tiktoken  an imported vocabulary, when the run has one

`RunDir` names those paths and reads and writes config.json (`SavedRun`); `load_run` restores a
run's latest weights for generation or export (`LoadedRun`); whether a command line may resume a
run is `minigpt.train.resuming`'s to say. Problems with a run directory raise `RunError`,
whose message says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from minigpt import chat_template, models, runtime, sharding
from minigpt.checkpoint import Checkpointer, CheckpointError, has_checkpoint
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.config.values import check_value, field_types
from minigpt.files import read_json_object, write_text_atomic
from minigpt.models import DecoderLM, build_model, lora
from minigpt.tokenizer import Encoding, TokenizerError, load_tokenizer

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
LOSS_PLOT = "loss.png"
LOCK = "trainer.lock"
DAMAGED = "damaged-checkpoints"
MAX_DEVICES = 1 << 16  # devices a run's record may say it used (a resume simulates as many)

class RunError(ConfigError):
    """A run directory is missing, damaged, or not what the request needs; the message says what
    to do."""


@dataclass(frozen=True)
class SavedRun:
    """What a run's config.json says: the model, the training config (None for imported weights,
    which are not a training run yet) and the rest of the record (preset, tokenizer, data
    directory, the time budget's decisions, where imported weights came from, ...)."""

    model: ModelConfig
    train: TrainConfig | None
    record: dict[str, Any]

    @property
    def imported(self) -> dict[str, Any] | None:
        return self.record.get("imported")

    @property
    def adapters(self) -> lora.Adapters | None:
        """The low-rank adapters the run's model carries (config.json's "adapters"), if any."""
        try:
            return lora.Adapters.from_record(self.record.get("adapters"))
        except ConfigError as error:
            raise RunError(str(error)) from None


@dataclass(frozen=True)
class RunDir:
    """The paths of a run directory, and its config.json."""

    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def loss_plot(self) -> Path:
        return self.path / LOSS_PLOT

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def damaged(self) -> Path:
        return self.path / DAMAGED

    def has_checkpoints(self) -> bool:
        """Whether checkpoints/ holds anything at all (complete or not)."""
        return self.checkpoints.is_dir() and any(self.checkpoints.iterdir())

    def read(self) -> SavedRun:
        """config.json, checked and turned into configs; RunError if it is missing or damaged."""
        path = self.config_file
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"{self.path} is not a run directory (one trained here, or made by "
                           f"python -m minigpt.hub import): it is a file")
        missing = f"{path} does not exist: is this a minigpt run directory?"
        try:
            payload = read_json_object(path, RunError, missing=missing,
                                       kind="a minigpt run config (a JSON object)")
        except RunError as error:
            damaged = "" if str(error) == missing else "; the run directory is damaged"
            raise RunError(f"{error}{damaged}") from None
        if "model_type" in payload or "architectures" in payload:
            raise RunError(f"{self.path} is a Hugging Face model folder, not a minigpt run: "
                           f"import it first with python -m minigpt.hub import {self.path} "
                           f"--out RUN")
        if not isinstance(payload.get("model"), dict):
            raise RunError(f"{path} is not a minigpt run config (no model section)")
        model = dict(payload.pop("model"))
        # Runs from before models named their tokenizer recorded only the data's.
        model.setdefault("tokenizer", payload.get("tokenizer", "gpt2"))
        # A tokenizer the run directory holds (an imported one's folder, or a vocabulary file
        # earlier versions converted) is named relative to it.
        tokenizer = model["tokenizer"]
        if isinstance(tokenizer, str) and _held(self.path, tokenizer) and \
                not Path(tokenizer).is_absolute():
            model["tokenizer"] = str((self.path / tokenizer).absolute())
        train = payload.pop("train", None)
        if isinstance(train, dict):  # runs from before documents were kept apart mixed them
            train.setdefault("document_mask", False)
        try:
            model_cfg = models.from_dict(model)
            train_cfg = None if train is None else _built(TrainConfig, train)
            _check_record(payload)
            saved = SavedRun(model=model_cfg, train=train_cfg, record=payload)
            saved.adapters  # noqa: B018 - checked here, with the rest of the file
        except ConfigError as error:
            raise RunError(f"{path}: {error}") from None
        return saved

    def write(self, model: ModelConfig, train: TrainConfig | None, **record: Any) -> None:
        """Write config.json atomically (a crash mid-write never leaves a broken run directory).

        A tokenizer file inside the run directory (an imported vocabulary) is recorded by its
        name there, so the run directory can move; `train` is None for imported weights."""
        model_fields = model.as_dict()
        tokenizer = Path(model.tokenizer)
        if tokenizer.is_absolute() and tokenizer.parent == self.path.absolute():
            model_fields["tokenizer"] = tokenizer.name
        payload = {"model": model_fields,
                   **({"train": dataclasses.asdict(train)} if train else {}), **record}
        # allow_nan=False: every value was checked finite; this keeps the file JSON regardless.
        write_text_atomic(self.config_file, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def _held(run: Path, tokenizer: str) -> bool:
    """Whether a tokenizer name means a file or folder inside the run directory."""
    return (tokenizer.endswith(".tiktoken") and (run / tokenizer).is_file()) or (
        (run / tokenizer / "tokenizer.json").is_file())


def _check_record(record: dict[str, Any]) -> None:
    """The fields config.json records beside the configs, type-checked as the configs' own
    are (ConfigError naming the field) before anything reads them: names are text, the devices
    a run used are counted in integers (a resume simulates as many), a time budget's record
    holds finite numbers. Fields minigpt does not read are left as they are."""
    for key in ("devices", "imported", "adapters", "time_budget"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            raise ConfigError(f"{key} must be an object, got {json.dumps(record[key])[:60]}")
    devices, imported = record.get("devices") or {}, record.get("imported") or {}
    checks = [*((key, str, record.get(key)) for key in ("preset", "tokenizer", "data_dir")),
              *((f"devices.{key}", kind, devices.get(key))
                for key, kind in (("platform", str), ("count", int), ("processes", int))),
              *((f"imported.{key}", str, imported.get(key))
                for key in ("source", "directory", "base", "revision"))]
    for key, entry in (record.get("time_budget") or {}).items():
        for name, number in (entry.items() if isinstance(entry, dict) else [("", entry)]):
            checks.append((f"time_budget.{key}.{name}".rstrip("."), float, number))
    for where, kind, value in checks:
        if value is not None:
            check_value(where, kind, value)
    if not 1 <= devices.get("count", 1) <= MAX_DEVICES or devices.get("processes", 1) < 1:
        raise ConfigError(f"devices must be 1 to {MAX_DEVICES} in 1 or more processes: {devices}")


def _built(cls, values: dict[str, Any]):
    """A config from config.json's values: its tuples come back as JSON lists."""
    types = field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} fields {unknown}")
    return cls(**{name: tuple(value) if isinstance(value, list) and
                  typing.get_origin(types[name]) is tuple else value
                  for name, value in values.items()})


def _cannot_write(folder: Path) -> str | None:
    """Why a file cannot be made in `folder` (None: it can), found by making and removing one:
    Orbax, met with such a folder mid-save, waits minutes for its own threads before failing."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".minigpt-write-check-"):
            return None
    except OSError as error:
        return error.strerror or type(error).__name__


def check_start(out: str | Path, *, resume: bool, init_from: str = "") -> None:
    """Refuse a run that cannot start, before anything is written: `out` is not a directory,
    or holds files where a run keeps folders (or the reverse); a new run into a directory that
    already holds checkpoints; a run started from one (`init_from`) that holds none."""
    run = RunDir(out)
    if run.path.exists() and not run.path.is_dir():
        raise RunError(f"--out {out} is a file, not a directory: choose another --out")
    # a trainer writes, moves and deletes in these folders, and deletes old checkpoints' steps
    steps = list(run.checkpoints.iterdir()) if run.checkpoints.is_dir() else []
    for path in (run.checkpoints, run.tensorboard, run.damaged, *steps):
        if path.is_symlink():
            raise RunError(f"{path} is a link (to {os.readlink(path)}), but a run keeps its own "
                           f"{path.name} folder: training would write and delete files where "
                           f"it points. Replace the link with the folder itself, then train")
    for path, folder in ((run.checkpoints, True), (run.tensorboard, True), (run.damaged, True),
                         (run.config_file, False), (run.metrics, False)):
        if path.exists() and path.is_dir() != folder:
            raise RunError(f"{path} should be a {'folder' if folder else 'file'} of the run, "
                           f"but is not: move it out of {out}, then train again")
    for folder, purpose in ((run.path, "a run is trained in a directory it may write"),
                            (run.checkpoints, "the run saves its checkpoints there")):
        if resume and folder.is_dir() and (why := _cannot_write(folder)):
            raise RunError(f"cannot write in {folder} ({why}): {purpose}; make it writable, "
                           f"then train again")
    if init_from and not RunDir(init_from).path.is_dir():
        raise RunError(f"--init-from {init_from} is not a run directory (one trained here, or "
                       f"made by python -m minigpt.hub import)")
    if not resume and run.has_checkpoints():
        raise RunError(f"{out} already holds checkpoints: pass --resume to continue it, or "
                       f"choose another --out")
    if init_from and not resume and not has_checkpoint(RunDir(init_from).checkpoints):
        raise RunError(f"--init-from {init_from}: it holds no checkpoint to start from")


def keep_vocabulary(name: str, source_run: Path, run: Path) -> str:
    """A run that starts from the weights of `source_run` keeps its own copy of the tokenizer
    that run holds (an imported checkpoint's tokenizer folder, or a vocabulary file), so it does
    not depend on that directory; the tokenizer name to use from now on (`name` itself for any
    other tokenizer)."""
    path = Path(name)
    if path.parent != Path(source_run).absolute():
        return name
    run.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.copytree(path, run / path.name, dirs_exist_ok=True)
    for file in (path, path.with_suffix(".json")):
        if file.is_file():
            shutil.copy2(file, run / file.name)
    return str((run / path.name).absolute())


# --- loading the latest weights -----------------------------------------------------------

@dataclass
class LoadedRun:
    """A run's latest weights, restored for generation or export: the model laid out on the
    devices (`layout`: enter it with `run.layout.active()` to run the model), its tokenizer,
    the step it was saved at, and its config.json."""

    path: Path
    model: DecoderLM
    tokenizer: Encoding
    layout: sharding.Layout
    step: int
    saved: SavedRun

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def preset(self) -> sharding.Preset:
        return self.layout.preset

    @property
    def mesh(self):
        return self.layout.mesh


def load_run(run: str | Path, preset: str = "dp", *, merge_adapters: bool = False,
             dtype: str | None = None) -> LoadedRun:
    """Restore a run's latest model weights (no optimizer state) under a preset; a run whose
    model carries low-rank adapters gets them, applied beside its weights or, with
    `merge_adapters`, folded into them. `dtype` ("float32", "bfloat16" or "auto": bfloat16
    on an accelerator, float32 on a CPU) is what it computes in, whatever it trained in (None: as
    it trained); the weights stay as saved and the decoding engine casts them once.

    A latest checkpoint that cannot be read is skipped, with a warning, for the newest that can.
    Raises RunError for a directory that is not a run or holds no checkpoint yet.
    """
    directory = RunDir(run)
    if not directory.path.is_dir():
        raise RunError(f"run directory {directory.path} does not exist")
    saved = directory.read()
    cfg = saved.model if dtype is None else dataclasses.replace(saved.model, dtype=dtype)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.n_rows > cfg.vocab_size:
        raise RunError(
            f"{directory.path} was trained with tokenizer {cfg.tokenizer!r} and a vocabulary of "
            f"{cfg.vocab_size}, but that tokenizer reads {tokenizer.n_rows} tokens here")
    tokenizer = with_recorded_template(tokenizer, saved)
    if not directory.checkpoints.is_dir():
        raise RunError(f"{directory.path} holds no checkpoints/ directory: train it first")
    checkpointer = Checkpointer(directory.checkpoints, read_only=True)
    try:
        if checkpointer.latest_step() is None:
            raise RunError(f"{directory.checkpoints} holds no checkpoint yet")
        layout = sharding.Layout.make(preset)
        adapters = saved.adapters

        def build():
            model = build_model(cfg, rngs=nnx.Rngs(0))
            return model if adapters is None else lora.attach(model, adapters,
                                                              key=jax.random.key(0))

        runtime.check_fits(layout, [nnx.state(nnx.eval_shape(build))],
                           what=f"the model {directory.config_file} describes ({cfg.arch}, "
                                f"{cfg.num_layers} layers of width {cfg.embed_dim})",
                           hint="is the file the run was trained with?")
        model = sharding.abstract_sharded(build, layout)  # the checkpoint fills it
        restored = checkpointer.restore(model)
    finally:
        checkpointer.close()
    if merge_adapters:
        lora.merge(model)
    for step, why in restored["skipped"]:
        warnings.warn(f"checkpoint {step} of {directory.path} cannot be read ({why}); using "
                      f"step {restored['step']}, the newest that can", stacklevel=2)
    return LoadedRun(path=directory.path, model=model, tokenizer=tokenizer, layout=layout,
                     step=restored["step"], saved=saved)


def with_recorded_template(tokenizer, saved: SavedRun):
    """A run's tokenizer as it renders chats: with the chat template config.json recorded,
    where the vocabulary has none of its own (a zoo model fine-tuned on conversations)."""
    template = saved.record.get("chat_template")
    return chat_template.with_template(tokenizer, template)[0] if isinstance(
        template, str) else tokenizer


# What a caller of `load_run` may be told, besides RunError.
LOAD_ERRORS = (ConfigError, CheckpointError, TokenizerError, sharding.PresetError)
