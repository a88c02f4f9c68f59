"""What a run learns from (`train.objective`): its data, its step and its held-out figures.

The trainer asks its run's objective for these and nothing else, so each objective is told
here whole:

- `Imitation` ("lm"): the next token of text, or of chats' replies (`minigpt.data.chats`).
- `Reinforcement` ("grpo", `minigpt.train.grpo`): completions drawn on the decoding engine
  and scored by reward functions.
- `Preference` ("dpo"): pairs of replies (`minigpt.data.preferences`) against a frozen
  reference (`minigpt.optim.preference`). The reference's log-probabilities of every pair are
  computed before the first step, from the run's own starting weights (with LoRA the base, the
  adapters starting at zero) or from `--reference RUN`, and kept in `<run>/reference_logps.npz`,
  which a resumed run reads again: training holds one copy of the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import minigpt.optim.preference as preference
import minigpt.optim.steps as steps
import minigpt.train.batches as batches
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.data import prepare_in_job
from minigpt.data.preferences import load_rows
from minigpt.data.token_files import DataError
from minigpt.files import replacing

REFERENCE_FILE = "reference_logps.npz"


def for_run(train_cfg: TrainConfig):
    if train_cfg.objective == "grpo":
        from minigpt.train.grpo import Reinforcement

        return Reinforcement(train_cfg)
    return Preference() if train_cfg.objective == "dpo" else Imitation()


def check(model_cfg: ModelConfig, train_cfg: TrainConfig, layout, seq_len: int, *,
          resume: bool) -> None:
    """Refuse, before anything is written, what an objective cannot train."""
    if train_cfg.objective == "lm":
        if train_cfg.reference:
            raise ConfigError("--reference is the reference of --objective dpo; drop it")
        return
    name = train_cfg.objective
    if not (train_cfg.init_from or resume):
        raise ConfigError(f"--objective {name} tunes a trained model: give --init-from RUN (a "
                          f"run trained here or imported with python -m minigpt.hub)")
    import jax

    if jax.process_count() > 1:
        raise ConfigError(f"--objective {name} runs in one process for now (its reference "
                          f"and rollouts read whole batches): run it without --coordinator or "
                          f"--distributed, on as many devices as one process has")
    if name == "grpo":
        from minigpt.train.rewards import load

        load(train_cfg.rewards, train_cfg.reward_weights)  # a bad file is refused now
        if train_cfg.max_completion_length >= seq_len:
            raise ConfigError(f"train.max_completion_length {train_cfg.max_completion_length} "
                              f"leaves no room for a prompt in train.seq_len {seq_len}")
    if train_cfg.reference:
        from minigpt.runs import RunDir

        if not RunDir(train_cfg.reference).config_file.is_file():
            raise ConfigError(f"--reference {train_cfg.reference} is not a run directory (one "
                              f"trained here, or made by python -m minigpt.hub import)")
        rows = RunDir(train_cfg.reference).read().model.vocab_size
        if rows != model_cfg.vocab_size:
            raise ConfigError(f"--reference {train_cfg.reference} has a vocabulary of {rows:,}, "
                              f"the model {model_cfg.vocab_size:,}: the reference must read "
                              f"the same tokens")
    if layout.stages > 1 or layout.ways("seq") > 1:
        raise ConfigError(f"--objective {name} scores each reply's tokens over the whole "
                          f"sequence at once, which preset {layout.name!r} splits into "
                          f"{'pipeline stages' if layout.stages > 1 else 'sequence shards'}: "
                          f"choose a preset without them (dp, fsdp, tp, dp_tp, fsdp_tp)")


class Imitation:
    """Next-token prediction: the model's own loss on text or on chats' replies."""

    def prepare(self, model_cfg: ModelConfig, cfg: TrainConfig, seq_len: int,
                template: str | None) -> Path:
        return prepare_in_job(cfg.data, cfg.data_root, model_cfg.tokenizer, seq_len=seq_len,
                              truncate=cfg.data_truncate, template=template)

    def batches(self, data_dir: Path, cfg: TrainConfig, seq_len: int, layout, documents):
        return batches.split_batches(data_dir, "train", cfg, seq_len, layout,
                                     documents=documents)

    def begin(self, run, *, resume: bool, say) -> None:
        pass

    def put(self, layout):
        return layout.put_batch

    def step(self, run, batch: dict[str, Any], rates) -> dict[str, Any]:
        return steps.train_step(run.model, run.optimizer, batch, run.rng, rates,
                                microbatches=run.train_cfg.microbatches)

    def evaluate(self, run) -> dict[str, float]:
        return batches.evaluate(run.model, run.tokenizer, run.data_dir, run.train_cfg,
                                run.settled.seq_len, run.layout, documents=run.documents)


class Preference(Imitation):
    """DPO: the sigmoid loss of TRL's `DPOTrainer` on pairs, against the reference."""

    def __init__(self):
        self.reference: dict[str, np.ndarray] = {}  # split -> [N, 2]

    def prepare(self, model_cfg: ModelConfig, cfg: TrainConfig, seq_len: int,
                template: str | None) -> Path:
        return prepare_in_job(cfg.data, cfg.data_root, model_cfg.tokenizer, seq_len=seq_len,
                              template=template, objective="dpo")

    def begin(self, run, *, resume: bool, say) -> None:
        """The reference's log-probabilities of every pair: read again on resume, else
        computed now (before the first update) and kept in the run directory."""
        path = run.dir.path / REFERENCE_FILE
        if resume:
            try:
                with np.load(path) as kept:
                    self.reference = {split: kept[split] for split in ("train", "val")}
                return
            except (OSError, KeyError, ValueError) as error:
                raise DataError(f"{path} cannot be read ({error}): the reference's "
                                f"log-probabilities of a DPO run are gone; start the run "
                                f"again (another --out)") from None
        rows = {split: load_rows(run.data_dir, split) for split in ("train", "val")}
        cfg = run.train_cfg
        if cfg.reference:
            from minigpt.runs import load_run

            ref = load_run(cfg.reference, str(run.layout.preset.path))
            model, layout = ref.model, ref.layout
        else:
            model, layout = run.model, run.layout
        with layout.active():
            self.reference = {split: preference.pair_logps(model, r, cfg.batch_size,
                                                           layout.put_batch)
                              for split, r in rows.items()}
        say(f"reference log-probabilities of {len(rows['train']['pair']):,} training and "
            f"{len(rows['val']['pair']):,} held-out pairs from "
            f"{cfg.reference or 'the starting weights'}, kept in {path}")
        if run.is_writer:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, **self.reference)

    def put(self, layout):
        def place(host: dict[str, np.ndarray]) -> dict[str, Any]:
            reference = self.reference["train"][host["pair"]]
            return layout.put_batch({"ids": host["ids"], "completion": host["completion"],
                                     "reference": reference})
        return place

    def step(self, run, batch: dict[str, Any], rates) -> dict[str, Any]:
        cfg = run.train_cfg
        return preference.dpo_step(run.model, run.optimizer, batch, run.rng, rates,
                                   beta=cfg.dpo_beta, microbatches=cfg.microbatches)

    def evaluate(self, run) -> dict[str, float]:
        """The held-out pairs (at most `eval_batches` batches of them) against the reference."""
        cfg = run.train_cfg
        rows = load_rows(run.data_dir, "val")
        count = min(len(rows["pair"]), cfg.eval_batches * cfg.batch_size)
        rows = {k: v[:count] for k, v in rows.items()}
        logps = preference.pair_logps(run.model, rows, cfg.batch_size, run.layout.put_batch)
        return preference.evaluate(logps, self.reference["val"][:count], cfg.dpo_beta)
