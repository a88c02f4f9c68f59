"""The optimizer: AdamW, or Muon for the blocks' weight matrices with AdamW for the rest.

Which parameters decay and how Muon sees each as a matrix go by the names the layers give them
(`minigpt.models.layers`: every weight matrix is a `kernel`, every lookup table a `table`).
The learning rate is not part of the optimizer: each update receives the run's `LRSchedule`
(`minigpt.optim.lr_schedule`) as numbers, so a time budget or a resumed run that moves the
schedule's end runs the same compiled step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from minigpt.config import TrainConfig
from minigpt.models.layers import DECAYED_PARAMETERS, OUTPUT_PROJECTIONS
from minigpt.models.lora import ADAPTER
from minigpt.models.moe import STACKED_EXPERTS
from minigpt.optim.lr_schedule import LRSchedule


def _names(path: tuple) -> list[str]:
    """The parameter names along a pytree path ("blocks", "layers", ..., "kernel"); a key
    holding a whole "a/b/c" path (as `partition` makes) counts as its parts."""
    names = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", None))
        if isinstance(key, str):
            names += key.split("/")
    return names


def decays(path: tuple) -> bool:
    """Whether weight decay applies to the parameter at this pytree path: weight matrices and
    embedding tables (the layers name them `kernel` and `table`) and low-rank adapters' matrices
    decay, biases and norm scales never, whatever their shape (a head bias is [heads, head_dim];
    a stacked norm scale is [layers, embed])."""
    names = _names(path)
    return names[-1] in DECAYED_PARAMETERS or ADAPTER in names[:-1]


def muon_dimensions(path: tuple, ndim: int) -> optax.contrib.MuonDimensionNumbers | None:
    """How Muon sees the parameter at this path as a matrix [inputs, outputs], or None where
    AdamW updates it (`train.optimizer = "muon"`).

    Muon takes the blocks' weight matrices: every `kernel` under `blocks`, whose first axis is
    the stacked layers (orthogonalised one layer at a time). A projection out to the embedding
    (`out`: [layers, heads, head_dim, embed]; `down`: [layers, mlp, embed]) contracts every
    middle axis; one in from it (query, key, value, up, gate: [layers, embed, ...]) contracts
    the embedding. A mixture of experts' experts ([layers, experts, ...]) are orthogonalised
    one expert at a time. Embedding tables, the output head, biases and norm scales go to AdamW.
    """
    names = _names(path)
    if "blocks" not in names or names[-1] != "kernel":
        return None
    first = 2 if STACKED_EXPERTS in names else 1  # the axes after the stacking ones
    if names[-2] in OUTPUT_PROJECTIONS:
        return optax.contrib.MuonDimensionNumbers(tuple(range(first, ndim - 1)), ndim - 1)
    return optax.contrib.MuonDimensionNumbers(first, tuple(range(first + 1, ndim)))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """The run's optimizer after global-norm clipping: AdamW, or (`train.optimizer = "muon"`)
    Muon for the blocks' matrices and AdamW for the rest (`muon_dimensions`). Matrices and
    tables decay, biases and norm scales do not (`decays`). The learning rate is not part of
    it: each update is given the run's `LRSchedule` (`optimizer.update(model, grads,
    schedule=...)`); Muon's matrices move at that schedule times muon_lr / lr."""
    if cfg.optimizer == "muon":
        return _muon(cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip, cfg.muon_momentum,
                     cfg.muon_lr / cfg.lr)
    return _adamw(cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip)


def scale_by_schedule_given() -> optax.GradientTransformationExtraArgs:
    """Multiply updates by -schedule(step), the schedule arriving with each update.

    Its state is optax's own `ScaleByScheduleState` (the step count), the state
    `optax.adamw(schedule)` keeps, so checkpoints of runs that compiled their schedule into the
    optimizer restore into this one unchanged.
    """
    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, schedule: LRSchedule, **extra):
        del params, extra
        rate = schedule(state.count)
        updates = jax.tree.map(lambda g: jnp.asarray(-rate, g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


@functools.cache
def _adamw(b1: float, b2: float, weight_decay: float,
           clip: float) -> optax.GradientTransformationExtraArgs:
    # Cached: the optimizer object is part of what a compiled step is keyed on, so equal
    # settings must give the identical object to reuse a compilation.
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)

    adamw = optax.chain(  # optax.adamw, its learning rate given at each update
        optax.scale_by_adam(b1=b1, b2=b2),
        optax.add_decayed_weights(weight_decay, decay_mask),
        scale_by_schedule_given(),
    )
    if clip is None:  # AdamW's part of Muon's optimizer, which clips before it splits
        return adamw
    return optax.chain(optax.clip_by_global_norm(clip), adamw)


@functools.cache
def _muon(b1: float, b2: float, weight_decay: float, clip: float, momentum: float,
          ratio: float) -> optax.GradientTransformationExtraArgs:
    def dimensions(params):
        return jax.tree_util.tree_map_with_path(lambda path, p: muon_dimensions(path, p.ndim),
                                                params)

    muon = optax.chain(
        optax.contrib.scale_by_muon(beta=momentum, weight_dimension_numbers=dimensions),
        scale_by_shape(),
        optax.add_decayed_weights(weight_decay),
        optax.scale(ratio),
        scale_by_schedule_given(),
    )

    def group(path, param):
        return "adamw" if muon_dimensions(path, param.ndim) is None else "muon"

    return optax.chain(optax.clip_by_global_norm(clip),
                       partition({"muon": muon, "adamw": _adamw(b1, b2, weight_decay, None)},
                                 group))


def partition(transforms: dict[str, optax.GradientTransformation],
              group: Callable[[tuple, jax.Array], str]) -> optax.GradientTransformationExtraArgs:
    """Each transform updates the parameters `group(path, param)` names for it.

    optax.multi_transform does this with placeholders where a group's parameters are absent;
    NNX's optimizer state cannot hold those, so each group's transform here sees a flat dict
    {"a/b/kernel": parameter} of its own parameters alone, and its state is built on that.
    """
    def split(tree):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
        keys = ["/".join(_names(path)) for path, _ in leaves]
        groups = [group(path, leaf) for path, leaf in leaves]
        return keys, groups, [leaf for _, leaf in leaves], treedef

    def pick(keys, groups, leaves, name):
        return {k: leaf for k, g, leaf in zip(keys, groups, leaves) if g == name}

    def init(params):
        keys, groups, leaves, _ = split(params)
        return {name: tx.init(pick(keys, groups, leaves, name))
                for name, tx in transforms.items()}

    def update(updates, state, params=None, **extra):
        keys, groups, leaves, treedef = split(updates)
        param_leaves = split(params)[2] if params is not None else None
        new, new_state = dict(zip(keys, leaves)), {}
        for name, tx in transforms.items():
            mine = pick(keys, groups, param_leaves, name) if params is not None else None
            done, new_state[name] = optax.with_extra_args_support(tx).update(
                pick(keys, groups, leaves, name), state[name], mine, **extra)
            new.update(done)
        return treedef.unflatten([new[k] for k in keys]), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def scale_by_shape() -> optax.GradientTransformation:
    """Scale each orthogonalised update by sqrt(max(1, outputs / inputs)), as Keller Jordan's
    Muon does, so a matrix wider than it is tall moves by the same amount per input."""
    def size(u, axes):
        return math.prod(u.shape[a] for a in ((axes,) if isinstance(axes, int) else axes))

    def scale(path, u):
        d = muon_dimensions(path, u.ndim)
        if d is None:
            return u
        return u * max(1.0, size(u, d.output_axis) / size(u, d.reduction_axis)) ** 0.5

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
