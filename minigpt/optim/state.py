"""The state a run trains: the model (with low-rank adapters where `--set train.lora_rank=R`
asks for them) and its optimizer, checked, built and started from another run's weights.

The adapters a run asks for are checked against its model before anything is compiled
(`check`); the model is built with them and the optimizer holds them alone (`build`), so the
base weights take no gradient and have no optimizer state; a new run started from another run's
weights (`start_from`) continues that run's adapters when they are the same, folds them into the
weights when they are not, and otherwise takes the weights as its frozen base. config.json
records the adapters the model carries and which run holds the base they adapt (`record`),
which `minigpt.runs.load_run` and the PEFT export (`minigpt.hub.peft`) read. The layers' side
is `minigpt.models.lora`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt import runtime
from minigpt.checkpoint import restore_weights
from minigpt.config import ModelConfig, TrainConfig
from minigpt.models import build_model, lora
from minigpt.optim.optimizer import make_optimizer
from minigpt.runs import RunDir, resolved


def check(model_cfg: ModelConfig, train_cfg: TrainConfig, layout) -> None:
    """Refuse, from shapes alone and before anything is allocated (ConfigError, one line):
    targets that name no projection of the model (saying which it has), and a model whose
    weights, gradients and optimizer state cannot fit the devices under the preset
    (`runtime.check_fits`), naming the adapters' rank where they are what does not fit."""
    wanted = resolved.adapters(train_cfg)
    if wanted is not None:  # named by the model's architecture, before adapters are attached
        plain = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
        lora.check_targets(plain, wanted.targets, model_cfg.arch)
    model, optimizer = nnx.eval_shape(lambda: build(model_cfg, train_cfg))
    states = [nnx.state(model), nnx.state(model, lora.trainable(model)), nnx.state(optimizer)]
    if wanted is None:
        what, hint = (f"the model ({model_cfg.arch}, {model_cfg.num_layers} layers of width "
                      f"{model_cfg.embed_dim})", "choose a smaller model, or a preset that "
                      "splits the weights over more devices (fsdp)")
    else:
        what, hint = (f"train.lora_rank={wanted.rank}", "a rank between 4 and 64 is usual, and "
                      "a rank above the width of the projections it adapts adds nothing")
    runtime.check_fits(layout, states, what=what, hint=hint)


def build(model_cfg: ModelConfig, train_cfg: TrainConfig, *,
          replicated: bool = False) -> tuple[nnx.Module, nnx.Optimizer]:
    """The model, with the run's adapters, and its optimizer, which keeps state for what trains
    alone (`lora.trainable`). Run inside `sharding.create_sharded`, every array is born sharded
    (`replicated`: the adapters whole on every device, bench/bench_lora.py's comparison)."""
    rngs = nnx.Rngs(train_cfg.seed)
    model = build_model(model_cfg, rngs=rngs)
    wanted = resolved.adapters(train_cfg)
    if wanted is not None:
        lora.attach(model, wanted, key=rngs.params(), replicated=replicated)
    return model, nnx.Optimizer(model, make_optimizer(train_cfg), wrt=lora.trainable(model))


def start_from(model: nnx.Module, source: Path, wanted: lora.Adapters | None, *,
               say: Callable[[str], None]) -> str | None:
    """Give a new run (`--init-from`, a fresh optimizer at step 0) the latest weights of
    `source`, trained here or imported. Adapters of the same shape as the run's (`wanted`)
    continue; others are folded into the weights. Returns the run holding the base weights the
    model's adapters adapt, unchanged (None when they exist in no run: adapters were folded in)."""
    saved = RunDir(source).read()
    theirs = saved.adapters
    continuing = wanted is not None and wanted.same_weights(theirs)
    held = [] if continuing else lora.detach(model)
    if theirs is not None and not continuing:  # read them beside the weights, to fold them in
        lora.attach(model, theirs, key=jax.random.key(0))
        for _, dense in lora.adapted(model):
            replicated = jax.NamedSharding(dense.kernel.get_value().sharding.mesh, jax.P())
            for p in (dense.lora.a, dense.lora.b):  # the same values in every process
                p.set_value(jax.device_put(np.asarray(p.get_value()), replicated))
    _release(model)
    restored = restore_weights(RunDir(source).checkpoints, model)
    if continuing:
        say(f"starting from the weights and adapters of {source} at its step "
            f"{restored['step']} (a fresh optimizer, step 0)")
        return (saved.record.get("adapters") or {}).get("base")
    lora.merge(model)
    lora.reattach(held)
    merged = " with its adapters folded into them" if theirs is not None else ""
    say(f"starting from the weights of {source} at its step {restored['step']}{merged} (a "
        f"fresh optimizer, step 0)")
    return None if theirs is not None else str(Path(source).absolute())


def _release(model: nnx.Module) -> None:
    """Drop the arrays a model was built with, keeping the shape, dtype and sharding of each,
    where the restore that replaces them reads the start weights: the host never holds both
    (for a 1B model, 5 GB less at the peak of `--init-from`)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.Array):
            value = node.get_value()
            node.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=value.sharding))
            value.delete()


def record(cfg: TrainConfig, base: str | None) -> dict[str, Any]:
    """What config.json says of a new run's adapters ({} without): their shape and the run
    holding the base weights they adapt (None: none does, they are this run's own)."""
    wanted = resolved.adapters(cfg)
    return {} if wanted is None else {"adapters": {**wanted.record(), "base": base}}
