"""Low-rank adapters (LoRA, Hu et al., 2021): a trainable update beside a frozen projection.

An adapted `Dense` computes y = x W + dropout(x) A B * alpha / r. Its kernel W may have several
input and output axes (`[D, N, H]` for the query heads, `[N, H, D]` for the output projection);
the adapter's A holds the kernel's input axes and a rank axis, [inputs..., r], and B a rank axis
and the kernel's output axes, [r, outputs...], each axis under the kernel's logical name, the
rank axis replicated, so an adapter is split wherever the layer it adapts is (`attach` with
`replicated` keeps all but the stacked `layers` axis whole instead; bench/bench_lora.py compares
the two). A starts as PEFT's does (uniform, +-1/sqrt(fan-in)) and B at zero, so an adapted model
computes exactly what its base does until B moves.

Adapters are attached to a model after it is built (`attach`), to the projections a run names
by their attribute names (`query`, `key`, `value`, `out`, `gate`, `up`, `down`, `output`); those
inside the block stack get the stack's leading [layers] axis like every stacked weight. They are
`nnx.LoRAParam`s, a kind of `nnx.Param`: a model that carries adapters trains them alone
(`trainable`) and every other parameter stays as it is. `merge` folds them into the kernels.

Dropout on an adapter's input draws its masks from the per-token keys the block stack hands each
layer (`dropout_keys`), folded with a number of the adapter's own, so every preset, microbatch
and pipeline stage draws the same masks; outside the stack (the output head) there is none.
A mixture of experts' experts are not adapted (their kernels run as grouped products).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import LORA_TARGETS, ConfigError
from minigpt.config.values import check_value
from minigpt.models.layers import Dense, dropout, fold_keys
from minigpt.models.moe import STACKED_EXPERTS
from minigpt.sharding import constrain

# The attribute an adapted Dense keeps its adapter under; the optimizer decays its matrices.
ADAPTER = "lora"
RANK = "r"  # the rank's letter in the adapters' einsum strings (the layers' letters are capitals)


# The largest LoRA scale (alpha / rank) taken. It multiplies each adapter's output: PEFT's usual
# settings give 0.5 to 4, and a scale past this one swamps the weights it adapts long before
# float32 overflows (a lora_alpha of 1e308 imported as all-infinite weights).
MAX_SCALE = 1e4


def check_scale(alpha_name: str, alpha: float, rank: int) -> None:
    """Refuse adapters whose scale alpha / rank is over MAX_SCALE (`alpha_name` names where the
    alpha comes from, e.g. "train.lora_alpha")."""
    if alpha / rank > MAX_SCALE:
        raise ConfigError(f"{alpha_name} = {alpha:g} with rank {rank} scales each adapter's "
                          f"output by {alpha / rank:.3g}, over the {MAX_SCALE:g} LoRA allows "
                          f"here (the usual settings give 0.5 to 4): lower the alpha")


@dataclasses.dataclass(frozen=True)
class Adapters:
    """Which adapters a model carries: rank r, scale alpha / r, the projections they adapt (by
    attribute name) and the dropout on their inputs while training."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def same_weights(self, other: Adapters | None) -> bool:
        """Whether `other` has adapters of the same shapes computing the same function (the
        dropout, a training setting, aside)."""
        return other is not None and (self.rank, self.alpha, set(self.targets)) == (
            other.rank, other.alpha, set(other.targets))

    def record(self) -> dict[str, Any]:
        """As config.json records it (`from_record` reads it back)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    def __post_init__(self) -> None:
        """The checks of the train.lora_* fields, for adapters however they arrive (a run's
        config.json, a PEFT adapter_config.json): typed, finite, in range. Which projections
        the targets name is checked against the model (`check_targets`)."""
        for name, kind in (("rank", int), ("alpha", float), ("dropout", float),
                           ("targets", tuple[str, ...])):
            check_value(f"adapters.{name}", kind, getattr(self, name))
        if self.rank <= 0 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.targets:
            raise ConfigError(f"adapters need a rank > 0, an alpha > 0, a dropout in [0, 1) and "
                              f"targets; got {self.rank}, {self.alpha}, {self.dropout} and "
                              f"{list(self.targets)}")
        check_scale("adapters.alpha", self.alpha, self.rank)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Adapters | None:
        """The adapters config.json's "adapters" entry describes (None: none), checked."""
        if not record:
            return None
        if not isinstance(record, dict) or not {"rank", "alpha", "targets"} <= set(record):
            raise ConfigError(f"config.json's adapters entry {json.dumps(record)[:80]} is not "
                              f"rank, alpha and targets")
        targets = record["targets"]
        return cls(rank=record["rank"], alpha=record["alpha"],
                   targets=tuple(targets) if isinstance(targets, list) else targets)


_keys: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("lora_keys",
                                                                         default=None)


@contextlib.contextmanager
def dropout_keys(keys: jax.Array | None) -> Iterator[None]:
    """Per-token dropout keys [B, T] for the adapters of the layer traced inside (None: no
    dropout). The block stack sets them around each layer."""
    token = _keys.set(keys)
    try:
        yield
    finally:
        _keys.reset(token)


def einsum_specs(spec: str) -> tuple[str, str, str, str]:
    """A Dense spec's adapter as einsum strings: (x to the rank, the rank to the output, A's
    letters, B's letters). "BTD,DNH->BTNH" gives "BTD,Dr->BTr", "BTr,rNH->BTNH", "Dr", "rNH";
    a kernel letter the output keeps (an expert axis E) stays in A, B and between them."""
    lhs, out = spec.split("->")
    x, kernel = lhs.split(",")
    ellipsis = "..." if x.startswith("...") else ""
    x_letters, out_letters = x.removeprefix("..."), out.removeprefix("...")
    ins = [c for c in kernel if c in x_letters]
    contracted = [c for c in ins if c not in out_letters]
    kept = [c for c in ins if c in out_letters]
    outs = [c for c in kernel if c not in x_letters]
    a = "".join(ins) + RANK
    b = "".join(kept) + RANK + "".join(outs)
    z = ellipsis + "".join(c for c in x_letters if c not in contracted) + RANK
    return f"{x},{a}->{z}", f"{z},{b}->{out}", a, b


class Adapter(nnx.Module):
    """The low-rank update of one projection: x -> dropout(x) A B * scale."""

    def __init__(self, dense: Dense, adapters: Adapters, salt: int, *, key: jax.Array,
                 replicated: bool = False):
        self.down, self.up, a_letters, b_letters = einsum_specs(dense.spec)
        self.letters = kernel_letters = dense.spec.split("->")[0].split(",")[1]
        shape, axes = dense.kernel.shape, dense.kernel.get_metadata().get("out_sharding")
        axes = axes or (None,) * len(shape)
        lead = len(shape) - len(kernel_letters)  # stacked axes in front ([layers])
        size = dict(zip(kernel_letters, shape[lead:]))
        name = dict(zip(kernel_letters, axes[lead:]))

        def layout(letters: str) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
            dims = tuple(adapters.rank if c == RANK else size[c] for c in letters)
            names = tuple(None if c == RANK or replicated else name[c] for c in letters)
            return shape[:lead] + dims, tuple(axes[:lead]) + names

        (a_shape, a_axes), (b_shape, b_axes) = layout(a_letters), layout(b_letters)
        fan_in = math.prod(size[c] for c in a_letters[:-1] if c not in b_letters)
        bound = 1 / math.sqrt(fan_in)  # PEFT's kaiming_uniform(a=sqrt(5)) of lora_A
        self.a = nnx.LoRAParam(jax.random.uniform(key, a_shape, jnp.float32, -bound, bound),
                               out_sharding=a_axes, eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32), out_sharding=b_axes,
                               eager_sharding=False)
        self.scale, self.rate, self.salt = adapters.scale, adapters.dropout, salt

    def __call__(self, x: jax.Array) -> jax.Array:
        keys = _keys.get()
        x = dropout(x, self.rate, None if keys is None else fold_keys(keys, self.salt))
        # Used whole, as FSDP gathers a weight where it is used (they are r / D of its size):
        # left to choose, XLA reshards them inside a pipeline stage of a 3-D preset with
        # collective permutes that only the stages taking that branch reach, and deadlocks.
        a, b = (constrain(p[...], (None,) * p.ndim).astype(x.dtype) for p in (self.a, self.b))
        z = jnp.einsum(self.down, x, a)  # [..., r]
        return jnp.einsum(self.up, z, b) * jnp.asarray(self.scale, x.dtype)

    def delta(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """The update A B * scale of this adapter's A and B (stacked axes included) in its
        kernel's layout, float32."""
        a_letters = self.down.split(",")[1].split("->")[0]
        b_letters = self.up.split(",")[1].split("->")[0]
        stacked = "".join(chr(ord("a") + i) for i in range(a.ndim - len(a_letters)))
        return jnp.einsum(f"{stacked}{a_letters},{stacked}{b_letters}->{stacked}{self.letters}",
                          a.astype(jnp.float32), b.astype(jnp.float32)) * self.scale


def projections(model: nnx.Module) -> list[tuple[tuple[str, ...], Dense]]:
    """Every projection an adapter may be attached to, with its path: the Dense layers, but a
    mixture of experts' experts."""
    return [(tuple(str(p) for p in path), node) for path, node in nnx.iter_graph(model)
            if isinstance(node, Dense) and STACKED_EXPERTS not in [str(p) for p in path]]


def check_targets(model: nnx.Module, targets: tuple[str, ...], arch: str) -> None:
    """Refuse a target that names no projection of the model (ConfigError, naming those it
    has). The default targets mean those of attention and the feed-forward the model has (a
    GELU MLP has no `gate`)."""
    names = sorted({path[-1] for path, _ in projections(model)})
    unknown = [t for t in targets if t not in names and tuple(targets) != LORA_TARGETS]
    if not set(targets) & set(names) or unknown:
        raise ConfigError(f"train.lora_targets {', '.join(unknown) or '(none)'}: name no layer "
                          f"of the {arch} model; its projections are {', '.join(names)}")


def attach(model: nnx.Module, adapters: Adapters, *, key: jax.Array,
           replicated: bool = False) -> nnx.Module:
    """Give every projection `adapters.targets` names an adapter (A random, B zero); returns the
    model. Its arrays are placed as the model's are when this runs inside the function
    `minigpt.sharding.create_sharded` builds."""
    check_targets(model, adapters.targets, type(model).__name__)
    for i, (path, dense) in enumerate(projections(model)):
        if path[-1] in adapters.targets:
            salt = zlib.crc32(".".join(path).encode()) & 0x7FFFFFFF
            dense.lora = Adapter(dense, adapters, salt, key=jax.random.fold_in(key, i),
                                 replicated=replicated)
    return model


def adapted(model: nnx.Module) -> list[tuple[tuple[str, ...], Dense]]:
    """The projections that carry an adapter, with their paths."""
    return [(path, dense) for path, dense in projections(model) if dense.lora is not None]


def trainable(model: nnx.Module):
    """What a train step differentiates and the optimizer updates: the adapters where the model
    carries any (everything else frozen), else every parameter."""
    return nnx.LoRAParam if adapted(model) else nnx.Param


def detach(model: nnx.Module) -> list[tuple[Dense, Adapter]]:
    """Take the adapters off (the model is its base again); `reattach` puts them back."""
    held = [(dense, dense.lora) for _, dense in adapted(model)]
    for dense, _ in held:
        dense.lora = None
    return held


def reattach(held: list[tuple[Dense, Adapter]]) -> None:
    for dense, adapter in held:
        dense.lora = adapter


def merge(model: nnx.Module) -> None:
    """Fold every adapter into its kernel (W + A B * alpha / r, in float32, each kernel keeping
    its sharding) and take the adapters off: the model computes the same without them."""
    for _, dense in adapted(model):
        kernel, adapter = dense.kernel.get_value(), dense.lora

        def fold(w, a, b, adapter=adapter):
            return (w.astype(jnp.float32) + adapter.delta(a, b)).astype(w.dtype)

        dense.kernel.set_value(jax.jit(fold, out_shardings=kernel.sharding)(
            kernel, adapter.a.get_value(), adapter.b.get_value()))
        dense.lora = None


def has_dropout(model: nnx.Module) -> bool:
    """Whether some adapter of the model drops inputs while training (it needs dropout keys)."""
    return any(dense.lora.rate > 0 for _, dense in adapted(model))
