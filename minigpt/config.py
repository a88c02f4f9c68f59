"""Configuration: frozen dataclasses for the model (what `config.json` in a run directory stores)
and the training run, each checking its invariants when built, so a bad value fails at the command
line rather than inside a compiled step. `--set key=value` (minigpt.train.cli) parses against the
field's declared type; `check_value` is the one type check behind every way a value arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from minigpt.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value a user gave is invalid; the message says which and why."""


def check_value(where: str, annotation: Any, value: Any) -> None:
    """Refuse a value that is not of a field's declared type (`where` names the field, e.g.
    "model.num_layers" or "recipe stories-cpu: model.num_layers"): ints are ints (not bools),
    floats are finite numbers, strings are strings, tuples hold their declared items. The one
    type check behind every way a value arrives (flags, --set, recipes, config.json, imported
    configs)."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        ok = isinstance(value, tuple) and all(
            isinstance(v, item) and not isinstance(v, bool) for v in value)
        kind = "a list of strings" if item is str else "a list of integers"
    elif annotation is bool:
        ok, kind = isinstance(value, bool), "true or false"
    elif annotation is int:
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
            value)
        kind = "a finite number"
    elif isinstance(annotation, types.UnionType):  # bool | str: either; the field says which
        ok = isinstance(value, annotation) and not (isinstance(value, float))
        kind = " or ".join(a.__name__ for a in typing.get_args(annotation))
    else:
        ok, kind = isinstance(value, annotation), annotation.__name__
    if not ok:
        raise ConfigError(f"{where} must be {kind}, got {value!r}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A config class's fields and their declared types (annotations resolved)."""
    return typing.get_type_hints(cls)


def _check_fields(config: Any, scope: str) -> None:
    """Check every field's type; a list where a tuple is declared (as JSON, TOML and Python
    callers give sequences) is taken as that tuple."""
    hints = field_types(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
            value = tuple(value)
            object.__setattr__(config, f.name, value)
        check_value(f"{scope}.{f.name}", hints[f.name], value)


DTYPES = ("auto", "float32", "bfloat16")  # auto: see minigpt.models.execution
KERNELS = ("auto", "reference", "cpu", "cudnn", "splash")  # see minigpt.models.kernels
REMAT_POLICIES = ("auto", "none", "minimal", "full")  # see minigpt.models.execution
ROPE_SCALINGS = ("", "llama3", "linear")  # see minigpt.models.layers.rope_frequencies
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # see minigpt.pipeline.schedules
CONTEXT_STRATEGIES = ("ring", "all_gather")  # see minigpt.parallel.ring
OPTIMIZERS = ("adamw", "muon")  # see minigpt.optim.optimizer
# The projections LoRA adapts by default: attention's and the feed-forward's (minigpt.models.lora).
LORA_TARGETS = ("query", "key", "value", "out", "gate", "up", "down")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "minigpt"
    vocab_size: int = 50257
    context_len: int = 256
    embed_dim: int = 256
    num_heads: int = 8
    num_kv_heads: int = 0  # 0: as many as num_heads (plain multi-head attention)
    mlp_dim: int = 256
    num_layers: int = 8
    dropout: float = 0.1
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Embedding and output tables are padded to a multiple of this so they shard evenly over
    # any power-of-two mesh axis; padded entries are masked out of every softmax.
    vocab_multiple: int = 128
    dtype: str = "auto"  # compute (auto: bf16 on accelerators); parameters stay float32
    # What the backward pass recomputes instead of keeping (minigpt.models.execution): "none",
    # "minimal" (keeps the matmuls' outputs, recomputes the rest), "full" (keeps each layer's
    # input alone), or "auto": none unless the planner finds the step does not fit the device
    # without it. Runs from before the policies recorded true ("full") or false ("none").
    remat: bool | str = "auto"
    # How the stacked layers run: lax.scan (one block in the compiled program, fast to compile)
    # or an unrolled loop; "auto": scanned on a CPU, unrolled on GPUs and TPUs, where it steps
    # faster (minigpt.models.execution says on what figures). Parameters and checkpoints are the
    # same either way.
    scan_layers: bool | str = "auto"
    # Which implementation of the backend-tuned operations to run (minigpt.models.kernels): "auto"
    # picks the CPU-tuned ones on a CPU, fused attention elsewhere. All compute the same.
    kernels: str = "auto"
    # Run the blocks' matmuls and the output head as FP8 products (minigpt.models.fp8: e4m3
    # operands, e5m2 gradients, per-tensor scales from each tensor itself); parameters,
    # optimizer state and checkpoints are unchanged, so a run may resume or generate without it.
    fp8: bool = False
    # The tokenizer the model reads and writes (minigpt.tokenizer): "gpt2", a vocabulary shipped
    # in minigpt/vocabularies (e.g. "tinystories-4k") or a .tiktoken file. Runs from before this
    # field existed used GPT-2's.
    tokenizer: str = "gpt2"
    # Attention head size; 0: embed_dim // num_heads. Imported checkpoints may set it (Llama's
    # `head_dim`), as attention then need not have the embedding's width.
    head_size: int = 0
    # Whether the output head is the token embedding table: Llama's where true (SmolLM2 ties
    # them), GPT-2's and Gemma's always; minigpt's never is (the tutorial's model has an output
    # layer of its own, with a bias), so true is refused there.
    tie_embeddings: bool = False
    # Sliding-window attention (minigpt.models.masks): a query sees the last `sliding_window`
    # keys of its document, its own included (0: all of them), on every layer, or with
    # `sliding_window_pattern` N on all but every N-th layer (Gemma 3: five local, one global).
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    # Gemma 3 (minigpt.models.gemma3): queries scaled by 1/sqrt(query_pre_attn_scalar) (0: the
    # head size), and the local layers' rotary base (0: rope_theta, the global layers').
    query_pre_attn_scalar: float = 0.0
    local_rope_theta: float = 0.0
    # Llama only: RMSNorm over each query and key head (a learned scale per head feature,
    # shared by the heads) before the rotary embedding, as Qwen3 does; Hugging Face calls
    # such a model Qwen3ForCausalLM. Runs from before this field existed have none.
    qk_norm: bool = False
    # Llama only: biases on the query, key and value projections (Qwen2), and on the output
    # projection too (Llama's `attention_bias`). Runs from before these fields have none.
    qkv_bias: bool = False
    out_bias: bool = False
    # Rotary frequencies scaled for long contexts as Llama 3.1+ ("llama3": low frequencies
    # divided by rope_factor, high ones kept, a smooth blend between, by rope_low_freq and
    # rope_high_freq against rope_original_context) or by one factor ("linear"); "": none.
    rope_scaling: str = ""
    rope_factor: float = 1.0
    rope_low_freq: float = 1.0
    rope_high_freq: float = 4.0
    rope_original_context: int = 0
    # Llama only, a mixture of experts (minigpt.models.moe); 0 experts: a dense model. Each
    # token goes to `experts_per_token` of `num_experts` SwiGLU experts of width
    # `expert_mlp_dim` (0: mlp_dim), picked by a softmax router, their weights renormalised to
    # sum to 1 (`norm_topk_prob`: Mixtral, Qwen3-MoE) or not (Qwen2-MoE, OLMoE); a shared
    # expert of width `shared_expert_mlp_dim` (0: none), gated as Qwen2-MoE's, sees every
    # token. Hugging Face's `decoder_sparse_step` and `mlp_only_layers` say which layers are
    # sparse; the block stack holds one kind of layer, so all of them must be.
    num_experts: int = 0
    experts_per_token: int = 2
    norm_topk_prob: bool = True
    expert_mlp_dim: int = 0
    shared_expert_mlp_dim: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Assignments each expert takes per sequence, as a multiple of an even share (T k / E);
    # those over it are dropped. 0: dropless, every token reaches its experts.
    moe_capacity_factor: float = 0.0
    # The router's penalties in the training loss: the load-balancing loss of Switch and
    # Mixtral (E * sum_e f_e P_e) and ST-MoE's z-loss (the squared log-sum-exp of its logits).
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self, "model")
        positive = ("vocab_size", "context_len", "embed_dim", "num_heads", "mlp_dim",
                    "num_layers", "vocab_multiple")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.sliding_window < 0 or self.sliding_window_pattern < 0:
            raise ConfigError(f"model.sliding_window and model.sliding_window_pattern must be >= "
                              f"0 (0: none), got {self.sliding_window} and "
                              f"{self.sliding_window_pattern}")
        if self.sliding_window_pattern and not self.sliding_window:
            raise ConfigError("model.sliding_window_pattern says which layers are local: it "
                              "needs model.sliding_window, the local layers' window")
        if self.head_size < 0:
            raise ConfigError(f"model.head_size must be positive (or 0), got {self.head_size}")
        if not self.head_size and self.embed_dim % self.num_heads:
            raise ConfigError(
                f"model.embed_dim ({self.embed_dim}) must be divisible by "
                f"model.num_heads ({self.num_heads})")
        if self.num_kv_heads < 0 or (self.num_kv_heads and self.num_heads % self.num_kv_heads):
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError(f"model.norm_eps and model.rope_theta must be positive, got "
                              f"{self.norm_eps} and {self.rope_theta}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.remat not in (True, False, *REMAT_POLICIES):
            raise ConfigError(f"model.remat must be one of {', '.join(REMAT_POLICIES)} (true and "
                              f"false, from older runs, mean full and none), got {self.remat!r}")
        if self.scan_layers not in (True, False, "auto"):
            raise ConfigError(f"model.scan_layers must be true, false or auto, got "
                              f"{self.scan_layers!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"model.rope_scaling must be one of {ROPE_SCALINGS} (\"\": none), "
                              f"got {self.rope_scaling!r}")
        if self.rope_scaling and (self.rope_factor <= 0 or self.rope_low_freq <= 0
                                  or self.rope_high_freq <= self.rope_low_freq):
            raise ConfigError("model.rope_factor and model.rope_low_freq must be positive and "
                              "model.rope_high_freq above model.rope_low_freq")
        if self.rope_scaling == "llama3" and self.rope_original_context <= 0:
            raise ConfigError("model.rope_scaling llama3 needs model.rope_original_context "
                              "(the context the model was trained with before scaling)")
        if self.kernels not in KERNELS:
            raise ConfigError(f"model.kernels must be one of {KERNELS}, got {self.kernels!r}")
        self._check_family()

    def _check_family(self) -> None:
        """The fields only some families read, refused for the others (`FAMILIES`, which
        minigpt.models fills), then the family's own checks."""
        family = FAMILIES.get(self.arch)
        if family is None:
            return  # an architecture no family registered: build_model names the known ones
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        owned = {name for other in FAMILIES.values() for name in other.options}
        changed = [name for name in sorted(owned - family.options)
                   if getattr(self, name) != defaults[name]]
        if changed:
            owners = sorted({other.name for other in FAMILIES.values()
                             if set(changed) & other.options})
            names = ", ".join(f"model.{name}" for name in changed)
            what = (f"{names}: a mixture of experts is" if set(changed) <= set(MOE_FIELDS) else
                    f"{names} {'is' if len(changed) == 1 else 'are'}")
            raise ConfigError(f"{what} a {' or '.join(owners)} option; the {self.arch} "
                              f"architecture has none")
        if family.check is not None:
            family.check(self)

    @property
    def remat_policy(self) -> str:
        """`remat` as a policy name: older runs' true and false are "full" and "none"."""
        return {True: "full", False: "none"}.get(self.remat, self.remat)

    @property
    def expert_dim(self) -> int:
        """The hidden width of each expert."""
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def head_dim(self) -> int:
        return self.head_size or self.embed_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m


# Each architecture family's rules, by `arch`, registered by `minigpt.models` when it is
# imported (each family's own folder says them, `minigpt.models.family.Family`): `options`, the
# config fields only some families read, refused for the others so that no setting is
# silently ignored, and `check(cfg)`, the family's own checks.
FAMILIES: dict[str, Any] = {}

# Fields that say how a model runs, not what it is: a run may resume with other values.
EXECUTION_FIELDS = ("dtype", "remat", "scan_layers", "kernels", "fp8")
# The mixture-of-experts fields: a llama option, inert (and refused) without experts.
MOE_FIELDS = ("num_experts", "experts_per_token", "norm_topk_prob", "expert_mlp_dim",
              "shared_expert_mlp_dim", "decoder_sparse_step", "mlp_only_layers",
              "moe_capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "fsdp"
    model: str = "minigpt"
    data: tuple[str, ...] = ("tinystories",)
    data_root: str = "data"
    data_truncate: bool = False  # data.truncate: cut chats longer than a window (data.chats)
    out: str = "runs/default"
    steps: int = 5000
    batch_size: int = 64  # global batch, in sequences
    seq_len: int = 0  # 0: the model's context length
    microbatches: int = 1  # gradient accumulation inside the compiled step
    # Under a pipeline preset, the pieces each (accumulation) batch goes through the stages in
    # (0: two per stage), the schedule they follow ("gpipe" or "1f1b": same numbers, 1f1b keeps
    # fewer activations; "": 1f1b, or gpipe when circular) and the chunks of layers each stage
    # holds (R > 1: the circular schedule, which runs as GPipe).
    pipeline_microbatches: int = 0
    pipeline_schedule: str = ""
    pipeline_repeats: int = 1
    # Under a preset that splits the sequence (`seq = "context"`), how attention reaches the
    # keys and values of other devices: "ring" (blocks travel round the devices, memory O(T/N))
    # or "all_gather" (each device gathers them all, O(T)). Same numbers either way.
    context_strategy: str = "ring"
    # Keep the documents packed into each window apart (minigpt.data.documents). Runs from
    # before this field trained without: their config.json reads as false.
    document_mask: bool = True
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    # Linear warm-up steps; -1: a tenth of the run, at most 100 (`minigpt.runs.resolved`), so
    # short runs reach their peak rate too.
    warmup_steps: int = -1
    decay_steps: int = 0  # step at which the cosine reaches its floor; 0: at `steps`
    # Where the cosine starts (-1: where the warm-up ends; later holds the peak until then, a
    # warm-up-stable-decay schedule) and the rate it starts from (0: the peak). A resumed run
    # whose step count changed records here the decay it continues with (see docs/training.md).
    decay_start: int = -1
    decay_start_lr: float = 0.0
    # The last part of the run the rate decays over, as a fraction of it (0: all of it after
    # the warm-up): 0.3 holds the peak until 70% of the steps, warm-up-stable-decay, and keeps
    # that share when a time budget refits the step count.
    decay_fraction: float = 0.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # "adamw", or "muon": Muon (orthogonalised momentum) for the blocks' weight matrices at
    # peak rate muon_lr, AdamW at lr for embeddings, the head, biases and norm scales.
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    seed: int = 0
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int = 8
    save_every: int = 500
    keep_checkpoints: int = 3
    profile_steps: str = ""  # "a:b" writes a profiler trace of steps a..b-1
    # Seconds of wall-clock time to train for (compilation included); 0: train `steps` steps.
    # The trainer measures its step time, turns the budget into a step count once (recorded in
    # config.json) and fits the learning-rate schedule to it, so the cosine ends with the time.
    time_budget: float = 0.0
    recipe: str = ""  # the recipe (recipes/*.toml) the run started from, for the record
    # A run directory whose latest weights this run starts from (a fresh optimizer, step 0):
    # one trained here or imported with `python -m minigpt.hub import`.
    init_from: str = ""
    # Low-rank adapters (LoRA, minigpt.models.lora): rank R > 0 trains rank-R adapters on the
    # projections `lora_targets` names (attribute names: query, key, value, out, gate, up, down,
    # output) and freezes every other weight; their update is scaled by lora_alpha / R, their
    # inputs dropped at rate lora_dropout while training. 0: no adapters, every weight trains.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        _check_fields(self, "train")
        positive = ("steps", "batch_size", "microbatches", "log_every", "eval_every",
                    "eval_batches", "save_every", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by "
                f"train.microbatches ({self.microbatches})")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < -1:
            raise ConfigError("train.lr must be > 0, min_lr_ratio in [0, 1], warmup_steps >= 0 "
                              "(or -1: a tenth of the run, at most 100)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.weight_decay >= 0
                and self.grad_clip > 0):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1), "
                              "train.weight_decay >= 0 and train.grad_clip > 0")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"train.seed must be in [0, 2^32), got {self.seed}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown train.optimizer {self.optimizer!r}: choose one of "
                              f"{', '.join(OPTIMIZERS)}")
        if self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1:
            raise ConfigError("train.muon_lr must be > 0 and train.muon_momentum in [0, 1)")
        if self.time_budget < 0:
            raise ConfigError(f"train.time_budget must be >= 0 seconds, got {self.time_budget}")
        if self.pipeline_microbatches < 0:
            raise ConfigError(f"train.pipeline_microbatches must be >= 0 (0: two per stage), "
                              f"got {self.pipeline_microbatches}")
        if self.pipeline_schedule and self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"unknown train.pipeline_schedule {self.pipeline_schedule!r}: "
                              f"choose one of {', '.join(PIPELINE_SCHEDULES)}")
        if self.context_strategy not in CONTEXT_STRATEGIES:
            raise ConfigError(f"unknown train.context_strategy {self.context_strategy!r}: "
                              f"choose one of {', '.join(CONTEXT_STRATEGIES)}")
        if self.pipeline_repeats < 1:
            raise ConfigError(f"train.pipeline_repeats must be >= 1, got "
                              f"{self.pipeline_repeats}")
        if self.decay_steps < 0:
            raise ConfigError(f"train.decay_steps must be >= 0, got {self.decay_steps}")
        if not 0 <= self.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction must be in [0, 1] (0: decay all the way "
                              f"from the warm-up), got {self.decay_fraction}")
        if self.decay_start < -1 or self.decay_start_lr < 0:
            raise ConfigError("train.decay_start must be >= 0 (or -1: where the warm-up ends) "
                              "and train.decay_start_lr >= 0 (0: the peak rate)")
        if self.seq_len < 0:
            raise ConfigError(f"train.seq_len must be >= 0, got {self.seq_len}")
        if self.profile_steps:
            parse_step_range(self.profile_steps)
        if self.lora_rank < 0 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"train.lora_rank must be >= 0 (0: no adapters), train.lora_alpha "
                              f"> 0 and train.lora_dropout in [0, 1); got {self.lora_rank}, "
                              f"{self.lora_alpha} and {self.lora_dropout}")
        if self.lora_rank and not self.lora_targets:
            raise ConfigError("train.lora_targets is empty: name the projections to adapt "
                              f"(default {','.join(LORA_TARGETS)})")


def parse_step_range(text: str) -> tuple[int, int]:
    """Parse "a:b" into (a, b) with 0 <= a < b."""
    try:
        a, b = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(f"expected a step range 'a:b', got {text!r}") from None
    if not 0 <= a < b:
        raise ConfigError(f"step range {text!r} must satisfy 0 <= a < b")
    return a, b
