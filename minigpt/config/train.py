"""The training run's configuration: `TrainConfig`, frozen, every value checked when built, and
`parse_step_range` for the "a:b" step ranges it takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minigpt.config.model import (
    CONTEXT_STRATEGIES,
    LORA_TARGETS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
)
from minigpt.config.values import ConfigError, check_fields

# What a run may learn from: the next token of text (or of chats' replies), or preferences.
OBJECTIVES = ("lm", "dpo", "grpo")
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo")
GRPO_SCALES = ("group", "batch", "none")


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
    # What the run learns from (docs/post_training.md): "lm", the next token of its text or
    # chats; "dpo", pairs of replies (prompt, chosen, rejected) against a frozen reference,
    # the --init-from run's weights or `reference` (another run's), with strength `dpo_beta`.
    objective: str = "lm"
    reference: str = ""
    dpo_beta: float = 0.1
    # GRPO ("grpo", docs/post_training.md), with TRL's defaults: `num_generations` completions
    # of each prompt (batch_size counts completions), at most `max_completion_length` tokens,
    # drawn at `temperature` (top_k 0, top_p 1, min_p 0: no filter) and scored by `rewards`
    # (FILE.py:FUNC, --reward) weighted by `reward_weights` (empty: 1 each), each call at most
    # `reward_timeout` seconds; advantages within a prompt's group scaled as `scale_rewards`
    # says; the ratio clipped at epsilon (epsilon_high above: 0, the same); a KL to the start
    # weights of weight `grpo_beta`; `num_iterations` steps on each batch of completions.
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    reward_timeout: float = 60.0
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    grpo_beta: float = 0.0
    num_iterations: int = 1

    def __post_init__(self) -> None:
        """Every value checked; long because each check is a statement of its own."""
        check_fields(self, "train")
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
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown train.objective {self.objective!r}: choose one of "
                              f"{', '.join(OBJECTIVES)}")
        if not (self.dpo_beta > 0 and math.isfinite(self.dpo_beta)):
            raise ConfigError(f"train.dpo_beta must be a positive number, got {self.dpo_beta}")
        self._check_grpo()

    def _check_grpo(self) -> None:
        if self.objective == "grpo" and self.batch_size % self.num_generations:
            raise ConfigError(f"train.batch_size {self.batch_size} counts completions: it must "
                              f"be a multiple of train.num_generations {self.num_generations}")
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.rewards and self.objective != "grpo":
            raise ConfigError(f"--reward (train.rewards) scores GRPO's completions: drop it, or "
                              f"give --objective grpo (this run's objective is "
                              f"{self.objective})")
        if self.objective == "grpo" and self.num_generations < 2:
            raise ConfigError("train.num_generations must be at least 2: advantages compare "
                              "a prompt's completions with each other")
        if not (self.temperature > 0 and self.top_k >= 0 and 0 < self.top_p <= 1
                and 0 <= self.min_p < 1 and self.reward_timeout > 0):
            raise ConfigError("train.temperature and train.reward_timeout must be > 0, top_k >= "
                              "0, top_p in (0, 1] and min_p in [0, 1)")
        if not (0 <= self.epsilon < 1 and self.epsilon_high >= 0 and self.grpo_beta >= 0):
            raise ConfigError("train.epsilon must be in [0, 1), train.epsilon_high and "
                              "train.grpo_beta >= 0")
        for name, allowed in (("loss_type", GRPO_LOSSES), ("scale_rewards", GRPO_SCALES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown train.{name} {getattr(self, name)!r}: choose one of "
                                  f"{', '.join(allowed)}")
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
