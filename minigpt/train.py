"""Training: `python -m minigpt.train --preset fsdp` and the `train` function behind it.

A run goes through five phases, each a function below: build it (refusing what cannot work before
anything compiles), restore its latest checkpoint when resuming, write its files, run the loop,
finish (plot, sample). The loop keeps the accelerator busy: it dispatches step k and only then
reads the metrics of step k-1, which are ready or nearly so, so the host never waits for the step
it just queued. All array work happens inside the compiled step.

A run directory holds config.json, metrics.jsonl, tensorboard/, loss.png and checkpoints/, and
while a trainer works on it, trainer.lock (`minigpt.lock`). `--resume` continues from the latest
checkpoint exactly: same batches, same dropout masks, same losses. Ctrl-C saves a checkpoint
before exiting. The command line itself is `minigpt.cli`; time budgets are `minigpt.budget`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt import cli, config, metrics, pipeline, runtime, schedule, sharding, steps
from minigpt.budget import TimeBudget
from minigpt.checkpoint import Checkpointer, has_checkpoint, restore_weights
from minigpt.config import ConfigError, ModelConfig, TrainConfig, load_run_config, warmup_for
from minigpt.data import prepare_in_job
from minigpt.files import write_text_atomic
from minigpt.generate import generate
from minigpt.loader import batch_iterator
from minigpt.lock import hold_run_lock
from minigpt.models import build_model
from minigpt.runtime import log
from minigpt.token_files import load_meta
from minigpt.tokenizer import keep_vocabulary, load_tokenizer


@dataclasses.dataclass
class Run:
    """What a training run holds while it runs: configs, mesh, data, state and checkpoints."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    out: Path
    seq_len: int
    preset: sharding.Preset
    mesh: Any
    pipeline: sharding.Pipeline  # how a pipeline preset runs the stack (M resolved)
    data_dir: Path
    tokenizer: str
    model: nnx.Module
    optimizer: nnx.Optimizer
    checkpointer: Checkpointer
    batches: Any  # the Grain iterator of training batches
    rng: jax.Array
    step: int = 0  # steps done
    started: float = 0.0  # time.monotonic() when the data was ready: a time budget starts here

    @property
    def is_writer(self) -> bool:
        return jax.process_index() == 0


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool = False,
          sample: bool = True) -> dict[str, Any]:
    """Train (or continue training) a model; returns a summary of the run.

    Nothing is written before the request is checked; then the run directory is locked for this
    trainer, and the lock and the checkpointer are released however the run ends.
    """
    preset, mesh, settings = check_request(model_cfg, train_cfg, resume=resume)
    with hold_run_lock(Path(train_cfg.out), say=log):
        run = build_run(model_cfg, train_cfg, preset, mesh, settings)
        try:
            if resume:
                restore(run)
            else:
                if train_cfg.init_from:
                    start_from(run, Path(train_cfg.init_from))
                _into_layout(run)
            write_run_files(run)
            interrupted = run_loop(run)
        finally:
            run.checkpointer.close()
        return finish(run, interrupted=interrupted, sample=sample)


def check_request(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool):
    """Refuse what cannot work, before anything is written or compiled; returns the preset, the
    mesh and how its pipeline runs (`sharding.check_layout`)."""
    checkpoints = Path(train_cfg.out) / "checkpoints"
    if not resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise ConfigError(f"{train_cfg.out} already holds checkpoints: pass --resume to continue "
                          f"it, or choose another --out")
    if train_cfg.init_from and not resume and not has_checkpoint(
            Path(train_cfg.init_from) / "checkpoints"):
        raise ConfigError(f"--init-from {train_cfg.init_from}: it holds no checkpoint to start "
                          f"from")
    if train_cfg.time_budget and jax.process_count() > 1:
        # Each process would time its own steps and could settle on another step count.
        raise ConfigError("a time budget is for single-process runs; in a multi-process job "
                          "give --steps")
    if (train_cfg.seq_len or model_cfg.context_len) > model_cfg.context_len:
        raise ConfigError(f"train.seq_len {train_cfg.seq_len} exceeds the model's context "
                          f"{model_cfg.context_len}")
    preset = sharding.load_preset(train_cfg.preset)
    mesh = sharding.make_mesh(preset)
    return preset, mesh, sharding.check_layout(
        preset, mesh, model=train_cfg.model, num_layers=model_cfg.num_layers,
        batch_size=train_cfg.batch_size, accumulation=train_cfg.microbatches,
        seq_len=train_cfg.seq_len or model_cfg.context_len,
        pipeline=sharding.Pipeline(microbatches=train_cfg.pipeline_microbatches,
                                   schedule=train_cfg.pipeline_schedule,
                                   repeats=train_cfg.pipeline_repeats))


def build_run(model_cfg: ModelConfig, train_cfg: TrainConfig, preset: sharding.Preset, mesh,
              settings: sharding.Pipeline) -> Run:
    """Prepare the data and create the sharded state (nothing trained yet)."""
    if train_cfg.time_budget:  # the budget decides the step count; until then, open-ended
        train_cfg = dataclasses.replace(train_cfg, steps=10**9)
    data_dir = prepare_in_job(train_cfg.data, train_cfg.data_root, model_cfg.tokenizer)
    started = time.monotonic()
    meta = load_meta(data_dir)
    # A model's vocabulary may have rows its tokenizer never uses (imported checkpoints often
    # do): the data must be in the model's tokenizer, whose ids fit the model.
    if meta["vocab_size"] != load_tokenizer(model_cfg.tokenizer).n_vocab:
        raise ConfigError(
            f"{data_dir} was tokenized with {meta['tokenizer']!r} ({meta['vocab_size']:,} "
            f"tokens), but model {train_cfg.model!r} has a vocabulary of "
            f"{model_cfg.vocab_size:,} ({model_cfg.tokenizer!r}): give the text or dataset "
            f"name so it is prepared with the model's tokenizer, or pass --tokenizer "
            f"{meta['tokenizer']} to train a model with that one")

    def build():
        model = build_model(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
        return model, nnx.Optimizer(model, steps.make_optimizer(train_cfg), wrt=nnx.Param)

    model, optimizer = sharding.create_sharded(build, preset, mesh)
    seq_len = train_cfg.seq_len or model_cfg.context_len
    share, shares = sharding.batch_share(preset, mesh, train_cfg.batch_size)
    batches = batch_iterator(data_dir, "train", seq_len=seq_len,
                             batch_size=train_cfg.batch_size, seed=train_cfg.seed,
                             process_index=share, process_count=shares)
    out = Path(train_cfg.out)
    checkpointer = Checkpointer(out / "checkpoints", keep=train_cfg.keep_checkpoints)
    for name in checkpointer.leftovers:
        log(f"removed {out / 'checkpoints' / name}: an incomplete checkpoint an interrupted save "
            f"left")
    return Run(model_cfg=model_cfg, train_cfg=train_cfg, out=out, seq_len=seq_len,
               preset=preset, mesh=mesh, pipeline=settings, data_dir=data_dir,
               tokenizer=meta["tokenizer"], model=model, optimizer=optimizer,
               checkpointer=checkpointer, batches=batches, rng=jax.random.key(train_cfg.seed),
               started=started)


def restore(run: Run) -> None:
    """Continue from the newest checkpoint that reads cleanly: weights, optimizer, step, key and
    data position. Newer ones that cannot be read are moved, unchanged, to
    `<run>/damaged-checkpoints/` so that the steps they held can be saved again."""
    restored = run.checkpointer.restore(run.model, run.optimizer)
    run.step, run.rng = restored["step"], restored["rng"]
    run.batches.set_state(restored["data_state"])
    run.checkpointer.set_aside_skipped(restored["skipped"], run.out / "damaged-checkpoints",
                                       writer=run.is_writer, say=log)
    _into_layout(run)
    log(f"resumed from {run.checkpointer.directory / str(run.step)} at step {run.step}")
    saved = load_run_config(run.out / "config.json")["train"]
    _continue_schedule(run, TrainConfig(**{**saved, "data": tuple(saved["data"])}))


def start_from(run: Run, source: Path) -> None:
    """A new run (`--init-from`) starts from another run's latest weights (trained here or
    imported by `minigpt.hub`) with a fresh optimizer at step 0."""
    restored = restore_weights(source / "checkpoints", run.model)
    log(f"starting from the weights of {source} at its step {restored['step']} (a fresh "
        f"optimizer, step 0)")


def _continue_schedule(run: Run, saved: TrainConfig) -> None:
    """A resumed run asked to end at another step goes on from the rate it has reached
    (`schedule.continued`); a schedule whose end was given (`decay_steps`) or is a time
    budget's to decide is left alone."""
    cfg = run.train_cfg
    if cfg.steps == saved.steps or cfg.decay_steps or cfg.time_budget or saved.time_budget:
        return
    if cfg.steps < run.step:
        raise ConfigError(f"{run.out} is at step {run.step}, past --steps {cfg.steps}: give a "
                          f"later step to train further")
    run.train_cfg, message = schedule.continued(saved, cfg, run.step)
    log(message)


def write_run_files(run: Run) -> None:
    """config.json (enough to rebuild the model), and metrics.jsonl cut back to the start step."""
    if not run.is_writer:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    if run.train_cfg.init_from:  # an imported vocabulary goes with the weights
        kept = keep_vocabulary(run.model_cfg.tokenizer, Path(run.train_cfg.init_from), run.out)
        run.model_cfg = dataclasses.replace(run.model_cfg, tokenizer=kept)
    _write_config(run)
    path = run.out / "metrics.jsonl"
    if path.exists():  # on resume, forget metrics of steps after the checkpoint: they rerun
        kept = [r for r in metrics.read_metrics(path) if r["step"] <= run.step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _write_config(run: Run, **extra: Any) -> None:
    if run.is_writer:
        config.save_run_config(run.out / "config.json", run.model_cfg, run.train_cfg,
                               preset=run.preset.name, tokenizer=run.tokenizer,
                               data_dir=str(run.data_dir), **extra)


def run_loop(run: Run) -> bool:
    """Train from `run.step` to `train.steps`; returns whether Ctrl-C cut the run short.

    Step k is dispatched before the metrics of step k-1 are read, so the host never waits for
    the step it just queued. Checkpoints and evaluation wait for their step to finish.
    """
    cfg = run.train_cfg
    put = sharding.put_batch_fn(run.preset, run.mesh)
    recorder = _recorder(run)
    budget = (TimeBudget(cfg.time_budget, run.started, say=log,
                         eval_share=cfg.eval_batches / (3 * cfg.eval_every))
              if cfg.time_budget else None)
    profiler = metrics.Profiler(run.out / "tensorboard", config.parse_step_range(
        cfg.profile_steps) if cfg.profile_steps else None)
    rates, pending = schedule.lr_schedule(cfg), None
    # In a multi-process job all processes must stop at the same step to save together;
    # there Ctrl-C (or the launcher) stops them all and --resume uses the last checkpoint.
    interrupts = runtime.StopOnInterrupt() if jax.process_count() == 1 else runtime.NoInterrupts()
    try:
        with sharding.use_preset(run.preset, run.mesh, run.pipeline), interrupts as stop:
            while run.step < run.train_cfg.steps and not stop.requested:
                profiler.before(run.step, pending and pending[1], run.checkpointer.wait)
                reported = steps.train_step(run.model, run.optimizer, put(next(run.batches)),
                                            run.rng, rates, microbatches=run.train_cfg.microbatches)
                run.step += 1
                if pending is not None:  # read step k-1 while step k runs
                    _record(run, recorder, *pending)
                pending = (run.step, reported)
                profiler.after(run.step, reported)
                if budget is not None and _follow_budget(run, budget, recorder, reported):
                    rates = schedule.lr_schedule(run.train_cfg)
                if _due(run, "save_every") or _due(run, "eval_every"):
                    _record(run, recorder, *pending)  # also: never save a diverged state
                    pending = None
                    with recorder.timer.pause():
                        _save_and_evaluate(run, put, recorder)
            if pending is not None:
                _record(run, recorder, *pending)
            interrupted = stop.requested and run.step < run.train_cfg.steps
            if interrupted:
                _save(run)
    finally:
        profiler.close()
        run.checkpointer.wait()
        recorder.close()
    return interrupted


def _recorder(run: Run) -> metrics.Recorder:
    cfg = run.train_cfg
    tokens_per_step = cfg.batch_size * run.seq_len
    peak, peak_source = metrics.device_peak(run.model_cfg.dtype)
    log(f"preset {run.preset.name} on mesh {dict(run.mesh.shape)}; {tokens_per_step:,} "
        f"tokens/step; MFU against {peak / 1e12:.2f} TFLOP/s per device ({peak_source})")
    if run.pipeline.microbatches:
        stages = run.mesh.shape[sharding.pipeline_axis(run.preset.rules)]
        log(pipeline.describe(stages, run.model_cfg.num_layers, run.pipeline,
                              sequences=cfg.batch_size // cfg.microbatches))
    return metrics.Recorder(run.out, enabled=run.is_writer, step=run.step,
                            total=None if cfg.time_budget else cfg.steps,
                            tokens_per_step=tokens_per_step,
                            flops_per_token=metrics.flops_per_token(run.model_cfg, run.seq_len),
                            peak=peak, devices=run.mesh.size, log_every=cfg.log_every)


def _follow_budget(run: Run, budget: TimeBudget, recorder: metrics.Recorder, reported) -> bool:
    """Let the time budget decide after this step; True when the schedule was refitted."""
    total = budget.check(run.step, run.train_cfg.steps, lambda: jax.block_until_ready(reported))
    if total is not None:
        run.train_cfg = dataclasses.replace(run.train_cfg, steps=total, time_budget=0.0)
        recorder.set_total(total)
    if budget.out_of_time(run.step, run.train_cfg.steps):
        run.train_cfg = dataclasses.replace(run.train_cfg, steps=run.step, time_budget=0.0)
    record = budget.take_record()
    if record is not None:
        _write_config(run, time_budget=record)
    return total is not None


def _due(run: Run, every: str) -> bool:
    return run.step % getattr(run.train_cfg, every) == 0 or run.step == run.train_cfg.steps


def _record(run: Run, recorder: metrics.Recorder, step: int, reported) -> None:
    """Log the metrics a step reported; a non-finite loss or gradient norm stops the run."""
    values = recorder.record(step, reported)
    if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
        cfg = run.train_cfg
        raise metrics.TrainingDiverged.at(
            step, values, lr=cfg.lr, warmup=warmup_for(cfg), dtype=run.model_cfg.dtype,
            out=run.out, latest_checkpoint=run.checkpointer.latest_step())


def _into_layout(run: Run, *, back: bool = False) -> None:
    """Move the model and optimizer into the order a circular schedule keeps its layers in
    (or `back` into the model's), once; checkpoints keep the model's order."""
    order = pipeline.circular_order(run.pipeline, run.model_cfg.num_layers, run.preset, run.mesh)
    if order is not None:
        order = np.argsort(order) if back else order
        for obj in (run.model, run.optimizer):
            nnx.update(obj, pipeline.reorder_layers(nnx.state(obj), order))


def _save(run: Run) -> None:
    order = pipeline.circular_order(run.pipeline, run.model_cfg.num_layers, run.preset, run.mesh)
    layout = None if order is None else (
        lambda state: pipeline.reorder_layers(state, np.argsort(order)))
    run.checkpointer.save(run.step, run.model, run.optimizer, layout=layout,
                          data_state=run.batches.get_state(), rng=run.rng)


def _save_and_evaluate(run: Run, put, recorder: metrics.Recorder) -> None:
    if _due(run, "save_every"):
        _save(run)
    if _due(run, "eval_every"):
        recorder.record_eval(run.step, evaluate(run, put))


def evaluate(run: Run, batch_put) -> float:
    """Mean loss over the first `eval_batches` batches of the validation split (fixed order)."""
    share, shares = sharding.batch_share(run.preset, run.mesh, run.train_cfg.batch_size)
    it = batch_iterator(run.data_dir, "val", seq_len=run.seq_len,
                        batch_size=run.train_cfg.batch_size, seed=0, shuffle=False,
                        process_index=share, process_count=shares)
    return steps.mean_loss(run.model, (batch_put(next(it))
                                       for _ in range(run.train_cfg.eval_batches)))


def finish(run: Run, *, interrupted: bool, sample: bool) -> dict[str, Any]:
    """Summarise the run; a run that reached its end also gets its loss plot and a sample."""
    summary = {"out": str(run.out), "step": run.step, "interrupted": interrupted,
               "checkpoint": str(run.checkpointer.directory /
                                 str(run.checkpointer.latest_step()))}
    log(f"checkpoint: {summary['checkpoint']}")
    if interrupted:
        return summary
    if run.is_writer:
        records = metrics.read_metrics(run.out / "metrics.jsonl")
        metrics.plot_losses(records, run.out / "loss.png")
        summary["final_loss"] = next((r["loss"] for r in reversed(records) if "loss" in r), None)
        summary["eval_loss"] = next(
            (r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
    if sample:
        _into_layout(run, back=True)  # generation runs the layers in the model's order
        with sharding.use_preset(run.preset, run.mesh):
            story = generate(run.model, load_tokenizer(run.tokenizer), ["Once upon a time"],
                             max_new_tokens=100, temperature=0.8, top_k=50,
                             rng=jax.random.key(run.train_cfg.seed))[0]
        log(f"sample:\n{story}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt.train`: the command line (`minigpt.cli`) around `train`."""
    return cli.run(argv, train)


if __name__ == "__main__":
    runtime.relaunch_with_huge_pages()
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
