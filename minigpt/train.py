"""Training: `python -m minigpt.train --preset fsdp` and the `train` function behind it.

The loop keeps the accelerator busy: it dispatches step k and only then reads the metrics of step
k-1, which are ready or nearly so, so the host never waits for the step it just queued. All
array work happens inside the compiled step; the loop only moves host batches onto the mesh.

A run directory holds config.json, metrics.jsonl, loss.png and checkpoints/. `--resume`
continues from the latest checkpoint exactly: same batches, same dropout masks, same losses.
Ctrl-C saves a checkpoint before exiting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from minigpt import pipeline, sharding, steps
from minigpt.checkpoint import Checkpointer, CheckpointError
from minigpt.config import (
    EXECUTION_FIELDS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    load_recipe,
    load_run_config,
    parse_duration,
    parse_step_range,
    save_run_config,
    warmup_for,
)
from minigpt.data import resolve_data
from minigpt.files import write_text_atomic
from minigpt.generate import generate
from minigpt.loader import batch_iterator
from minigpt.metrics import MetricsLog, device_peak, flops_per_token, plot_losses, read_metrics
from minigpt.models import build_model, get_config
from minigpt.runtime import join_job, relaunch_with_huge_pages, set_simulated_devices
from minigpt.tokenizer import TokenizerError, load_tokenizer
from minigpt.tokens import DataError, load_meta


def log(*args: Any) -> None:
    """Print from process 0 only, so a multi-host job prints each line once."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset, mesh):
    """Model and optimizer, born sharded by the preset."""
    def build():
        model = build_model(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
        return model, nnx.Optimizer(model, steps.make_optimizer(train_cfg), wrt=nnx.Param)

    return sharding.create_sharded(build, preset, mesh)


def check_layout(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset,
                 mesh) -> int:
    """Refuse batch and pipeline settings the preset cannot split evenly, before anything
    compiles; return the pipeline microbatches (0 when the preset has no pipeline)."""
    per_micro = train_cfg.batch_size // train_cfg.microbatches
    stages = sharding.ways(mesh, preset.spec(("layers",))[0])
    pieces = 0
    if stages > 1:
        if len(preset.mesh_axes_of("layers")) != 1:
            raise sharding.PresetError(f"preset {preset.name!r}: a pipeline needs `layers` on "
                                       f"one mesh axis, not {preset.mesh_axes_of('layers')}")
        if model_cfg.num_layers % stages:
            raise sharding.PresetError(
                f"preset {preset.name!r} splits the layers into {stages} pipeline stages, but "
                f"model {train_cfg.model!r} has {model_cfg.num_layers} layer(s), which "
                f"{stages} stages cannot share evenly: choose a model whose layer count "
                f"divides by {stages}, or another preset")
        pieces = train_cfg.pipeline_microbatches or pipeline.default_microbatches(stages)
        if per_micro % pieces:
            raise ConfigError(
                f"train.pipeline_microbatches {pieces} does not divide the {per_micro} "
                f"sequences of each batch the pipeline runs (batch size {train_cfg.batch_size}"
                f" / {train_cfg.microbatches} accumulation microbatch(es)): choose a divisor")
    ways = sharding.batch_divisor(preset, mesh)
    per_piece = per_micro // max(pieces, 1)
    if per_piece % ways:
        split = f" and {pieces} pipeline microbatches" if pieces else ""
        raise ConfigError(
            f"batch size {train_cfg.batch_size} with {train_cfg.microbatches} microbatch(es)"
            f"{split} gives {per_piece} sequences per piece, which preset {preset.name!r} must "
            f"split {ways} ways over its batch axes {preset.mesh_axes_of('batch')}: choose a "
            f"batch size that is a multiple of {ways * train_cfg.microbatches * max(pieces, 1)}")
    if pieces:
        log(f"pipeline: {stages} stages of {model_cfg.num_layers // stages} layers, {pieces} "
            f"microbatches of {per_micro // pieces} sequences; bubble (S - 1) / (M + S - 1) = "
            f"{pipeline.bubble_fraction(stages, pieces):.1%} of each step")
    return pieces


@dataclasses.dataclass
class Run:
    """What a training run holds while it runs: configs, mesh, data, state and checkpoints."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    out: Path
    seq_len: int
    preset: sharding.Preset
    mesh: Any
    data_dir: Path
    tokenizer: str
    model: nnx.Module
    optimizer: nnx.Optimizer
    checkpointer: Checkpointer
    batches: Any  # the Grain iterator of training batches
    rng: jax.Array
    pipeline_microbatches: int = 0  # 0: the preset has no pipeline
    step: int = 0  # steps done
    started: float = 0.0  # time.monotonic() when the data was ready: a time budget starts here

    @property
    def is_writer(self) -> bool:
        return jax.process_index() == 0


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool = False,
          sample: bool = True) -> dict[str, Any]:
    """Train (or continue training) a model; returns a summary of the run.

    The phases: build the run (refusing what cannot work before anything compiles), restore
    its latest checkpoint when resuming, write the run's files, run the loop, finish (plot,
    sample). The checkpointer is closed however the run ends.
    """
    run = build_run(model_cfg, train_cfg, resume=resume)
    try:
        if resume:
            restore(run)
        write_run_files(run)
        interrupted = run_loop(run)
    finally:
        run.checkpointer.close()
    return finish(run, interrupted=interrupted, sample=sample)


def build_run(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool) -> Run:
    """Check the request, prepare the data and create the sharded state (nothing trained yet)."""
    out = Path(train_cfg.out)
    checkpoints = out / "checkpoints"
    if not resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise ConfigError(f"{out} already holds checkpoints: pass --resume to continue it, "
                          f"or choose another --out")
    if train_cfg.time_budget and jax.process_count() > 1:
        # Each process would time its own steps and could settle on another step count.
        raise ConfigError("a time budget is for single-process runs; in a multi-process job "
                          "give --steps")
    if train_cfg.time_budget:  # the budget decides the step count; until then, open-ended
        train_cfg = dataclasses.replace(train_cfg, steps=10**9)
    seq_len = train_cfg.seq_len or model_cfg.context_len
    if seq_len > model_cfg.context_len:
        raise ConfigError(f"train.seq_len {seq_len} exceeds the model's context "
                          f"{model_cfg.context_len}")
    preset = sharding.load_preset(train_cfg.preset)
    mesh = sharding.make_mesh(preset)
    pieces = check_layout(model_cfg, train_cfg, preset, mesh)
    data_dir = _prepare_data(train_cfg, model_cfg.tokenizer)
    started = time.monotonic()
    meta = load_meta(data_dir)
    if meta["vocab_size"] != model_cfg.vocab_size:
        raise ConfigError(
            f"{data_dir} was tokenized with {meta['tokenizer']!r} ({meta['vocab_size']:,} "
            f"tokens), but model {train_cfg.model!r} has a vocabulary of "
            f"{model_cfg.vocab_size:,} ({model_cfg.tokenizer!r}): give the text or dataset "
            f"name so it is prepared with the model's tokenizer, or pass --tokenizer "
            f"{meta['tokenizer']} to train a model with that one")
    model, optimizer = init_state(model_cfg, train_cfg, preset, mesh)
    share, shares = sharding.batch_share(preset, mesh, train_cfg.batch_size)
    batches = batch_iterator(data_dir, "train", seq_len=seq_len,
                             batch_size=train_cfg.batch_size, seed=train_cfg.seed,
                             process_index=share, process_count=shares)
    checkpointer = Checkpointer(checkpoints, keep=train_cfg.keep_checkpoints)
    for name in checkpointer.leftovers:
        log(f"removed {checkpoints / name}: an incomplete checkpoint an interrupted save left")
    return Run(model_cfg=model_cfg, train_cfg=train_cfg, out=out, seq_len=seq_len,
               preset=preset, mesh=mesh, data_dir=data_dir,
               tokenizer=meta["tokenizer"], model=model, optimizer=optimizer,
               checkpointer=checkpointer, batches=batches, rng=jax.random.key(train_cfg.seed),
               pipeline_microbatches=pieces, started=started)


def restore(run: Run) -> None:
    """Continue from the newest checkpoint that reads cleanly: weights, optimizer, step, key and
    data position. Newer ones that cannot be read are moved, unchanged, to
    `<run>/damaged-checkpoints/` so that the steps they held can be saved again."""
    restored = run.checkpointer.restore(run.model, run.optimizer)
    run.step, run.rng = restored["step"], restored["rng"]
    run.batches.set_state(restored["data_state"])
    for step, why in restored["skipped"]:
        damaged = run.out / "damaged-checkpoints"
        if run.is_writer:
            damaged = run.checkpointer.set_aside(step, damaged)
        log(f"warning: checkpoint {step} cannot be read ({why}); skipped it. Its files are "
            f"kept, unchanged, in {damaged}")
    if restored["skipped"] and jax.process_count() > 1:
        multihost_utils.sync_global_devices("minigpt: damaged checkpoints set aside")
        run.checkpointer.reload()
    log(f"resumed from {run.checkpointer.directory / str(run.step)} at step {run.step}")


def write_run_files(run: Run) -> None:
    """config.json (enough to rebuild the model), and metrics.jsonl cut back to the start step."""
    if not run.is_writer:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    _write_config(run)
    path = run.out / "metrics.jsonl"
    if path.exists():  # on resume, forget metrics of steps after the checkpoint: they rerun
        kept = [r for r in read_metrics(path) if r["step"] <= run.step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _write_config(run: Run, **extra: Any) -> None:
    if run.is_writer:
        save_run_config(run.out / "config.json", run.model_cfg, run.train_cfg,
                        preset=run.preset.name, tokenizer=run.tokenizer,
                        data_dir=str(run.data_dir), **extra)


def run_loop(run: Run) -> bool:
    """Train from `run.step` to `train.steps`; returns whether Ctrl-C cut the run short.

    Step k is dispatched before the metrics of step k-1 are read, so the host never waits for
    the step it just queued. Checkpoints and evaluation wait for their step to finish.
    """
    put = sharding.put_batch_fn(run.preset, run.mesh)
    schedule = steps.lr_schedule(run.train_cfg)
    recorder = _Recorder(run)
    budget = _Budget(run)
    profiler = _Profiler(run.out / "profile", run.train_cfg.profile_steps)
    pending = None
    # In a multi-process job all processes must stop at the same step to save together;
    # there Ctrl-C (or the launcher) stops them all and --resume uses the last checkpoint.
    interrupts = _StopOnInterrupt() if jax.process_count() == 1 else _NoInterrupts()
    try:
        with sharding.use_preset(run.preset, run.mesh), interrupts as stop:
            while run.step < run.train_cfg.steps and not stop.requested:
                profiler.before(run.step, pending, run.checkpointer)
                metrics = steps.train_step(run.model, run.optimizer, put(next(run.batches)),
                                           run.rng, microbatches=run.train_cfg.microbatches,
                                           pipeline_microbatches=run.pipeline_microbatches,
                                           schedule=schedule)
                run.step += 1
                if pending is not None:  # read step k-1 while step k runs
                    recorder.record(*pending)
                pending = (run.step, metrics)
                profiler.after(run.step, metrics)
                if budget.check(run, metrics, recorder):  # the step count was just decided
                    schedule = steps.lr_schedule(run.train_cfg)
                budget.out_of_time(run)
                _save_and_evaluate(run, metrics, put, recorder)
            if pending is not None:
                recorder.record(*pending)
            interrupted = stop.requested and run.step < run.train_cfg.steps
            if interrupted:
                _save(run)
    finally:
        profiler.close()
        run.checkpointer.wait()
        recorder.close()
    return interrupted


def _save(run: Run) -> None:
    run.checkpointer.save(run.step, run.model, run.optimizer,
                          data_state=run.batches.get_state(), rng=run.rng)


def _save_and_evaluate(run: Run, metrics, put, recorder: _Recorder) -> None:
    """The periodic checkpoint and evaluation, when this step is due for them."""
    cfg, done = run.train_cfg, run.step
    save = done % cfg.save_every == 0 or done == cfg.steps
    evaluate_now = done % cfg.eval_every == 0 or done == cfg.steps
    if not (save or evaluate_now):
        return
    jax.block_until_ready(metrics)  # the step's own time stays in its timing
    recorder.check_finite(done, metrics)  # never save a diverged state
    with recorder.timer.pause():
        if save:
            _save(run)
        if evaluate_now:
            recorder.record_eval(done, evaluate(run, put))


def evaluate(run: Run, batch_put) -> float:
    """Mean loss over the first `eval_batches` batches of the validation split (fixed order)."""
    cfg = run.train_cfg
    share, shares = sharding.batch_share(run.preset, run.mesh, cfg.batch_size)
    it = batch_iterator(run.data_dir, "val", seq_len=run.seq_len, batch_size=cfg.batch_size,
                        seed=0, shuffle=False, process_index=share, process_count=shares)
    losses = [steps.eval_step(run.model, batch_put(next(it)),
                              pipeline_microbatches=run.pipeline_microbatches)
              for _ in range(cfg.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def finish(run: Run, *, interrupted: bool, sample: bool) -> dict[str, Any]:
    """Summarise the run; a run that reached its end also gets its loss plot and a sample."""
    summary = {"out": str(run.out), "step": run.step, "interrupted": interrupted,
               "checkpoint": str(run.checkpointer.directory /
                                 str(run.checkpointer.latest_step()))}
    log(f"checkpoint: {summary['checkpoint']}")
    if interrupted:
        return summary
    if run.is_writer:
        records = read_metrics(run.out / "metrics.jsonl")
        plot_losses(records, run.out / "loss.png")
        summary["final_loss"] = next((r["loss"] for r in reversed(records) if "loss" in r), None)
        summary["eval_loss"] = next(
            (r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
    if sample:
        with sharding.use_preset(run.preset, run.mesh):
            story = generate(run.model, load_tokenizer(run.tokenizer), ["Once upon a time"],
                             max_new_tokens=100, temperature=0.8, top_k=50,
                             rng=jax.random.key(run.train_cfg.seed))[0]
        log(f"sample:\n{story}")
    return summary


def _prepare_data(train_cfg: TrainConfig, tokenizer: str) -> Path:
    """Download and tokenize (with the model's tokenizer) on first use. In a multi-process job
    process 0 goes first and the others wait, then reuse its files (shared file system) or
    prepare their own copy."""
    def prepare():
        return resolve_data(train_cfg.data, train_cfg.data_root, tokenizer=tokenizer)

    if jax.process_count() == 1:
        return prepare()
    data_dir = prepare() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("minigpt: data prepared by process 0")
    return data_dir or prepare()


class _Budget:
    """A wall-clock budget (`train.time_budget`) turned into a step count.

    The run starts with an open-ended schedule (the warm-up only). Once the first step (which
    compiles) is done and a few more have run (at least PROBE steps and 5% of the budget), it
    knows how long compiling took and how long a step takes: it fixes `train.steps` to what
    fits in the time left (periodic evaluations and the recompilation the new schedule needs
    set aside) and fits the cosine to it. The step after that fit tells what the recompilation
    really cost. Halfway through the rest it measures the pace again (evaluations and
    checkpoints included); if the run would miss the deadline by more than 2% of the budget
    *and* by more than a recompilation costs, it fits once more (a smaller miss is cheaper to
    absorb: the run then ends that much early or late, with its cosine complete). Each fit is
    recorded in config.json with `time_budget` cleared, so a resumed run continues to the same
    step with the same rates. If the time runs out anyway, the run stops (and saves) there; after
    the last measurement the hard stop leaves room for the rest of the run to be up to a quarter
    slower than measured (a machine whose load changes), so a nearly finished cosine is not cut.
    The final save, evaluation and sample come after the budget.
    """

    PROBE = 8
    PROBE_FRACTION = 0.05
    TOLERANCE = 0.02  # of the budget: a refit (or a stop) only past this
    DRIFT = 0.25  # how much slower than measured the rest of a run may get before it is cut

    def __init__(self, run: Run, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds = run.train_cfg.time_budget
        self.measuring = bool(self.seconds)  # False once the last decision is taken
        self.deadline = run.started + self.seconds
        self.stop_at = self.deadline + self.TOLERANCE * self.seconds  # the hard stop
        self.loop_start = self.clock()
        self.mark: tuple[int, float] | None = None  # (step, time) the pace is measured from
        self.first_step_s = 0.0  # the first step, with its compilation
        self.compile_s = 0.0  # the compilation alone
        self.recompile_s = 0.0  # a fit's, measured on the step after it
        self.pace = 0.0  # seconds per step, as last measured
        self.check_at = 0  # the step of the next measurement; 0: right after the next step
        self.fits = 0
        self.recompiling = False  # the next step is the first with a new schedule
        self.record: dict[str, Any] = {"seconds": self.seconds}

    def check(self, run: Run, metrics, recorder: _Recorder) -> bool:
        """Called after each step is dispatched; True when the schedule was just (re)fitted."""
        if not self.measuring or run.step < self.check_at:
            return False
        jax.block_until_ready(metrics)
        now = self.clock()
        if self.mark is None:  # the first step (and the compilation) just finished
            self.mark, self.first_step_s = (run.step, now), now - self.loop_start
            self.check_at = run.step + self.PROBE
            return False
        if self.recompiling:  # the step after a fit: what recompiling cost, and the pace from here
            self.recompiling = False
            self.recompile_s = max(0.0, now - self.mark[1] - self.pace)
            self.record["recompile_s"] = round(self.recompile_s, 2)
            _write_config(run, time_budget=self.record)
            self.mark = (run.step, now)
            self.check_at = run.step + max(1, (run.train_cfg.steps - run.step) // 2)
            return False
        pace = (now - self.mark[1]) / (run.step - self.mark[0])
        self.pace = pace  # a step alone: what the step after a fit is compared with
        if self.fits == 0:
            if now - self.mark[1] < self.PROBE_FRACTION * self.seconds:
                self.check_at = run.step + 1
                return False
            self.compile_s = max(0.0, self.first_step_s - pace)
            cost = self.compile_s  # the refit's recompilation, as long as the first one
            cfg = run.train_cfg  # a forward pass costs about a third of a training step
            pace *= 1 + cfg.eval_batches / (3 * cfg.eval_every)
        else:
            self.measuring = False  # the last measurement: from here, only the hard stop
            ends = now + pace * (run.train_cfg.steps - run.step)
            miss, cost = ends - self.deadline, self.recompile_s
            if abs(miss) <= max(self.TOLERANCE * self.seconds, cost):
                # on time, or off by less than refitting would cost: keep the schedule
                self._allow_drift(now, ends)
                self.record["ends_late_s" if miss > 0 else "ends_early_s"] = round(abs(miss), 2)
                _write_config(run, time_budget=self.record)
                return False
        left = self.deadline - now - cost
        if left < pace:  # no time to recompile for even one more step: the hard stop decides
            return False
        if self.fits:  # the refit ends at the deadline
            self._allow_drift(now, self.deadline)
        self._fit(run, run.step + int(left / pace), pace, recorder)
        return True

    def _allow_drift(self, now: float, ends: float) -> None:
        """Move the hard stop past a run expected to end at `ends`, by the tolerance and by a
        quarter of the time still to go."""
        slack = self.TOLERANCE * self.seconds + self.DRIFT * max(0.0, ends - now)
        self.stop_at = max(self.stop_at, ends + slack)

    def _fit(self, run: Run, total: int, pace: float, recorder: _Recorder) -> None:
        self.fits += 1
        run.train_cfg = dataclasses.replace(run.train_cfg, steps=total, time_budget=0.0)
        run.optimizer.tx = steps.make_optimizer(run.train_cfg)
        self.record.update(steps=total, compile_s=round(self.compile_s, 2),
                           **{f"fit{self.fits}": {"at_step": run.step,
                                                  "s_per_step": round(pace, 4)}})
        _write_config(run, time_budget=self.record)
        recorder.set_total(total)
        self.mark, self.check_at = (run.step, self.clock()), run.step + 1
        self.recompiling = True
        log(f"time budget {self.seconds:g} s: compiling took {self.compile_s:.1f} s "
            f"and a step takes {pace:.3f} s, so the run trains {total} steps (schedule fitted "
            f"at step {run.step})")

    def out_of_time(self, run: Run) -> bool:
        """Past the hard stop with steps still to go: stop at this step."""
        if not self.seconds or self.clock() < self.stop_at:
            return False
        if run.step < run.train_cfg.steps:
            log(f"the time budget ran out at step {run.step} of {run.train_cfg.steps} (steps "
                f"were slower than measured); stopping here" if self.fits else
                f"the time budget ran out at step {run.step}, before the steps could be timed "
                f"(the first step, compilation included, took {self.first_step_s:.1f} s); "
                f"stopping here: give a longer --time-budget")
            run.train_cfg = dataclasses.replace(run.train_cfg, steps=run.step, time_budget=0.0)
            self.record["steps"] = run.step
            _write_config(run, time_budget=self.record)
        return True


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being a finite number; the message says what to do."""


class _Recorder:
    """Turns each step's device metrics into a metrics.jsonl record and the progress bar, and
    stops the run at the first non-finite loss or gradient norm."""

    def __init__(self, run: Run):
        cfg = run.train_cfg
        self.run = run
        self.tokens_per_step = cfg.batch_size * run.seq_len
        self.peak, peak_source = device_peak(run.model_cfg.dtype)
        self.flops = flops_per_token(run.model_cfg, run.seq_len)
        self.devices, self.log_every = run.mesh.size, cfg.log_every
        self.timer = _StepTimer()
        self.log = MetricsLog(run.out / "metrics.jsonl", enabled=run.is_writer)
        total = None if cfg.time_budget else cfg.steps  # a budget decides the steps later
        self.progress = (tqdm(total=total, initial=run.step, desc="train", unit="step",
                              dynamic_ncols=True, mininterval=_progress_interval())
                         if run.is_writer else None)
        log(f"preset {run.preset.name} on mesh {dict(run.mesh.shape)}; "
            f"{self.tokens_per_step:,} tokens/step; MFU against {self.peak / 1e12:.2f} "
            f"TFLOP/s per device ({peak_source})")

    def check_finite(self, step: int, metrics: dict[str, jax.Array]) -> dict[str, float]:
        """The step's metrics as floats; a non-finite loss or gradient norm is logged and
        raised as TrainingDiverged."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"]):
            return values
        self.log.write({"step": step, **values})
        run, cfg = self.run, self.run.train_cfg
        last = run.checkpointer.latest_step()
        kept = (f"the latest checkpoint is still step {last}; nothing after it was saved"
                if last is not None else "no checkpoint was saved")
        raise TrainingDiverged(
            f"step {step}: the loss is {values['loss']} and the gradient norm "
            f"{values['grad_norm']}: training diverged and stopped ({kept}). Likely causes: a "
            f"learning rate too high for this model and batch (peak lr {cfg.lr:g}), too short a "
            f"warm-up ({warmup_for(cfg)} steps) or overflow in {run.model_cfg.dtype}. Continue "
            f"with a lower rate: python -m minigpt.train --out {run.out} --resume "
            f"--lr {cfg.lr / 10:g}")

    def record(self, step: int, metrics: dict[str, jax.Array]) -> None:
        values = self.check_finite(step, metrics)
        elapsed = self.timer.lap()
        entry = {"step": step, **values}
        if elapsed is not None:
            entry["tokens_per_s"] = self.tokens_per_step / elapsed
            entry["mfu"] = self.flops * entry["tokens_per_s"] / (self.peak * self.devices)
        self.log.write(entry)
        if self.progress is not None:
            self.progress.update(1)
            if step % self.log_every == 0 and elapsed is not None:
                self.progress.set_postfix(loss=f"{values['loss']:.3f}",
                                          tok_s=f"{entry['tokens_per_s']:,.0f}",
                                          mfu=f"{entry['mfu']:.3f}")

    def set_total(self, steps: int) -> None:
        if self.progress is not None:
            self.progress.total = steps
            self.progress.refresh()

    def record_eval(self, step: int, loss: float) -> None:
        self.log.write({"step": step, "eval_loss": loss,
                        "eval_perplexity": math.exp(min(loss, 50))})
        if self.progress is not None:
            self.progress.write(f"step {step}: eval loss {loss:.4f}")

    def close(self) -> None:
        self.log.close()
        if self.progress is not None:
            self.progress.close()


def _progress_interval() -> float:
    """Seconds between progress bar updates: often on a terminal, rarely where each update is
    kept (a notebook's saved output, a log file)."""
    return 0.5 if sys.stderr.isatty() else 30.0


class _Profiler:
    """A JAX profiler trace of steps a..b-1 (`train.profile_steps = "a:b"`), and nothing else:
    no step still running and no checkpoint still being written when it starts."""

    def __init__(self, directory: Path, steps_text: str):
        self.directory = directory
        self.range = parse_step_range(steps_text) if steps_text else None
        self.tracing = False

    def before(self, step: int, pending, checkpointer: Checkpointer) -> None:
        if self.range and step == self.range[0]:
            if pending is not None:
                jax.block_until_ready(pending[1])
            checkpointer.wait()
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


class _StopOnInterrupt:
    """Turn the first Ctrl-C into a request the loop honours at a safe point (after a step has
    been dispatched), so the checkpoint it saves is consistent; a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
        log("\ninterrupted: finishing the current step and saving a checkpoint "
            "(Ctrl-C again to quit without saving)")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _NoInterrupts(contextlib.nullcontext):
    requested = False

    def __enter__(self):
        return self


class _StepTimer:
    """Wall time per step, leaving out the first step (compilation) and eval/checkpoint pauses."""

    def __init__(self):
        self.last: float | None = None
        self.paused = 0.0

    def lap(self) -> float | None:
        now = time.perf_counter()
        elapsed = None if self.last is None else now - self.last - self.paused
        self.last, self.paused = now, 0.0
        return elapsed

    @contextlib.contextmanager
    def pause(self):
        start = time.perf_counter()
        yield
        self.paused += time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minigpt.train", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", help="a named way to train (a file in recipes/, e.g. "
                                    "stories-cpu, or a .toml path): model, tokenizer and "
                                    "settings; the other flags override it")
    p.add_argument("--time-budget", metavar="DURATION",
                   help="train for this long (e.g. 10m, 90s, 1h; compilation included) with "
                        "the learning-rate schedule fitted to it, instead of --steps")
    p.add_argument("--tokenizer", help="gpt2, a shipped vocabulary (tinystories-4k) or a "
                                       ".tiktoken file; sets the model's vocabulary to match")
    p.add_argument("--preset", help="parallelism preset: a name in presets/ or a .toml path "
                                    "(default fsdp)")
    p.add_argument("--model", help="model name from the zoo (default minigpt)")
    p.add_argument("--data", nargs="+", help="'tinystories', 'tinystories-v2' or text files")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, help="training context (default: the model's)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="run directory (default runs/default)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--devices", type=int, default=0,
                   help="simulate this many CPU devices (try any preset on a laptop)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--save-every", type=int)
    p.add_argument("--no-sample", action="store_true",
                   help="do not tell a sample story at the end")
    p.add_argument("--profile-steps", help="'a:b': write a profiler trace of steps a..b-1")
    job = p.add_argument_group("multi-process jobs (see python -m minigpt.launch to try one "
                               "on this machine)")
    job.add_argument("--coordinator", metavar="HOST:PORT",
                     help="address of process 0's coordinator; joins a multi-process job")
    job.add_argument("--num-processes", type=int, help="processes in the job")
    job.add_argument("--process-id", type=int, help="this process's index, 0..N-1")
    job.add_argument("--distributed", action="store_true",
                     help="join the job the cluster environment describes (SLURM, Open MPI, "
                          "Cloud TPU, Kubernetes, JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.dropout=0 --set lr=3e-4")
    return p


FLAG_FIELDS = {"preset": "preset", "data": "data", "steps": "steps", "batch_size": "batch_size",
               "seq_len": "seq_len", "lr": "lr", "seed": "seed", "out": "out",
               "eval_every": "eval_every", "save_every": "save_every",
               "profile_steps": "profile_steps"}


def resolve_configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """Configs from flags; on --resume, the run's saved configs with the flags given on top.

    A new run starts from the defaults, then the recipe (if any), then the flags, then --set.
    """
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()
             if getattr(args, flag) is not None}
    if "data" in given:
        given["data"] = tuple(given["data"])
    if args.time_budget is not None:
        if args.steps is not None:
            raise ConfigError("give --steps or --time-budget, not both")
        given["time_budget"] = parse_duration(args.time_budget)
    elif args.steps is not None:
        given["time_budget"] = 0.0  # a step count given on the command line wins over a recipe
    out = Path(args.out or TrainConfig.out)
    if args.resume and (args.recipe or args.tokenizer):
        raise ConfigError("--recipe and --tokenizer apply to a new run; a resumed run keeps "
                          "its own (drop them, or train into a new --out)")
    if args.resume:
        saved = load_run_config(out / "config.json")
        model_cfg = saved["model"]
        train_cfg = TrainConfig(**{**saved["train"], "data": tuple(saved["train"]["data"]),
                                   **given})
        # --set applies to the run's model; only how it runs (EXECUTION_FIELDS) may change.
        resumed, train_cfg = apply_overrides(model_cfg, train_cfg, args.set)
        for wanted in ([get_config(args.model)] if args.model else []) + [resumed]:
            differing = [f.name for f in dataclasses.fields(ModelConfig)
                         if f.name not in EXECUTION_FIELDS
                         and getattr(wanted, f.name) != getattr(model_cfg, f.name)]
            if differing:
                details = ", ".join(f"{n}: {getattr(model_cfg, n)!r} -> {getattr(wanted, n)!r}"
                                    for n in differing)
                raise ConfigError(f"cannot resume {out} with a different model ({details}); "
                                  f"drop those options or train into a new --out")
        return resumed, train_cfg
    if args.recipe:
        model_cfg, train_cfg = recipe_configs(args.recipe, model=args.model, **given)
    else:
        model_cfg = get_config(args.model or TrainConfig.model)
        train_cfg = TrainConfig(**{**given, "model": args.model or TrainConfig.model})
    if args.tokenizer:
        model_cfg = dataclasses.replace(model_cfg, tokenizer=args.tokenizer,
                                        vocab_size=load_tokenizer(args.tokenizer).n_vocab)
    return apply_overrides(model_cfg, train_cfg, args.set)


def recipe_configs(name_or_path: str, model: str | None = None,
                   **train_changes: Any) -> tuple[ModelConfig, TrainConfig]:
    """The configs a recipe (recipes/<name>.toml) describes, with `train_changes` on top.
    Another `model` replaces the recipe's (and drops its changes to the model's fields)."""
    recipe = load_recipe(name_or_path)
    model_cfg = get_config(model or recipe.model)
    if model in (None, recipe.model):
        model_cfg = dataclasses.replace(model_cfg, **recipe.model_fields)
    train_cfg = TrainConfig(**{**recipe.train_fields, "recipe": recipe.name, **train_changes,
                               "model": model or recipe.model})
    return model_cfg, train_cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    if args.distributed or any(v is not None for v in (
            args.coordinator, args.num_processes, args.process_id)):
        join_job(args.coordinator, args.num_processes, args.process_id)
    try:
        model_cfg, train_cfg = resolve_configs(args)
        summary = train(model_cfg, train_cfg, resume=args.resume, sample=not args.no_sample)
    except (ConfigError, sharding.PresetError, CheckpointError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    relaunch_with_huge_pages()
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
