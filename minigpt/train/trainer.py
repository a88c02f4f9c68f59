"""Training: the `train` function behind `python -m minigpt.train`, told as the run's story.

A run goes through its phases, each a function below: check the request (refusing what cannot
work before anything is written or compiled), build it, restore its latest checkpoint when
resuming (or start from another run's weights), settle its configuration, write its files, run
the loop, finish (plot, sample). The configuration is decided before the loop; in the loop only a
time budget changes it, through `reconfigure`, which also writes config.json. The loop dispatches
step k and only then reads the metrics of step k-1, so the host never waits for the step it just
queued. A resumed run continues exactly: same batches, dropout masks and losses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx

import minigpt.optim.lr_schedule as lr_schedule
import minigpt.optim.state as state
import minigpt.train.batches as batches
import minigpt.train.metrics as metrics
import minigpt.train.objectives as objectives
from minigpt import pipeline, plan, runtime, sharding
from minigpt.checkpoint import Checkpointer, has_checkpoint
from minigpt.config import ConfigError, ModelConfig, TrainConfig, parse_step_range
from minigpt.data import check_tokenizer
from minigpt.files import write_text_atomic
from minigpt.generate import generate
from minigpt.runs import RunDir, check_start, keep_vocabulary, resolved
from minigpt.runtime import log
from minigpt.tokenizer import load_tokenizer
from minigpt.train.budget import TimeBudget
from minigpt.train.feed import Feed
from minigpt.train.lock import hold_run_lock

# The step count of a run whose time budget has not yet decided one: open-ended.
OPEN_ENDED = 10**9


@dataclasses.dataclass
class Run:
    """What a training run holds while it runs: configs, layout, data, state and checkpoints."""

    model_cfg: ModelConfig  # as asked (config.json's "model")
    train_cfg: TrainConfig
    settled: resolved.Resolved  # what it runs with (config.json's "resolved")
    dir: RunDir
    layers: pipeline.LayerOrder  # where the stacked layers are kept while it trains
    data_dir: Path
    model: nnx.Module
    optimizer: nnx.Optimizer
    checkpointer: Checkpointer
    feed: Feed  # the training batches, placed a step ahead
    objective: Any  # what it learns from: its data, step and evaluation (`objectives`)
    tokenizer: Any
    documents: tuple[int, int | None] | None  # begin and end tokens, where documents stay apart
    rng: jax.Array
    record: dict[str, Any]  # what config.json says beside the two configs
    step: int = 0  # steps done
    started: float = 0.0  # time.monotonic() when the data was ready: a time budget starts here

    @property
    def layout(self) -> sharding.Layout:
        return self.settled.layout

    @property
    def is_writer(self) -> bool:
        return jax.process_index() == 0


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool = False,
          sample: bool = True, check_memory: bool = True) -> dict[str, Any]:
    """Train (or continue training) a model; returns a summary of the run. Nothing is written
    before the request is checked (`check_memory=False`: a run the planner expects not to fit
    tries anyway); then the run directory is locked for this trainer, and the lock and the
    checkpointer are released however the run ends."""
    train_cfg, chosen = plan.resolve(model_cfg, train_cfg, resume=resume, say=log)  # "auto"
    settled = check_request(model_cfg, train_cfg, resume=resume, check_memory=check_memory)
    if resume and not has_checkpoint(RunDir(train_cfg.out).checkpoints):  # it never saved
        log(f"nothing of {train_cfg.out} was saved yet: it starts again from step 0, with the "
            f"settings its config.json holds and the changes asked for now")
        resume = False
    with hold_run_lock(Path(train_cfg.out), say=log):
        run = build_run(model_cfg, train_cfg, settled, resume=resume)
        run.record.update(chosen)  # how --preset auto chose, for config.json
        try:
            if resume:
                restore(run)
            settle(run, resume=resume)
            run.objective.begin(run, resume=resume, say=log)
            run.layers.enter(run.model, run.optimizer)
            write_run_files(run)
            interrupted = run_loop(run)
        finally:
            run.checkpointer.close()
        return finish(run, interrupted=interrupted, sample=sample)


def check_request(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool,
                  check_memory: bool = True) -> resolved.Resolved:
    """Refuse what cannot work, before anything is written or compiled: the run directory, the
    layout (`resolved.layout`), the adapters and weights against the devices, the whole step
    against their memory (`plan.preflight`); returns the run's settings, resolved once."""
    check_start(train_cfg.out, resume=resume, init_from=train_cfg.init_from)
    if train_cfg.time_budget and jax.process_count() > 1:
        # Each process would time its own steps and could settle on another step count.
        raise ConfigError("a time budget is for single-process runs; in a multi-process job "
                          "give --steps")
    if resolved.seq_len(model_cfg, train_cfg) > model_cfg.context_len:
        raise ConfigError(f"train.seq_len {train_cfg.seq_len} exceeds the model's context "
                          f"{model_cfg.context_len}")
    if (n := load_tokenizer(model_cfg.tokenizer).n_rows) > model_cfg.vocab_size:
        raise ConfigError(f"tokenizer {model_cfg.tokenizer!r} has {n:,} tokens but the model's "
                          f"table has {model_cfg.vocab_size:,} rows: ids past them have no "
                          f"embedding (a config.json naming another model's tokenizer?)")
    layout = resolved.layout(model_cfg, train_cfg)
    objectives.check(model_cfg, train_cfg, layout, resolved.seq_len(model_cfg, train_cfg),
                     resume=resume)
    state.check(model_cfg, train_cfg, layout)  # the weights alone, naming a LoRA rank
    ahead = plan.preflight(model_cfg, train_cfg, layout, enforce=check_memory, say=log)
    horizon = None
    if train_cfg.time_budget and ahead.step_seconds:  # the warm-up is fixed from the start
        # The plan's step leaves out the host, the data and compiling: half the steps it fits
        # in the budget, so a warm-up never outlasts the run the budget then fits.
        horizon = max(1, int(train_cfg.time_budget / ahead.step_seconds / 2))
    return resolved.resolve(model_cfg, train_cfg, layout, remat=ahead.remat, horizon=horizon)


def build_run(model_cfg: ModelConfig, train_cfg: TrainConfig, settled: resolved.Resolved, *,
              resume: bool) -> Run:
    """Prepare the data and create the sharded state (nothing trained yet); a new run started
    from another's weights reads them before anything of its own is written."""
    seq_len, layout = settled.seq_len, settled.layout
    tokenizer, chat_record = batches.for_chats(load_tokenizer(model_cfg.tokenizer), train_cfg,
                                               resume=resume, say=log)
    objective = objectives.for_run(train_cfg)
    data_dir = objective.prepare(model_cfg, train_cfg, seq_len, chat_record.get("chat_template"))
    started = time.monotonic()
    meta = check_tokenizer(data_dir, model_cfg, train_cfg.model)

    model, optimizer = sharding.create_sharded(lambda: state.build(settled.model, train_cfg),
                                               layout)  # with LoRA: adapters train alone
    if note := sharding.degenerate_note(layout, nnx.state(model)):
        log(note)  # it trains, but whoever asked for a split should know what stays whole
    base = None  # the run whose weights are the adapters' frozen base
    if train_cfg.init_from and not resume:
        base = state.start_from(model, Path(train_cfg.init_from), settled.adapters, say=log)
    documents = batches.documents(tokenizer, train_cfg)
    training = objective.batches(data_dir, train_cfg, seq_len, layout, documents)
    run_dir = RunDir(train_cfg.out)
    checkpointer = Checkpointer(run_dir.checkpoints, keep=train_cfg.keep_checkpoints)
    for name in checkpointer.leftovers:
        log(f"removed {run_dir.checkpoints / name}: an incomplete checkpoint an interrupted save "
            f"left")
    devices = {"platform": jax.devices()[0].platform, "count": jax.device_count(),
               "processes": jax.process_count()}
    record = {"preset": layout.name, "tokenizer": meta["tokenizer"], "data_dir": str(data_dir),
              "data_fingerprint": batches.corpus_fingerprint(data_dir, log), "devices": devices,
              **chat_record, **({} if resume else state.record(train_cfg, base))}
    return Run(model_cfg=model_cfg, train_cfg=train_cfg, settled=settled, dir=run_dir,
               layers=pipeline.LayerOrder(layout, model_cfg.num_layers), data_dir=data_dir,
               model=model, optimizer=optimizer, checkpointer=checkpointer,
               feed=Feed(training, objective.put(layout)), objective=objective,
               tokenizer=tokenizer, documents=documents,
               rng=jax.random.key(train_cfg.seed), record=record, started=started)


def restore(run: Run) -> None:
    """Continue from the newest checkpoint that reads cleanly: weights, optimizer, step, key and
    data position. Newer ones that cannot be read are moved, unchanged, to
    `<run>/damaged-checkpoints/` so that the steps they held can be saved again."""
    restored = run.checkpointer.restore(run.model, run.optimizer)
    run.step, run.rng = restored["step"], restored["rng"]
    run.feed.set_state(restored["data_state"])
    run.checkpointer.set_aside_skipped(restored["skipped"], run.dir.damaged,
                                       writer=run.is_writer, say=log)
    log(f"resumed from {run.checkpointer.directory / str(run.step)} at step {run.step}")


def settle(run: Run, *, resume: bool) -> None:
    """Decide the configuration the loop runs with, once: a resumed run asked for another end
    goes on from the rate it has reached (`lr_schedule.continued`; a schedule whose end was
    given, `decay_steps`, or is a time budget's to decide is left alone), a budgeted run starts
    open-ended (the budget decides its end), and a run started from imported weights takes its
    own copy of their vocabulary."""
    cfg = run.train_cfg
    if resume:
        saved = run.dir.read()
        run.record = batches.resumed_record(saved.record, run.record, run.data_dir)
        if not (cfg.steps == saved.train.steps or cfg.decay_steps or cfg.time_budget
                or saved.train.time_budget):
            if cfg.steps < run.step:
                raise ConfigError(f"{run.dir.path} is at step {run.step}, past --steps "
                                  f"{cfg.steps}: give a later step to train further")
            cfg, message = lr_schedule.continued(saved.train, cfg, run.step)
            log(message)
    if cfg.time_budget:  # open-ended; the warm-up fixed now, never refitted with the end
        cfg = dataclasses.replace(cfg, steps=OPEN_ENDED, warmup_steps=run.settled.warmup_steps)
    if cfg.init_from and run.is_writer:  # an imported vocabulary goes with the weights
        kept = keep_vocabulary(run.model_cfg.tokenizer, Path(cfg.init_from), run.dir.path)
        run.model_cfg = dataclasses.replace(run.model_cfg, tokenizer=kept)
    run.train_cfg = cfg


def reconfigure(run: Run, record: dict[str, Any] | None = None, **changes: Any) -> None:
    """The one way the configuration changes once the loop runs: apply `changes` to the train
    config (and `record` to what config.json records beside it), and write config.json."""
    run.train_cfg = dataclasses.replace(run.train_cfg, **changes)
    run.record.update(record or {})
    _write_config(run)


def write_run_files(run: Run) -> None:
    """config.json (enough to rebuild the model), and metrics.jsonl cut back to the start step."""
    if not run.is_writer:
        return
    run.dir.path.mkdir(parents=True, exist_ok=True)
    _write_config(run)
    path = run.dir.metrics
    if path.exists():  # on resume, forget metrics of steps after the checkpoint: they rerun
        kept = [r for r in metrics.read_metrics(path) if r["step"] <= run.step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _write_config(run: Run) -> None:
    if run.is_writer:
        run.dir.write(run.model_cfg, run.train_cfg,
                      **{**run.record, "resolved": run.settled.record()})


def run_loop(run: Run) -> bool:
    """Train from `run.step` to `train.steps`; returns whether Ctrl-C cut the run short.

    Step k is dispatched before the metrics of step k-1 are read, so the host never waits for
    the step it just queued. Checkpoints and evaluation wait for their step to finish.
    """
    cfg = run.train_cfg
    for note in filter(None, (runtime.huge_pages_note(), runtime.gpu_flags_note())):
        log(note)
    recorder = metrics.for_run(run, say=log)
    budget = (TimeBudget(cfg.time_budget, run.started, say=log,
                         eval_share=cfg.eval_batches / (3 * cfg.eval_every))
              if cfg.time_budget else None)
    profiler = metrics.Profiler(run.dir.tensorboard, parse_step_range(
        cfg.profile_steps) if cfg.profile_steps else None)
    rates, pending = lr_schedule.lr_schedule(cfg), None
    # In a multi-process job all processes must stop at the same step to save together;
    # there Ctrl-C (or the launcher) stops them all and --resume uses the last checkpoint.
    interrupts = runtime.StopOnInterrupt() if jax.process_count() == 1 else runtime.NoInterrupts()
    try:
        with run.layout.active(), interrupts as stop:
            while run.step < run.train_cfg.steps and not stop.requested:
                profiler.before(run.step, pending and pending[1], run.checkpointer.wait)
                reported = run.objective.step(run, run.feed.take(), rates)
                run.feed.fill()  # the next batch read and placed while this step runs
                run.step += 1
                if pending is not None:  # read step k-1 while step k runs
                    _record(run, recorder, *pending)
                pending = (run.step, reported)
                profiler.after(run.step, reported)
                if budget is not None and _follow_budget(run, budget, recorder, reported):
                    rates = lr_schedule.lr_schedule(run.train_cfg)
                if _due(run, "save_every") or _due(run, "eval_every"):
                    _record(run, recorder, *pending)  # also: never save a diverged state
                    pending = None
                    with recorder.timer.pause():
                        _save_and_evaluate(run, recorder)
            if pending is not None:
                _record(run, recorder, *pending)
            interrupted = stop.requested and run.step < run.train_cfg.steps
            if interrupted:
                _save(run)
    finally:
        recorder.close_progress()  # first: any error below is printed on a line of its own
        try:
            profiler.close()
            run.checkpointer.wait()
        finally:
            recorder.close()
    return interrupted


def _follow_budget(run: Run, budget: TimeBudget, recorder: metrics.Recorder, reported) -> bool:
    """Let the time budget decide after this step; True when the schedule was refitted."""
    total = budget.check(run.step, run.train_cfg.steps, lambda: jax.block_until_ready(reported))
    end = run.train_cfg.steps if total is None else total
    if total is not None:
        recorder.set_total(total)
    if budget.out_of_time(run.step, end):
        end = run.step
    record = budget.take_record()
    if end != run.train_cfg.steps or record is not None:
        changes = {} if end == run.train_cfg.steps else dict(steps=end, time_budget=0.0)
        reconfigure(run, record=record and {"time_budget": record}, **changes)
    return total is not None


def _due(run: Run, every: str) -> bool:
    return run.step % getattr(run.train_cfg, every) == 0 or run.step == run.train_cfg.steps


def _record(run: Run, recorder: metrics.Recorder, step: int, reported) -> None:
    """Log the metrics a step reported; a non-finite loss or gradient norm stops the run."""
    values = recorder.record(step, reported)
    if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
        cfg = run.train_cfg
        raise metrics.TrainingDiverged.at(
            step, values, lr=cfg.lr, warmup=resolved.warmup_steps(cfg),
            dtype=run.settled.model.dtype,
            out=run.dir.path, latest_checkpoint=run.checkpointer.latest_step(),
            extreme=metrics.extreme_settings(run.model_cfg, cfg, values))


def _save(run: Run) -> None:
    run.checkpointer.save(run.step, run.model, run.optimizer, layout=run.layers.canonical,
                          data_state=run.feed.get_state(), rng=run.rng)


def _save_and_evaluate(run: Run, recorder: metrics.Recorder) -> None:
    if _due(run, "save_every"):
        _save(run)
    if _due(run, "eval_every"):
        recorder.record_eval(run.step, run.objective.evaluate(run))


def finish(run: Run, *, interrupted: bool, sample: bool) -> dict[str, Any]:
    """Summarise the run; a run that reached its end also gets its loss plot and a sample."""
    summary = {"out": str(run.dir.path), "step": run.step, "interrupted": interrupted,
               "checkpoint": str(run.checkpointer.directory /
                                 str(run.checkpointer.latest_step()))}
    log(f"checkpoint: {summary['checkpoint']}")
    if interrupted:
        return summary
    held_out = metrics.summarise(run.dir, summary) if run.is_writer else None
    if sample:
        run.layers.leave(run.model)  # generation runs the layers in the model's order
        with run.layout.replace(pipeline=sharding.Pipeline()).active():
            story = generate(run.model, run.tokenizer, ["Once upon a time"],
                             max_new_tokens=100, temperature=0.8, top_k=50,
                             rng=jax.random.key(run.train_cfg.seed))[0]
        log(f"sample:\n{story}")
    if held_out is not None:  # the run's last word: how well it does on text it never saw
        log(f"held out at step {held_out['step']}: {metrics.describe_eval(held_out)}")
    return summary
