"""A run's record: where its metrics are written (metrics.jsonl, TensorBoard, the progress bar,
a plot), how steps are timed and profiled, and how the record is read back.

Each step's wall time becomes tokens/s and MFU against the peak `minigpt.models.flops` states.

`metrics.jsonl` is the record of a run: one JSON object per logged step. TensorBoard's event files
in `<run>/tensorboard/` show the same numbers and are rebuilt from it when a run resumes, so a
resumed run's curves continue with no step twice; the profiler trace lands beside them, where
TensorBoard's profile plugin looks.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import minigpt.models.flops as flops
from minigpt import pipeline
from minigpt.config import TrainConfig
from minigpt.errors import UserError
from minigpt.files import replacing, shadowed
from minigpt.models import kernels
from minigpt.optim import grpo, preference
from minigpt.runs import RunDir, resolved


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl; only the writing process uses it."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def training_seconds(records: list[dict[str, Any]], tokens_per_step: int,
                     first_step_s: float) -> dict[int, float]:
    """Seconds of training at the end of each logged step: the first step (compilation and
    all, `first_step_s`) plus each later step's time, read back from its tokens/s. Evaluation
    and checkpoint pauses are not steps and are left out (a step without a speed, the first
    after a resume, adds nothing)."""
    seconds, clock = {}, first_step_s
    for record in sorted((r for r in records if "loss" in r), key=lambda r: r["step"]):
        if seconds and record.get("tokens_per_s"):
            clock += tokens_per_step / record["tokens_per_s"]
        seconds[record["step"]] = clock
    return seconds


def run_training_seconds(run: str | Path) -> dict[int, float]:
    """`training_seconds` of a run directory: its tokens per step from config.json, and its
    first step from the time budget's record (compilation plus the fitted step time; 0 for a
    run without a budget, whose first step was not timed)."""
    run = RunDir(run)
    saved = run.read()
    tokens = saved.train.batch_size * resolved.seq_len(saved.model, saved.train)
    budget = saved.record.get("time_budget", {})
    fitted = next((v["s_per_step"] for k, v in budget.items() if k.startswith("fit")), 0.0)
    return training_seconds(read_metrics(run.metrics), tokens,
                            budget.get("compile_s", 0.0) + fitted)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl file.

    A process killed while appending leaves a torn last line; such a line is left out with a
    warning, and every complete record is kept.
    """
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            warnings.warn(f"{path}, line {number}: not a complete record (a run stopped while "
                          f"writing it); left out", stacklevel=2)
    return records


def plot_losses(records: list[dict[str, Any]], path: Path) -> None:
    """Train loss per step and eval loss where measured, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


# Settings far past what anyone trains with, which alone can make a run diverge: (config
# section, field, the largest usual value, the metric their term of the loss reports). The
# learning rate is not among them: the message without an extreme setting names it.
EXTREMES = (("model", "router_z_loss_coef", 1.0, "z_loss"),
            ("model", "router_aux_loss_coef", 10.0, "aux_loss"),
            ("train", "muon_lr", 10.0, None), ("train", "lora_alpha", 1e4, None))


def extreme_settings(model_cfg: Any, train_cfg: Any, values: dict[str, Any]) -> list[str]:
    """The settings of a diverged run that are extreme (`EXTREMES`), or whose own term of the
    loss is what stopped being finite, each as "section.field VALUE"."""
    found = []
    for section, field, usual, metric in EXTREMES:
        value = getattr(model_cfg if section == "model" else train_cfg, field)
        term = values.get(metric) if metric else None
        broke = isinstance(term, float) and not math.isfinite(term)
        if value > usual or (broke and value > 0):
            found.append(f"{section}.{field} {value:g}")
    return found


class TrainingDiverged(UserError, RuntimeError):
    """The loss or the gradient norm stopped being a finite number; the message says what to do."""

    exit_code = 3  # the command lines' status for a run that diverged, apart from bad input

    @classmethod
    def at(cls, step: int, values: dict[str, float], *, lr: float, warmup: int, dtype: str,
           out: Path, latest_checkpoint: int | None,
           extreme: list[str] = ()) -> TrainingDiverged:
        """The one-line error: what diverged, what is kept, and the likely cause: an extreme
        setting where the run has one (`extreme_settings`), else the learning rate."""
        kept = (f"the latest checkpoint is still step {latest_checkpoint}; nothing after it was "
                f"saved" if latest_checkpoint is not None else "no checkpoint was saved")
        what = (f"step {step}: the loss is {values['loss']} and the gradient norm "
                f"{values['grad_norm']}: training diverged and stopped ({kept}).")
        if extreme:
            return cls(f"{what} The likely cause: {' and '.join(extreme)}, far beyond the usual "
                       f"values; train again with {'them' if len(extreme) > 1 else 'it'} "
                       f"in range (--set {extreme[0].replace(' ', '=')} is the one to change)")
        # A tenth of the rate, but no more than the default: a rate ten times too high is
        # rarely the only excess of one a thousand times too high.
        lower = min(lr / 10, TrainConfig.lr)
        again = (" (nothing was saved, so it starts again from step 0 with the run's settings)"
                 if latest_checkpoint is None else "")
        return cls(
            f"{what} Likely causes: a "
            f"learning rate too high for this model and batch (peak lr {lr:g}), too short a "
            f"warm-up ({warmup} steps) or overflow in {dtype}. Go on with a lower rate: "
            f"python -m minigpt.train --out {out} --resume --lr {lower:g}{again}")


def describe_eval(result: dict[str, float]) -> str:
    """Held-out metrics as the log shows them: "eval loss 2.4567 nats/token, 0.912
    bits/byte"; of pairs: "DPO loss 0.4123, chosen over rejected 0.938, margin 1.520"."""
    if "eval_rewards/accuracies" in result or "eval_reward" in result:
        return preference.describe(result)
    text = f"eval loss {result['eval_loss']:.4f} nats/token"
    if "eval_bits_per_byte" in result:
        text += f", {result['eval_bits_per_byte']:.3f} bits/byte"
    return text


# metrics.jsonl keys and the TensorBoard tags they are shown under.
TENSORBOARD_TAGS = {"loss": "train/loss", "lr": "train/learning_rate",
                    "grad_norm": "train/grad_norm", "tokens_per_s": "speed/tokens_per_s",
                    "mfu": "speed/mfu", "eval_loss": "eval/loss",
                    "eval_bits_per_byte": "eval/bits_per_byte",
                    "eval_perplexity": "eval/perplexity"}
# Those only a mixture of experts logs (`minigpt.optim.steps`): the router's penalties, each
# expert's share of the assignments (a list, shown as one scalar per expert, `<tag>/<index>`),
# the largest share, and the assignments a capacity dispatch dropped.
EXPERT_TENSORBOARD_TAGS = {"aux_loss": "train/router_aux_loss",
                           "z_loss": "train/router_z_loss", "expert_share": "experts/share",
                           "expert_share_max": "experts/largest_share",
                           "dropped_tokens": "experts/dropped_tokens"}


class TensorBoard:
    """The run's metrics as TensorBoard scalars, in `directory` (`<run>/tensorboard`).

    It starts from `records`, the metrics.jsonl records the run keeps (on resume, those up to
    the checkpoint it continues from), replacing the event files written before: TensorBoard
    would otherwise show the steps after the checkpoint twice. The profiler's trace in
    `directory/plugins/profile` is left alone.
    """

    def __init__(self, directory: Path, records: list[dict[str, Any]] = ()):
        from tensorboardX import SummaryWriter  # imported by the writing process only

        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("events.out.tfevents.*"):
            old.unlink()
        self._writer = SummaryWriter(str(directory), flush_secs=10)
        for record in records:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        for key, tag in {**TENSORBOARD_TAGS, **EXPERT_TENSORBOARD_TAGS,
                         **grpo.tensorboard_tags(record)}.items():
            value = record.get(key)
            for i, entry in enumerate(value if isinstance(value, list) else ()):
                self._writer.add_scalar(f"{tag}/{i}", entry, record["step"])
            if value is not None and not isinstance(value, list):
                self._writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self._writer.close()


class StepTimer:
    """Wall time per step, leaving out the first step (compilation) and eval/checkpoint pauses."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.last: float | None = None
        self.paused = 0.0

    def lap(self) -> float | None:
        now = self.clock()
        elapsed = None if self.last is None else now - self.last - self.paused
        self.last, self.paused = now, 0.0
        return elapsed

    @contextlib.contextmanager
    def pause(self):
        start = self.clock()
        yield
        self.paused += self.clock() - start


class Recorder:
    """Turns each step's metrics into a metrics.jsonl record, TensorBoard scalars and the
    progress bar. Processes other than 0 (`enabled=False`) time their steps and write nothing.

    `tokens_per_step`, `flops_per_token`, `peak` (one device's, a `minigpt.models.flops.Peak`,
    which keeps every MFU at most 1) and `devices` turn a step's wall time into tokens/s and MFU.
    """

    def __init__(self, path: Path, tensorboard: Path, *, enabled: bool, step: int,
                 total: int | None, tokens_per_step: int, flops_per_token: float, peak,
                 devices: int, log_every: int):
        self.tokens_per_step, self.flops, self.peak = tokens_per_step, flops_per_token, peak
        self.devices, self.log_every = devices, log_every
        self.timer = StepTimer()
        self.log = MetricsLog(path, enabled=enabled)
        self.board = TensorBoard(tensorboard, read_metrics(path)) if enabled else None
        self.progress = (tqdm(total=total, initial=step, desc="train", unit="step",
                              dynamic_ncols=True, mininterval=_progress_interval())
                         if enabled else None)

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(record)
        if self.board is not None:
            self.board.write(record)

    def record(self, step: int, reported: dict[str, Any]) -> dict[str, float]:
        """Log the metrics a step reported (device scalars, or vectors: each expert's share)
        with its speed; returns them as floats (lists of floats)."""
        values = {k: float(v) if np.ndim(v) == 0 else [float(x) for x in v]
                  for k, v in jax.device_get(reported).items()}
        elapsed = self.timer.lap()
        entry = {"step": step, **values}
        if elapsed is not None:
            entry["tokens_per_s"] = self.tokens_per_step / elapsed
            entry["mfu"] = self.peak.mfu(self.flops * entry["tokens_per_s"] / self.devices)
        self.write(entry)
        if self.progress is not None:
            self.progress.update(1)
            if step % self.log_every == 0 and elapsed is not None:
                self.progress.set_postfix(loss=f"{values['loss']:.3f}",
                                          tok_s=f"{entry['tokens_per_s']:,.0f}",
                                          mfu=f"{entry['mfu']:.3f}")
        return values

    def record_eval(self, step: int, result: dict[str, float]) -> None:
        """Log held-out metrics: {"eval_loss" (nats per token), and where measured
        "eval_bits_per_byte"}; the perplexity comes with the loss."""
        if "eval_loss" in result and "eval_rewards/accuracies" not in result:  # DPO's: none
            result = {**result, "eval_perplexity": math.exp(min(result["eval_loss"], 50))}
        self.write({"step": step, **result})
        if self.progress is not None:
            self.progress.write(f"step {step}: {describe_eval(result)}")

    def set_total(self, steps: int) -> None:
        if self.progress is not None:
            self.progress.total = steps
            self.progress.refresh()

    def close(self) -> None:
        self.close_progress()
        try:
            self.log.close()
        finally:
            if self.board is not None:
                self.board.close()

    def close_progress(self) -> None:
        """End the progress bar's line, so that what is printed next (an error from a write
        that failed, say) starts a line of its own."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None


def _progress_interval() -> float:
    """Seconds between progress bar updates: often on a terminal, rarely where each update is
    kept (a notebook's saved output, a log file)."""
    return 0.5 if sys.stderr.isatty() else 30.0


class Profiler:
    """A JAX profiler trace of steps a..b-1 into `directory` (the run's TensorBoard folder, where
    the profile plugin finds it), and nothing else: no step still running and no checkpoint still
    being written when it starts."""

    def __init__(self, directory: Path, step_range: tuple[int, int] | None):
        self.directory, self.range = directory, step_range
        self.tracing = False

    def before(self, step: int, pending, wait_for_saves) -> None:
        """Before step `step` is dispatched; `pending` is the previous step's metrics (or None)
        and `wait_for_saves()` blocks until checkpoint writes are done."""
        if self.range and step == self.range[0]:
            if pending is not None:
                jax.block_until_ready(pending)
            wait_for_saves()
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True

    def after(self, done: int, metrics) -> None:
        if self.tracing and done == self.range[1]:
            jax.block_until_ready(metrics)  # step b-1 runs to its end inside the trace
            self.close()

    def close(self) -> None:
        """Stop the trace; also when the run ends (or stops) before step b."""
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def for_run(run, *, say) -> Recorder:
    """A training run's recorder, after its first lines: layout, what it computes, MFU's peak."""
    cfg, settled = run.train_cfg, run.settled
    tokens_per_step = cfg.batch_size * settled.seq_len * (2 if cfg.objective == "dpo" else 1)
    peak = flops.device_peak(settled.model.dtype)
    preset = run.layout.preset
    if note := shadowed(run.train_cfg.preset, preset.path):
        say(note)
    computes = kernels.describe(run.model_cfg.kernels, settled.model.dtype) + (
        f" ({settled.dtype_reason})" if settled.dtype_reason else "")
    say(f"preset {preset.name} ({preset.path}) on mesh {dict(run.layout.mesh.shape)}; "
        f"{tokens_per_step:,} tokens/step; {computes}; MFU "
        f"against {peak.flops / 1e12:.2f} TFLOP/s per device ({peak.source})")
    if run.layout.pipeline.microbatches:
        say(pipeline.describe(run.layout.stages, run.model_cfg.num_layers, run.layout.pipeline,
                              sequences=cfg.batch_size // cfg.microbatches))
    return Recorder(run.dir.metrics, run.dir.tensorboard, enabled=run.is_writer, step=run.step,
                    total=None if cfg.time_budget else cfg.steps, tokens_per_step=tokens_per_step,
                    flops_per_token=flops.flops_per_token(run.model_cfg, settled.seq_len),
                    peak=peak, devices=run.layout.mesh.size, log_every=cfg.log_every)


def summarise(run: RunDir, summary: dict[str, Any]) -> dict[str, Any] | None:
    """At a run's end: its loss plot, and its last loss and held-out figures added to
    `summary`; returns the last held-out record (None: never evaluated)."""
    records = read_metrics(run.metrics)
    plot_losses(records, run.loss_plot)
    summary["final_loss"] = next((r["loss"] for r in reversed(records) if "loss" in r), None)
    held_out = next((r for r in reversed(records) if any(k.startswith("eval_") for k in r)),
                    None)
    summary.update({k: (held_out or {}).get(k) for k in ("eval_loss", "eval_bits_per_byte")})
    return held_out
