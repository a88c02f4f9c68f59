"""The memory model: bytes one device holds at the peak of a train step, part by part.

Parameters, gradients and optimizer state are exact: the abstract model and optimizer (shapes
only) laid out by the preset, as `python -m minigpt.sharding` counts them. The rest is what the
step holds beside them, followed through the step's phases as XLA schedules them (as its buffer
assignment and live ranges show them: `--xla_dump_to`), the largest phase being the peak:

- the forward pass's last layer: every layer's residuals (`minigpt.plan.activations`), the
  blocks' gradient accumulators and the embedding's gradient buffer (zeros XLA allocates before
  the forward), and the layer's own temporaries (dropout's random bits among them);
- the loss: the fused loss's per-device accumulator of the head's gradient, the product added
  into it and a chunk of logits (three chunks where the head is frozen, or where the rules split
  its vocabulary over some of the rows' devices and XLA keeps each device's rows beside the
  others'), the head's weights gathered where the rules split their embedding axis over the
  rows' devices; or, with the plain loss of the accelerator kernels, the whole logits;
- the backward pass through the stack: the residuals still held, one layer's backward (its
  residuals recomputed under remat, its weights gathered and its gradient before the
  reduce-scatter under FSDP);
- the update: every gradient, and the optimizer's temporaries for the largest weight.

A pipeline stage instead holds the schedule's buffers (its stash of stage inputs and its
inboxes, `minigpt.pipeline.schedules`), its float32 gradients, the gradient trees its ticks
return for the embedding and the head, and at its peak the head's share of the positions, the
embedding's backward or one chunk of layers recomputed for its backward (`pipeline_phases`).
A mixture of experts adds the copies of its experts' weights its dispatch keeps, and the rows
tokens travelling to their experts pass through (`_expert_copies`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from minigpt import pipeline, sharding
from minigpt.config import ModelConfig, TrainConfig
from minigpt.models import loss as fused
from minigpt.plan.activations import BlockTracer, Split
from minigpt.plan.layout import Share, local_shape
from minigpt.runs import resolved

F32 = 4
# The optimizer updates one weight at a time; its temporaries (the new moments and the update)
# are a few copies of the largest (three, measured for AdamW).
UPDATE_COPIES = 3


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device: the four parts of the contract, the largest single temporary and the
    total (parameters + gradients + optimizer + activations); `parts` says what the
    activations at the peak are made of, and `phase` which phase of the step peaks."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    phase: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclasses.dataclass(frozen=True)
class Subject:
    """What is planned, built once for every preset: the configs and the abstract state."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    params: nnx.State  # every parameter (a frozen base and its adapters)
    trainable: nnx.State  # what takes gradients
    optimizer: nnx.State
    state: nnx.State  # (model, optimizer), as the trainer checks it
    kernels: str  # the kernel set the step runs ("cpu" or "reference")
    tracer: BlockTracer  # the model's block, traced at each split asked for

    @property
    def seq_len(self) -> int:
        return resolved.seq_len(self.model_cfg, self.train_cfg)


@dataclasses.dataclass(frozen=True)
class Held:
    """The bytes of named groups of arrays one device holds, under a layout."""

    rows: list[dict]  # sharding.describe of the parameters
    trained: set[str]  # names of the parameters that take gradients

    def bytes(self, *, blocks: bool | None = None, trained: bool = False) -> int:
        return sum(r["bytes_per_device"] for r in self.rows
                   if (blocks is None or (r["axes"][:1] == ("layers",)) == blocks)
                   and (not trained or r["name"] in self.trained))

    def named(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)


def estimate_memory(subject: Subject, layout: Share) -> Memory:
    """The bytes one device holds at the peak of the step under `layout`."""
    held = Held(sharding.describe(layout.layout, subject.params),
                {r["name"] for r in sharding.describe(layout.layout, subject.trainable)})
    params = held.bytes()
    grads = held.bytes(trained=True)
    opt = sum(r["bytes_per_device"] for r in sharding.describe(layout.layout,
                                                                subject.optimizer))
    phases = (pipeline_phases if layout.stages > 1 else stack_phases)(subject, layout, held)
    largest = max([r["bytes_per_device"] for r in held.rows if r["name"] in held.trained]
                  or [0])
    phases["update"] = {"gradients": grads, "optimizer's temporaries": UPDATE_COPIES * largest,
                        "largest update": largest}
    # Parts named "largest ..." name the largest single buffer among the others: not added.
    name = max(phases, key=lambda k: sum(v for p, v in phases[k].items()
                                         if not p.startswith("largest ")))
    parts = {k: v for k, v in phases[name].items() if v}
    temporary = max([v for k, v in parts.items() if k.startswith("largest")] or [0])
    beside = sum(v for k, v in parts.items() if not k.startswith("largest "))
    return Memory(parameters=params, gradients=grads, optimizer=opt,
                  activations=max(beside - grads, 0), temporary=temporary, phase=name,
                  parts=parts)


def act_bytes(cfg: ModelConfig) -> int:
    return jnp.dtype(cfg.dtype).itemsize


def layer_bytes(subject: Subject, layout: Share, remat: bool) -> tuple[int, int, int]:
    """(kept per layer through the step, recomputed one layer at a time, largest residual),
    bytes per device: the traced residuals, or under remat the layer's input."""
    trace = subject.tracer.layer(Split(layout.heads, layout.kv_heads, layout.mlp),
                                 layout.positions, subject.seq_len)
    b = layout.rows
    saved = trace.saved * b + trace.fixed
    if subject.kernels == "cpu":  # XLA's CPU backend computes 16-bit floats in float32, and
        saved += 2 * trace.narrow * b  # keeps float32 copies of such residuals for the backward
    if remat:
        return trace.input * b, saved, trace.largest * b
    return saved, 0, trace.largest * b


def stack_phases(subject: Subject, layout: Share, held: Held) -> dict[str, dict[str, int]]:
    """The loss and the backward pass without a pipeline (see the module docstring)."""
    cfg = subject.model_cfg
    kept, recomputed, largest = layer_bytes(subject, layout, cfg.remat_policy == "full")
    x = layout.rows * layout.positions * cfg.embed_dim * act_bytes(cfg)
    # A scan keeps each residual of every layer in one stacked buffer [L, ...].
    stacked = cfg.num_layers if cfg.scan_layers else 1
    early = {"residuals": cfg.num_layers * kept, "expert weights": _expert_copies(layout, held,
                                                                                cfg),
             "gradients": held.bytes(blocks=True, trained=True) + _table_gradient(held),
             "accumulated gradients": held.bytes(trained=True)
             if subject.train_cfg.microbatches > 1 else 0,
             "largest residual": stacked * (largest if cfg.remat_policy != "full" else kept)}
    loss = loss_bytes(subject, layout, held)
    gathered = _gathered_layer(subject, layout, held)
    # The last layer's forward: its temporaries beside every residual, the dropout masks'
    # random bits among them (two dropouts, 32 bits per element, drawn a pair at a time).
    bits = 4 * layout.rows * layout.positions * cfg.embed_dim * 4 if cfg.dropout else 0
    accumulator = loss.get("head gradient accumulator", 0)
    return {
        "forward": {**early, "head gradient accumulator": accumulator // 2,
                    "one layer's forward": 3 * x + bits},
        "loss": {**early, **loss, "features": 2 * x},
        "backward": {**early, "head gradient": accumulator // 2,
                     "one layer's backward": recomputed + 3 * x + 2 * gathered,
                     "largest gathered layer": gathered},
    }


def _expert_copies(layout: Share, held: Held, cfg: ModelConfig) -> int:
    """A mixture of experts' weights as its dispatch region holds them beyond the residuals
    traced: whole on every device (gathered where FSDP splits them) or, where tokens travel to
    their experts, this device's experts and the whole set its fallback gathers; an unrolled
    stack (no scan) slices and copies every layer's at the start, twice."""
    if not cfg.num_experts:
        return 0
    experts = [r for r in held.rows if "expert" in r["axes"]]
    whole = sum(r["bytes"] for r in experts)
    local = sum(r["bytes_per_device"] for r in experts)
    travel = set(layout.preset.mesh_axes_of("expert")) & _row_axes(layout) and \
        layout.ways("expert") > 1
    gathered = whole if (travel or local < whole) else 0
    copies = 0 if cfg.scan_layers else 2 * (local if travel else whole)
    # Travelling tokens pass through buffers of twice an even share of the assignments
    # (`minigpt.parallel.experts.SLACK`), through this device's experts, while the fallback
    # that gathers the weights keeps its own: both branches' residuals are kept.
    assignments = layout.rows * layout.positions * cfg.experts_per_token
    rows = 2 * assignments * (cfg.embed_dim + 3 * layout.mlp) * act_bytes(cfg) if travel else 0
    return gathered + copies + cfg.num_layers * rows


def _table_gradient(held: Held) -> int:
    """The token table's gradient buffer: formed where the table is, zeros from the start."""
    row = held.named("tokens.table")
    return row["bytes_per_device"] if row and row["name"] in held.trained else 0


def _head(held: Held) -> dict | None:
    """The output head's weights [V, D] (the token table where the head is tied to it)."""
    return held.named("output.kernel") or held.named("tokens.table")


def loss_bytes(subject: Subject, layout: Share, held: Held, *,
               positions: int | None = None) -> dict[str, int]:
    """The loss's buffers at its peak, per device, for `positions` of each sequence (default:
    all the device holds): the fused loss's chunk of logits and per-device accumulator of the
    head's gradient (with the product added into it), the head's weights where they are
    gathered, or the plain loss's whole logits."""
    cfg, train_cfg = subject.model_cfg, subject.train_cfg
    V = cfg.padded_vocab
    head = _head(held)
    trained = head is not None and head["name"] in held.trained
    accumulator = _head_bytes(subject, layout) if trained else 0
    gathered = _gathered_head(layout, head, accumulator)
    t = positions or layout.positions
    if subject.kernels != "cpu":
        logits = layout.rows * t * layout.vocab * F32
        return {"logits": 3 * logits, "head gradient accumulator": 2 * accumulator,
                "gathered head": gathered, "largest logits": logits}
    B = train_cfg.batch_size // train_cfg.microbatches // max(layout.pipeline.microbatches, 1)
    T = positions * layout.seq_ways if positions else subject.seq_len
    shards = layout.seq_ways if T % layout.seq_ways == 0 else 1
    c = _chunk_len(B * shards, T // shards, V)
    logits = (B // layout.batch_ways) * c * layout.vocab * F32
    # Where the rules split the head's vocabulary over some of the rows' devices and the rows
    # over others too (fsdp_cp, fsdp_ep), XLA keeps each device's logits beside those of the
    # rows' other devices, and three such chunks (the logits, their exponentials and the
    # gradient) rather than a product beside the accumulator.
    beside = _rows_beside(layout, head)
    if V <= fused.SMALL_VOCAB and B * T * V <= fused.HOISTED_LOGITS:  # gradients kept whole
        whole = layout.rows * t * layout.vocab * F32 * beside
        return {"logit gradients": whole * (2 if beside > 1 else 1), "logits": logits,
                "head gradient accumulator": 2 * accumulator, "gathered head": gathered,
                "largest logits": whole}
    if beside > 1:
        logits *= beside
        return {"logits": 3 * logits, "head gradient accumulator": accumulator,
                "gathered head": gathered, "largest logits": logits}
    # A frozen head (adapters train alone): no gradient to accumulate, and the chunk's logits,
    # their exponentials and their gradient all live at once.
    return {"logits": logits if trained else 3 * logits,
            "head gradient accumulator": 2 * accumulator, "gathered head": gathered,
            "largest logits": logits}


def _rows_beside(layout: Share, head: dict | None) -> int:
    """Over how many devices each device's rows of the loss are kept beside the others': those
    of the rows' devices that do not split the head's vocabulary, where some do."""
    if head is None:
        return 1
    rows = _row_axes(layout)
    vocab = set(sharding.mesh_axes_in(head["spec"][0])) & rows
    if not vocab:
        return 1
    return math.prod(layout.mesh.shape[a] for a in rows - vocab)


def _chunk_len(batch: int, seq: int, vocab: int) -> int:
    """The fused loss's chunk of positions (`minigpt.models.loss`: the longest dividing the
    sequence with batch * chunk tokens at most the vocabulary's chunk size)."""
    most = fused.SMALL_VOCAB_CHUNK_TOKENS if vocab <= fused.SMALL_VOCAB else \
        fused.LOSS_CHUNK_TOKENS
    return max([c for c in range(1, seq + 1) if seq % c == 0 and batch * c <= most] or [1])


def _row_axes(layout: Share) -> set[str]:
    return set(layout.preset.mesh_axes_of("batch")) | set(layout.preset.mesh_axes_of("seq"))


def _head_bytes(subject: Subject, layout: Share) -> int:
    """The fused loss's accumulator of the head's gradient on one device: [V, D] split by
    what the rules leave to the vocabulary after the rows take the batch's and sequence's
    devices (float32)."""
    cfg = subject.model_cfg
    shape = (layout.batch_ways * layout.seq_ways, cfg.padded_vocab, cfg.embed_dim)
    _, v, d = local_shape(layout.layout, (("batch", "seq"), "vocab", "embed"), shape)
    return v * d * F32


def _gathered_head(layout: Share, head: dict | None, accumulator: int) -> int:
    """The head's weights gathered for the loss's products (two copies: the logits' and their
    gradient's), where the rules split their embedding axis over the rows' devices."""
    if head is None:
        return 0
    split = {a for a in sharding.mesh_axes_in(head["spec"][1])}
    return 2 * accumulator if split & _row_axes(layout) else 0


def _gathered_layer(subject: Subject, layout: Share, held: Held) -> int:
    """One layer's weights as its compute gathers them where the rules split them over the
    rows' devices (FSDP), bytes per device; 0 where nothing is gathered."""
    rows = _row_axes(layout)
    gathered = 0
    for r in held.rows:
        if r["axes"][:1] != ("layers",):
            continue
        spec = r["spec"]
        ways = math.prod(sharding.ways(layout.mesh, e) for e in spec)
        kept = math.prod(sharding.ways(layout.mesh, tuple(
            a for a in sharding.mesh_axes_in(e) if a not in rows)) for e in spec)
        layer = r["bytes"] // r["shape"][0]
        if kept < ways:
            gathered += layer // kept
    return gathered


def pipeline_phases(subject: Subject, layout: Share, held: Held) -> dict[str, dict[str, int]]:
    """A pipeline stage's ticks: the head's share of the positions, the embedding's backward
    and one chunk of layers recomputed for its backward, each beside the stage's buffers of
    stage inputs, its float32 gradients and the trees of gradients its ticks return for the
    parameters outside the stack."""
    cfg = subject.model_cfg
    S, settings = layout.stages, layout.pipeline
    plan = pipeline.table(settings, S)
    x = layout.rows * layout.positions * cfg.embed_dim * act_bytes(cfg)
    chunk = cfg.num_layers // (S * settings.repeats)
    kept, _, largest = layer_bytes(subject, layout, remat=False)
    rest = held.bytes(blocks=False, trained=True)
    base = {"stage buffers": (plan.stash_size + plan.inbox_size + plan.grad_inbox_size) * x,
            "gradients": held.bytes(blocks=True, trained=True) + rest,
            "accumulated gradients": held.bytes(trained=True)
            if subject.train_cfg.microbatches > 1 else 0}
    head = _pipeline_head(subject, layout, held)
    table = _table_gradient(held)
    return {
        "pipeline head": {**base, **head},
        "pipeline embedding": {**base, "returned gradients": rest, "embedding gradient": table,
                               "head gradient copy": max(rest - table, 0),
                               "largest gradient": table},
        "pipeline backward": {**base, "returned gradients": rest,
                              "one chunk's backward": chunk * kept + 3 * x,
                              "largest residual": largest},
    }


def _pipeline_head(subject: Subject, layout: Share, held: Held) -> dict[str, int]:
    """The head's share of the positions in a pipeline stage: the loss's chunk of logits, their
    exponentials and gradient at once, and where the rules split the vocabulary over the rows'
    devices the head's gradient accumulator and another chunk, where they split its embedding
    axis a gathered copy of its weights."""
    loss = loss_bytes(subject, layout, held, positions=layout.positions // layout.stages)
    logits = loss["largest logits"]
    head = _head(held)
    rows = _row_axes(layout)
    by_vocab = head is not None and set(sharding.mesh_axes_in(head["spec"][0])) & rows
    return {"logits": 3 * logits + (logits if by_vocab else 0),
            "head gradient accumulator": loss["head gradient accumulator"] // 2 if by_vocab
            else 0,
            "gathered head": loss["gathered head"] // 2, "largest logits": logits}
