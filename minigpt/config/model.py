"""The model's configuration: `ModelConfig`, frozen, every value checked when built, and the
choices its fields take. What `config.json` in a run directory stores under "model".

The fields here are those every family reads, or several do (a shared capability: rotary scaling,
sliding windows, a mixture of experts); each family refuses the shared ones it does not read
(`Family.shared`). A setting only one family reads lives in that family's folder, in its
`FamilyOptions` subclass (`minigpt.models.gemma3.Gemma3Options`), held by `ModelConfig.options`
and kept in config.json under the family's name: `"model": {"arch": "gemma3", ..., "gemma3":
{"query_pre_attn_scalar": 256.0, ...}}`. Runs written before families kept their own settings
have them among the others, and load as they are (`minigpt.models.from_dict`); `--set
model.query_pre_attn_scalar=...` still means the family's field, as `--set
model.gemma3.query_pre_attn_scalar=...` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from minigpt.config.values import ConfigError, check_fields, field_types

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
class FamilyOptions:
    """The settings only one family reads: a family with any defines a frozen subclass of this
    in its folder (its fields with their defaults, `family` its name) and names it in its
    `Family` record. Each field's type is checked when built; `check` adds the family's own
    rules on its values."""

    family: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, f"model.{self.family}")
        self.check()

    def check(self) -> None:
        """The family's rules on its own values (ConfigError naming the field)."""


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
    # `sliding_window_pattern` N on all but every N-th layer (Gemma 3: five local, one global;
    # OLMo 3: three local, one global).
    sliding_window: int = 0
    sliding_window_pattern: int = 0
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
    # The settings only this model's family reads (its `FamilyOptions`; None: that family's
    # defaults, filled in when built). config.json keeps them under the family's name.
    options: FamilyOptions | None = None

    def __post_init__(self) -> None:
        check_fields(self, "model")
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
        if self.options is not None and self.options.family != self.arch:
            raise ConfigError(f"model.options holds {type(self.options).__name__}, the "
                              f"{self.options.family} family's settings, for a {self.arch} "
                              f"model")

    def as_dict(self) -> dict[str, Any]:
        """What config.json stores: the shared fields, and the family's under its name."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "options"}
        fields = json_ready(fields)
        if self.options is not None:
            fields[self.arch] = json_ready(dataclasses.asdict(self.options))
        return fields

    def flat(self) -> dict[str, Any]:
        """Every setting by name, the family's as `family.field`: what a resume compares."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "options"}
        if self.options is not None:
            fields.update({f"{self.arch}.{name}": value for name, value in
                           dataclasses.asdict(self.options).items()})
        return fields

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


def option_types(kind: type[FamilyOptions]) -> dict[str, Any]:
    """A family's settings and their declared types (its `family` name is not one)."""
    hints = field_types(kind)
    return {f.name: hints[f.name] for f in dataclasses.fields(kind)}


def json_ready(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields as JSON holds them: tuples as lists."""
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in fields.items()}

# Fields that say how a model runs, not what it is: a run may resume with other values.
EXECUTION_FIELDS = ("dtype", "remat", "scan_layers", "kernels", "fp8")
# The mixture-of-experts fields: a llama option, inert (and refused) without experts.
MOE_FIELDS = ("num_experts", "experts_per_token", "norm_topk_prob", "expert_mlp_dim",
              "shared_expert_mlp_dim", "decoder_sparse_step", "mlp_only_layers",
              "moe_capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")


