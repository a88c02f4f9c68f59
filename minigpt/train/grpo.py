"""GRPO as a run's objective: prompts in, completions drawn on the decoding engine from the
weights being trained, scored by the reward functions, and a step on their advantages.

Each step takes `batch_size / num_generations` prompts (`minigpt.data.prompts`) and draws
`num_generations` completions of each with `minigpt.decoding.decode_all` on the run's own
model, under the training layout (no second copy, no export between steps). Completion j of
step s draws with the key fold_in(fold_in(run key, s), j), so a resumed run draws what the
uninterrupted one drew. A completion ends at the tokenizer's end tokens (TRL's: its
`eos_token` and generation_config.json's), the end token counted in it, or after
`max_completion_length` tokens. The rewards (`minigpt.train.rewards`) see the text decoded
without special tokens, as TRL decodes it; the advantages and the loss are
`minigpt.optim.grpo`'s. With `num_iterations` k, each batch of completions serves k steps (the
loader gives each batch of prompts k times): the first step's policy log-probabilities are
kept as the ratio's denominator, and the batch is kept in `<run>/rollout.npz` so a run resumed
between them goes on with it.

The sampled completions of every logged step (`--log-every`) are written beside the metrics,
to `<run>/completions.jsonl`: step, prompt, completion, reward, each function's and the
advantage. Held out, each prompt gets one greedy completion, and the rewards' means are
reported (`eval_reward`, `eval_rewards/<name>/mean`).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import jax
import numpy as np

import minigpt.optim.grpo as grpo
import minigpt.train.rewards as rewards
from minigpt.config import ModelConfig, TrainConfig
from minigpt.data import prepare_in_job
from minigpt.data.loader import batch_iterator
from minigpt.data.preferences import end_token
from minigpt.data.prompts import load_columns, load_rows
from minigpt.data.token_files import DataError
from minigpt.decoding.offline import Settings, decode_all
from minigpt.decoding.sampler import key_data
from minigpt.files import replacing, write_text_atomic
from minigpt.train.metrics import read_metrics

ROLLOUT_FILE = "rollout.npz"
COMPLETIONS_FILE = "completions.jsonl"


class Reinforcement:
    """GRPO: TRL's `GRPOTrainer` rules on the decoding engine."""

    def __init__(self, cfg: TrainConfig):
        self.rewards = rewards.load(cfg.rewards, cfg.reward_weights)
        self.rollout: dict[str, Any] | None = None  # the batch of completions steps train on
        self.reported: dict[str, float] = {}  # what its drawing measured

    def prepare(self, model_cfg: ModelConfig, cfg: TrainConfig, seq_len: int,
                template: str | None) -> Path:
        return prepare_in_job(cfg.data, cfg.data_root, model_cfg.tokenizer, seq_len=seq_len,
                              template=template, objective="grpo",
                              max_completion=cfg.max_completion_length)

    def batches(self, data_dir: Path, cfg: TrainConfig, seq_len: int, layout, documents):
        return batch_iterator(data_dir, "train", seq_len=seq_len,
                              batch_size=cfg.batch_size // cfg.num_generations, seed=cfg.seed,
                              repeat=cfg.num_iterations)

    def begin(self, run, *, resume: bool, say) -> None:
        cfg = run.train_cfg
        self.columns = load_columns(run.data_dir)
        self.tokenizer = run.tokenizer
        self.stop_ids = sorted({*run.tokenizer.stop_tokens, end_token(run.tokenizer)})
        self.completions = run.dir.path / COMPLETIONS_FILE
        self.reference = None
        if cfg.grpo_beta > 0:  # a frozen copy: the run's start, or --reference
            from minigpt.runs import load_run

            self.reference = load_run(cfg.reference or cfg.init_from,
                                      str(run.layout.preset.path)).model
        if resume and run.step % cfg.num_iterations:
            self._resume_rollout(run, run.step - run.step % cfg.num_iterations)
        if self.completions.is_file() and run.is_writer:  # the steps that rerun are drawn again
            write_text_atomic(self.completions, "".join(
                f"{json.dumps(r)}\n" for r in read_metrics(self.completions)
                if r.get("step", 0) <= run.step))
        say(f"GRPO: {cfg.batch_size // cfg.num_generations} prompts x {cfg.num_generations} "
            f"completions a step, at most {cfg.max_completion_length} tokens each, scored by "
            f"{', '.join(r.spec for r in self.rewards)}; completions of logged steps in "
            f"{self.completions}")

    def _resume_rollout(self, run, drawn_at: int) -> None:
        """The batch of completions drawn at step `drawn_at`, which the resumed steps train on
        (`rollout.npz` holds the latest drawn; refused if it is not that one)."""
        path = run.dir.path / ROLLOUT_FILE
        try:
            with np.load(path) as kept:
                arrays = {k: kept[k] for k in kept.files}
        except (OSError, ValueError) as error:
            raise DataError(f"{path} cannot be read ({error}): step {run.step} trains on the "
                            f"completions drawn at step {drawn_at}; resume from a checkpoint at "
                            f"a multiple of train.num_iterations") from None
        if int(arrays.pop("drawn_at", -1)) != drawn_at:
            raise DataError(f"{path} holds completions drawn after step {drawn_at}, whose batch "
                            f"step {run.step} trains on: resume from a checkpoint at a multiple "
                            f"of train.num_iterations")
        self.rollout = _place(run.layout, {k: v for k, v in arrays.items()
                                           if not k.startswith("reported/")})
        self.reported = {k.removeprefix("reported/"): float(v) for k, v in arrays.items()
                         if k.startswith("reported/")}

    def put(self, layout):
        return lambda host: host  # prompts stay on the host: the step draws on them

    def step(self, run, batch: dict[str, np.ndarray], rates) -> dict[str, Any]:
        cfg = run.train_cfg
        if run.step % cfg.num_iterations == 0 or self.rollout is None:
            try:
                self.rollout = self._roll_out(run, batch)
            except rewards.RewardError:
                _save(run, run.feed.before_last)  # the steps trained so far are kept
                raise
        reported = grpo.grpo_step(run.model, run.optimizer, self.rollout, rates,
                                  **_step_settings(cfg), microbatches=cfg.microbatches)
        return {**reported, **self.reported}

    def _roll_out(self, run, host: dict[str, np.ndarray]) -> dict[str, Any]:
        cfg, G, step = run.train_cfg, run.train_cfg.num_generations, run.step
        base = jax.random.fold_in(run.rng, step)
        settings = [Settings(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             min_p=cfg.min_p, key=tuple(int(w) for w in key_data(
                                 jax.random.fold_in(base, j)))) for j in range(cfg.batch_size)]
        rows, ids, completions = self._draw(run.model, host, G, settings,
                                            cfg.max_completion_length)
        total, each, texts = self._score(rows, completions, step, cfg)
        advantages, zero_std = grpo.advantages(np.asarray(total, np.float64), G,
                                               cfg.scale_rewards)
        mask = _completion_mask(host["length"].repeat(G), completions, ids.shape[1])
        self.reported = _reported(total, each, completions, self.stop_ids, zero_std)
        batch = _place(run.layout, {
            "ids": ids, "mask": mask, "advantages": advantages.astype(np.float32),
            "weights": grpo.token_weights(mask, cfg.loss_type, cfg.max_completion_length,
                                          cfg.microbatches)})
        if cfg.num_iterations > 1:
            batch["old"] = grpo.policy_logps(run.model, batch["ids"],
                                             temperature=cfg.temperature)
        if self.reference is not None:
            batch["reference"] = grpo.policy_logps(self.reference, batch["ids"],
                                                   temperature=cfg.temperature)
        if run.is_writer:
            if cfg.num_iterations > 1:
                self._keep(run, batch, step)
            served = range(step + 1, step + 1 + cfg.num_iterations)
            if step == 0 or any(s % cfg.log_every == 0 for s in served):
                self._write_samples(step + 1, rows, texts, total, each, advantages)
        return batch

    def _draw(self, model, host, G: int, settings, max_new: int):
        """The prompts' rows, each prompt and its completion [B, T + 1] and the completions."""
        prompts = [host["ids"][i, :host["length"][i]].tolist() for i in range(len(host["ids"]))]
        rows = [self.columns[int(r)] for r in host["row"] for _ in range(G)]
        expanded = [p for p in prompts for _ in range(G)]
        completions = decode_all(model, expanded, max_new=max_new, settings=settings,
                                 stop_ids=self.stop_ids, keep_stop=True)
        ids = np.zeros((len(expanded), host["ids"].shape[1] + 1), np.int32)
        for i, (p, c) in enumerate(zip(expanded, completions)):
            ids[i, :len(p) + len(c)] = p + c
        return rows, ids, completions

    def _score(self, rows, completions, step: int, cfg: TrainConfig):
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        prompts = [row["prompt"] for row in rows]
        shown = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                 for p, t in zip(prompts, texts)]
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
        state = types.SimpleNamespace(global_step=step, max_steps=cfg.steps)
        total, each = rewards.score(self.rewards, cfg.reward_weights, cfg.reward_timeout, {
            **columns, "prompts": prompts, "completions": shown,
            "completion_ids": [list(c) for c in completions], "trainer_state": state,
            "log_extra": _ignore, "log_metric": _ignore})
        return total, each, texts

    def _keep(self, run, batch, step: int) -> None:
        arrays = {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}
        arrays["drawn_at"] = np.asarray(step)
        arrays.update({f"reported/{k}": np.asarray(v) for k, v in self.reported.items()})
        with replacing(run.dir.path / ROLLOUT_FILE) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    def _write_samples(self, step, rows, texts, total, each, advantages) -> None:
        with open(self.completions, "a", encoding="utf-8") as f:
            for i, (row, text) in enumerate(zip(rows, texts)):
                f.write(json.dumps({
                    "step": step, "prompt": row["prompt"], "completion": text,
                    "reward": _number(total[i]),
                    "rewards": {name: _number(v[i]) for name, v in each.items()},
                    "advantage": float(advantages[i])}) + "\n")

    def evaluate(self, run) -> dict[str, float]:
        """One greedy completion of each held-out prompt (at most `eval_batches` batches of
        prompts), and the rewards' means."""
        cfg = run.train_cfg
        held = load_rows(run.data_dir, "val")
        count = min(len(held["row"]), cfg.eval_batches * (cfg.batch_size // cfg.num_generations))
        held = {k: v[:count] for k, v in held.items()}
        rows, _, completions = self._draw(run.model, held, 1, Settings(),
                                          cfg.max_completion_length)
        try:
            total, each, _ = self._score(rows, completions, run.step, cfg)
        except rewards.RewardError:
            _save(run, run.feed.get_state())  # the steps trained so far are kept
            raise
        with np.errstate(all="ignore"):
            result = {"eval_reward": float(np.nanmean(total))}
            result.update({f"eval_rewards/{name}/mean": float(np.nanmean(v))
                           for name, v in each.items()})
        return result


def _save(run, data_state) -> None:
    """A checkpoint of the steps done (unless one of this step is already saved)."""
    if run.checkpointer.latest_step() != run.step:
        run.checkpointer.save(run.step, run.model, run.optimizer, layout=run.layers.canonical,
                              data_state=data_state, rng=run.rng)
    run.checkpointer.wait()


def _place(layout, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Arrays [B, ...] of any rank placed on the mesh, their rows split as the batch's."""
    return {k: jax.make_array_from_process_local_data(layout.batch_sharding(v.ndim), v)
            for k, v in arrays.items()}


def _step_settings(cfg: TrainConfig) -> dict[str, float]:
    return {"epsilon_low": cfg.epsilon, "epsilon_high": cfg.epsilon_high or cfg.epsilon,
            "beta": cfg.grpo_beta, "temperature": cfg.temperature}


def _completion_mask(prompt_lengths: np.ndarray, completions, width: int) -> np.ndarray:
    mask = np.zeros((len(completions), width), np.float32)
    for i, (start, c) in enumerate(zip(prompt_lengths, completions)):
        mask[i, start:start + len(c)] = 1
    return mask


def _reported(total, each, completions, stop_ids, zero_std) -> dict[str, float]:
    """What a batch of completions measured, by TRL's names."""
    total = np.asarray(total, np.float64)
    lengths = np.array([len(c) for c in completions], np.float64)
    ended = np.array([bool(c) and c[-1] in stop_ids for c in completions])
    with np.errstate(all="ignore"):
        reported = {"reward": np.nanmean(total), "reward_std": grpo.nanstd(total),
                    "frac_reward_zero_std": zero_std.mean(),
                    "completions/mean_length": lengths.mean(),
                    "completions/min_length": lengths.min(),
                    "completions/max_length": lengths.max(),
                    "completions/clipped_ratio": 1.0 - ended.mean(),
                    "completions/mean_terminated_length":
                        lengths[ended].mean() if ended.any() else 0.0}
        for name, values in each.items():
            values = np.asarray(values, np.float64)
            reported[f"rewards/{name}/mean"] = np.nanmean(values)
            reported[f"rewards/{name}/std"] = grpo.nanstd(values)
    return {k: float(v) for k, v in reported.items()}


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _ignore(*args, **kwargs) -> None:
    """TRL's `log_extra` and `log_metric`, which rewards may call: nothing is kept."""
