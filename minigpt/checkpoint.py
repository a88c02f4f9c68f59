"""Checkpoints of a run, kept by an Orbax CheckpointManager in `<run>/checkpoints/`.

A checkpoint holds the model, the optimizer (its step count included), the data iterator's
position and the run's random key: everything needed to continue exactly. Orbax writes each one to
a temporary directory and renames it when complete, so a crash never leaves a half-written
checkpoint under a step's name; a temporary directory an interrupted save left behind is never
restored, and a writing Checkpointer removes it (and says so). Saving is asynchronous: training
goes on while the arrays are written.

Restoring reads each array straight into the sharding of the objects passed in, so a run saved
under one preset or device count continues under another. A checkpoint that cannot be read (a
disk garbled it, a copy was cut short) is skipped for the newest one that reads cleanly; the
caller is told which were skipped and why, and their files are left as they are (`set_aside`
moves one out of the way of new saves without deleting anything).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from minigpt.errors import UserError

# Orbax writes a checkpoint to `<step>.orbax-checkpoint-tmp-<time>` and renames it when complete.
TEMPORARY_MARK = ".orbax-checkpoint-tmp-"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing or cannot be read; the message says what to do."""


def _closed_loop_noise(unraisable) -> bool:
    """Whether an unraisable exception is TensorStore finishing a read for a restore that has
    already failed: Orbax closes its event loop on the first unreadable array, and each read
    still in flight then reports "Event loop is closed" as it completes."""
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _quiet_failed_restores() -> None:
    """Drop the "Event loop is closed" noise of a failed restore or save (one traceback per
    array still being read or written) from stderr; every other unraisable exception goes where
    it went before.

    Installed before a restore or save starts, not after it fails: the reads and writes still in
    flight report from TensorStore's threads as soon as Orbax gives up, which can be before the
    failure reaches us."""
    previous = sys.unraisablehook
    if getattr(previous, "minigpt_quiet", False):
        return

    def hook(unraisable) -> None:
        if not _closed_loop_noise(unraisable):
            previous(unraisable)

    hook.minigpt_quiet = True
    sys.unraisablehook = hook


@contextlib.contextmanager
def _absl_errors_only():
    """Orbax says at warning level that a read-only manager is read-only; generation need not."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _restore_target(obj: Any):
    """Shapes, dtypes and shardings of an NNX object's arrays: where restored values go."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        nnx.state(obj))


def _gist(error: BaseException) -> str:
    """The first line of the innermost cause: Orbax wraps what TensorStore or the file system
    said in long messages of its own."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else 'no details'}"


def _failed_write(what: str, error: BaseException) -> tuple[str, str]:
    """What failed, and why, from what Orbax and TensorStore said: the step whose temporary
    directory was being written, and the system's reason (TensorStore gives it as an error
    code: 28, "No space left on device")."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error)
    step = re.search(r"/(\d+)\.orbax-checkpoint-tmp", text)
    code = re.search(r"os_error_code='(\d+)'", text)
    errno = getattr(error, "errno", None) or (int(code.group(1)) if code else None)
    if step:
        what = f"cannot save checkpoint {step.group(1)}"
    return what, os.strerror(errno) if errno else _gist(error)


# Checkpoints written before every model stacked its blocks into [layers, ...] arrays hold a
# list of blocks instead: `blocks.layers.0.attention...`, `blocks.layers.1...`. They are read
# layer by layer into arrays shaped like one slice of today's, then stacked.

def key_names(path: tuple) -> tuple[str, ...]:
    """A pytree path as the names Orbax stores: dict keys as strings, attributes by name."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _layer_position(names: tuple[str, ...]) -> int | None:
    """Where the layer index goes in a stacked parameter's path (after blocks.layers), if any."""
    for i in range(len(names) - 1):
        if names[i:i + 2] == ("blocks", "layers"):
            return i + 2
    return None


def _has_layer_list(item_dir: Path) -> bool:
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir)).tree
    names = [key_names(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return any((p := _layer_position(n)) is not None and n[p].isdigit() for n in names)


def _layer_list_target(target) -> dict:
    """The nested-dict restore target of a layer-list checkpoint, one entry per layer, each
    with the sharding of one slice of the stacked array."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        names = key_names(path)
        at = _layer_position(names)
        layers = [None] if at is None else range(leaf.shape[0])
        for i in layers:
            if i is None:
                key, sds = names, leaf
            else:
                key = (*names[:at], str(i), *names[at:])
                spec = jax.P(*tuple(leaf.sharding.spec)[1:])
                sds = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype,
                                           sharding=jax.NamedSharding(leaf.sharding.mesh, spec))
            node = out
            for name in key[:-1]:
                node = node.setdefault(name, {})
            node[key[-1]] = sds
    return out


def _stack_layer_list(restored: dict, target):
    """Today's state from a restored layer-list tree: each stacked parameter's layers stacked."""
    def lookup(names):
        node = restored
        for name in names:
            node = node[name]
        return node

    def value(path, leaf):
        names = key_names(path)
        at = _layer_position(names)
        if at is None:
            return lookup(names)
        layers = [lookup((*names[:at], str(i), *names[at:])) for i in range(leaf.shape[0])]
        return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=leaf.sharding)(*layers)

    return jax.tree_util.tree_map_with_path(value, target)


@functools.cache
def _write_arrays_from_one_replica() -> None:
    """In a single-process job, write each array from one copy of it instead of splitting the
    copies' work (Orbax's "replica parallel" saving, its default off GPUs): every copy lives in
    this one process, so there is nothing to share out between hosts, and on CPU devices the
    split cost one compiled slice per array and device, about 2 s for each save of even a tiny
    model on 8 simulated devices."""
    if jax.process_count() == 1:
        with _absl_errors_only():  # Orbax warns that a handler is replaced: this one is
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                override=True)


class _OrbaxErrorsOnly(logging.Filter):
    """Orbax logs a failed asynchronous save from each of its threads, with a traceback, before
    the failure reaches the trainer; the Checkpointer reports it once, in one line, instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


_ORBAX_ERRORS = _OrbaxErrorsOnly()


class Checkpointer:
    """Save and restore a run's checkpoints. `read_only` opens them for generation: nothing is
    created, cleaned or written. A save that fails (a full disk, a folder made read-only) is
    reported once, as a one-line CheckpointError from `save` or `wait`: the checkpoints written
    before it are intact, and the step it was saving is left as an incomplete temporary
    directory, which the next writing Checkpointer removes."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        _write_arrays_from_one_replica()
        # Temporary directories left by interrupted saves; a writing manager removes them.
        self.leftovers = sorted(p.name for p in self.directory.glob(f"*{TEMPORARY_MARK}*"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save)
        self._failed = False
        _quiet_failed_restores()
        if not read_only:
            logging.getLogger("absl").addFilter(_ORBAX_ERRORS)
        with _absl_errors_only() if read_only else contextlib.nullcontext():
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None, *,
             data_state: dict[str, Any], rng: jax.Array, force: bool = False,
             layout: Callable[[Any], Any] | None = None) -> bool:
        """Start saving a checkpoint for `step`; returns False if one already exists.

        `layout` maps the model's and the optimizer's state to what is stored (a run that
        keeps its layers in another order stores them in the model's). Without an optimizer
        only the weights are stored (imported weights): they restore for generation and as a
        new run's starting point, not for resuming."""
        if step in self._manager.all_steps():
            return False
        layout = layout or (lambda state: state)
        meta = {"step": step, "rng": np.asarray(jax.random.key_data(rng)).tolist()}
        items = {"model": ocp.args.StandardSave(layout(nnx.state(model))),
                 "data": ocp.args.JsonSave(data_state), "meta": ocp.args.JsonSave(meta)}
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(layout(nnx.state(optimizer)))
        args = ocp.args.Composite(**items)
        with self._reporting(f"cannot save checkpoint {step}"):
            return self._manager.save(step, args=args, force=force)

    @contextlib.contextmanager
    def _reporting(self, what: str):
        """Turn a failed save (this one, or the asynchronous one before it, which Orbax reports
        when the next begins) into one CheckpointError, the first time; later waits and the
        close stay quiet, so the first failure is the one the user reads."""
        try:
            yield
        except Exception as error:  # Orbax and TensorStore raise many kinds for a failed write
            if self._failed:
                return
            self._failed = True
            gc.collect()  # the writes Orbax abandoned end now, not noisily at exit
            what, why = _failed_write(what, error)
            self.reload()  # the steps on disk, not the one Orbax began to write
            kept = ", ".join(map(str, self.all_steps())) or "none"
            raise CheckpointError(
                f"{what} in {self.directory}: {why}. The checkpoints written before it are "
                f"intact (steps: {kept}); once the cause is gone (free space, a writable "
                f"folder), continue with --resume") from None

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None,
                step: int | None = None) -> dict[str, Any]:
        """Load a checkpoint into `model` (and `optimizer`) in place.

        Without `step`, the newest checkpoint that reads cleanly: newer ones that cannot be read
        are listed in the result's "skipped" as (step, why). Returns {"step", "rng", "skipped",
        and with an optimizer "data_state"}; without an optimizer only the model is read.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        _quiet_failed_restores()
        skipped = []
        for candidate in steps:
            try:
                result = self._restore(candidate, model, optimizer)
            except CheckpointError as error:
                skipped.append((candidate, str(error)))
                continue
            return {**result, "skipped": skipped}
        reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be read ({reasons}): they are damaged or "
            f"from an incompatible model; their files are left as they are")

    def _restore(self, step: int, model, optimizer) -> dict[str, Any]:
        objects = {"model": model} if optimizer is None else {"model": model,
                                                              "optimizer": optimizer}
        targets = {name: _restore_target(obj) for name, obj in objects.items()}
        try:
            layer_list = _has_layer_list(self.directory / str(step) / "model")
            items = {name: ocp.args.StandardRestore(
                _layer_list_target(target) if layer_list else target)
                for name, target in targets.items()}
            items["meta"] = ocp.args.JsonRestore()
            if optimizer is not None:
                items["data"] = ocp.args.JsonRestore()
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
            states = {name: _stack_layer_list(restored[name], targets[name]) if layer_list
                      else restored[name] for name in objects}
            rng = jax.random.wrap_key_data(np.asarray(restored["meta"]["rng"], dtype=np.uint32))
            result = {"step": int(restored["meta"]["step"]), "rng": rng}
        except Exception as error:  # Orbax and TensorStore raise many kinds for unreadable files
            raise CheckpointError(_gist(error)) from error
        # Only a checkpoint that was read whole reaches the model.
        for name, obj in objects.items():
            nnx.update(obj, states[name])
        if optimizer is not None:
            result["data_state"] = restored["data"]
        return result

    def set_aside(self, step: int, destination: str | Path) -> Path:
        """Move a step's checkpoint to `destination/<step>` (never deleting or overwriting), so
        that new saves of that step can be written; returns where it went."""
        destination = Path(destination)
        destination.mkdir(parents=True, exist_ok=True)
        target = destination / str(step)
        if target.exists():
            target = destination / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.move(self.directory / str(step), target)
        self.reload()
        return target

    def set_aside_skipped(self, skipped: list[tuple[int, str]], destination: Path, *,
                          writer: bool, say: Callable[[str], None]) -> None:
        """After a restore that skipped unreadable checkpoints: move them, unchanged, to
        `destination` (the writing process does; the others wait for it) so that the steps
        they held can be saved again, and say so."""
        for step, why in skipped:
            where = self.set_aside(step, destination) if writer else destination
            say(f"warning: checkpoint {step} cannot be read ({why}); skipped it. Its files are "
                f"kept, unchanged, in {where}")
        if skipped and jax.process_count() > 1:
            multihost_utils.sync_global_devices("minigpt: damaged checkpoints set aside")
            self.reload()

    def reload(self) -> None:
        """Read the list of checkpoints from disk again (after another process changed it)."""
        self._manager.reload()

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk (CheckpointError if one failed)."""
        with self._reporting("cannot save the latest checkpoint"):
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._reporting("cannot save the latest checkpoint"):
                self._manager.close()
        finally:
            logging.getLogger("absl").removeFilter(_ORBAX_ERRORS)


def has_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` holds at least one complete checkpoint."""
    if not Path(directory).is_dir():
        return False
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        return checkpointer.latest_step() is not None
    finally:
        checkpointer.close()


def restore_weights(directory: str | Path, model: nnx.Module) -> dict[str, Any]:
    """Read the newest readable checkpoint's weights in `directory` into `model` (nothing
    else); returns what `Checkpointer.restore` does, after warning of any it skipped."""
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        restored = checkpointer.restore(model)
    finally:
        checkpointer.close()
    for step, why in restored["skipped"]:
        print(f"warning: checkpoint {step} in {directory} cannot be read ({why}); skipped it",
              file=sys.stderr)
    return restored
