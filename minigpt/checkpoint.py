"""Checkpoints of a run, kept by an Orbax CheckpointManager in `<run>/checkpoints/`.

A checkpoint holds the model, the optimizer (its step count included), the data iterator's
position and the run's random key: everything needed to continue exactly. Orbax writes each one to
a temporary directory and renames it when complete, so a crash never leaves a half-written
checkpoint under a step's name. Saving is asynchronous: training goes on while the arrays are
written.

Restoring reads each array straight into the sharding of the objects passed in, so a run saved
under one preset or device count continues under another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


class CheckpointError(RuntimeError):
    """A checkpoint is missing or cannot be read; the message says what to do."""


def _restore_target(obj: Any):
    """Shapes, dtypes and shardings of an NNX object's arrays: where restored values go."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        nnx.state(obj))


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, *,
             data_state: dict[str, Any], rng: jax.Array, force: bool = False) -> bool:
        """Start saving a checkpoint for `step`; returns False if one already exists."""
        if step in self._manager.all_steps():
            return False
        meta = {"step": step, "rng": np.asarray(jax.random.key_data(rng)).tolist()}
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.state(model)),
            optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        return self._manager.save(step, args=args, force=force)

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None,
                step: int | None = None) -> dict[str, Any]:
        """Load a checkpoint (default: the latest) into `model` (and `optimizer`) in place.

        Returns {"step", "rng", "data_state"}; without an optimizer only the model is read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        items = {"model": ocp.args.StandardRestore(_restore_target(model)),
                 "meta": ocp.args.JsonRestore()}
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardRestore(_restore_target(optimizer))
            items["data"] = ocp.args.JsonRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (FileNotFoundError, ValueError, KeyError, OSError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); it is damaged or from an "
                f"incompatible model. Delete that step's directory to use an earlier one."
            ) from e
        nnx.update(model, restored["model"])
        result = {"step": int(restored["meta"]["step"]),
                  "rng": jax.random.wrap_key_data(
                      np.asarray(restored["meta"]["rng"], dtype=np.uint32))}
        if optimizer is not None:
            nnx.update(optimizer, restored["optimizer"])
            result["data_state"] = restored["data"]
        return result

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
