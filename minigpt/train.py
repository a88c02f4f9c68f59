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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt import sharding, steps
from minigpt.checkpoint import Checkpointer, CheckpointError
from minigpt.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    load_run_config,
    parse_step_range,
    save_run_config,
)
from minigpt.metrics import MetricsLog, device_peak, flops_per_token, plot_losses, read_metrics
from minigpt.models import build_model, get_config
from minigpt.runtime import join_job, relaunch_with_huge_pages, set_simulated_devices


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


def check_batch(train_cfg: TrainConfig, preset: sharding.Preset, mesh) -> None:
    ways = sharding.batch_divisor(preset, mesh)
    per_micro = train_cfg.batch_size // train_cfg.microbatches
    if per_micro % ways or train_cfg.batch_size % jax.process_count():
        raise ConfigError(
            f"batch size {train_cfg.batch_size} with {train_cfg.microbatches} microbatch(es) "
            f"gives {per_micro} sequences per microbatch, which preset {preset.name!r} must "
            f"split {ways} ways over its batch axes {preset.mesh_axes_of('batch')}: choose a "
            f"batch size that is a multiple of {ways * train_cfg.microbatches}")


def evaluate(model, data_dir: Path, train_cfg: TrainConfig, seq_len: int, batch_put) -> float:
    """Mean loss over the first `eval_batches` batches of the validation split (fixed order)."""
    from minigpt.data import batch_iterator

    it = batch_iterator(data_dir, "val", seq_len=seq_len, batch_size=train_cfg.batch_size,
                        seed=0, shuffle=False, process_index=jax.process_index(),
                        process_count=jax.process_count())
    losses = [steps.eval_step(model, batch_put(next(it))) for _ in range(train_cfg.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


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


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, *, resume: bool = False,
          sample: bool = True) -> dict[str, Any]:
    """Train (or continue training) a model; returns a summary of the run."""
    from minigpt.data import batch_iterator, load_meta

    out = Path(train_cfg.out)
    seq_len = train_cfg.seq_len or model_cfg.context_len
    if seq_len > model_cfg.context_len:
        raise ConfigError(f"train.seq_len {seq_len} exceeds the model's context "
                          f"{model_cfg.context_len}")
    preset = sharding.load_preset(train_cfg.preset)
    mesh = sharding.make_mesh(preset)
    check_batch(train_cfg, preset, mesh)
    data_dir = _prepare_data(train_cfg)
    meta = load_meta(data_dir)

    model, optimizer = init_state(model_cfg, train_cfg, preset, mesh)
    checkpointer = Checkpointer(out / "checkpoints", keep=train_cfg.keep_checkpoints)
    rng = jax.random.key(train_cfg.seed)
    it = batch_iterator(data_dir, "train", seq_len=seq_len, batch_size=train_cfg.batch_size,
                        seed=train_cfg.seed, process_index=jax.process_index(),
                        process_count=jax.process_count())
    start = 0
    if resume:
        restored = checkpointer.restore(model, optimizer)
        start, rng = restored["step"], restored["rng"]
        it.set_state(restored["data_state"])
        log(f"resumed from {checkpointer.directory / str(start)} at step {start}")
    is_writer = jax.process_index() == 0
    if is_writer:
        out.mkdir(parents=True, exist_ok=True)
        save_run_config(out / "config.json", model_cfg, train_cfg, preset=preset.name,
                        tokenizer=meta["tokenizer"], data_dir=str(data_dir))
        _drop_records_after(out / "metrics.jsonl", start)

    batch_put = sharding.put_batch_fn(preset, mesh)
    schedule = steps.lr_schedule(train_cfg)
    tokens_per_step = train_cfg.batch_size * seq_len
    peak, peak_source = device_peak(model_cfg.dtype)
    flops = flops_per_token(model_cfg, seq_len)
    metrics_log = MetricsLog(out / "metrics.jsonl", enabled=is_writer)
    profile = parse_step_range(train_cfg.profile_steps) if train_cfg.profile_steps else None
    progress = _progress_bar(start, train_cfg.steps) if is_writer else None
    timer = _StepTimer()
    log(f"preset {preset.name} on mesh {dict(mesh.shape)}; {tokens_per_step:,} tokens/step; "
        f"MFU against {peak / 1e12:.2f} TFLOP/s per device ({peak_source})")

    def record(step: int, metrics: dict[str, jax.Array]) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed = timer.lap()
        entry = {"step": step + 1, **values}
        if elapsed is not None:
            entry["tokens_per_s"] = tokens_per_step / elapsed
            entry["mfu"] = flops * entry["tokens_per_s"] / (peak * mesh.size)
        metrics_log.write(entry)
        if progress is not None:
            progress.update(1)
            if (step + 1) % train_cfg.log_every == 0 and elapsed is not None:
                progress.set_postfix(loss=f"{values['loss']:.3f}",
                                     tok_s=f"{entry['tokens_per_s']:,.0f}",
                                     mfu=f"{entry['mfu']:.3f}")

    pending, done, data_state, tracing = None, start, it.get_state(), False
    try:
        # In a multi-process job all processes must stop at the same step to save together;
        # there Ctrl-C (or the launcher) stops them all and --resume uses the last checkpoint.
        interrupts = _StopOnInterrupt() if jax.process_count() == 1 else _NoInterrupts()
        with sharding.use_preset(preset, mesh), interrupts as stop:
            for step in range(start, train_cfg.steps):
                if stop.requested:
                    break
                if profile and step == profile[0]:
                    # The trace holds steps a..b-1 and nothing before: no step still running,
                    # no checkpoint still being written.
                    if pending is not None:
                        jax.block_until_ready(pending[1])
                    checkpointer.wait()
                    jax.profiler.start_trace(str(out / "profile"))
                    tracing = True
                batch = batch_put(next(it))
                metrics = steps.train_step(model, optimizer, batch, rng,
                                           microbatches=train_cfg.microbatches, schedule=schedule)
                data_state, done = it.get_state(), step + 1
                if pending is not None:  # read step k-1 while step k runs
                    record(*pending)
                pending = (step, metrics)
                if tracing and done == profile[1]:
                    jax.block_until_ready(metrics)  # step b-1 runs to its end inside the trace
                    jax.profiler.stop_trace()
                    tracing = False
                save = done % train_cfg.save_every == 0 or done == train_cfg.steps
                evaluate_now = done % train_cfg.eval_every == 0 or done == train_cfg.steps
                if save or evaluate_now:
                    jax.block_until_ready(metrics)  # the step's own time stays in its timing
                if save:
                    with timer.pause():
                        checkpointer.save(done, model, optimizer, data_state=data_state, rng=rng)
                if evaluate_now:
                    with timer.pause():
                        eval_loss = evaluate(model, data_dir, train_cfg, seq_len, batch_put)
                    metrics_log.write({"step": done, "eval_loss": eval_loss,
                                       "eval_perplexity": math.exp(min(eval_loss, 50))})
                    if progress is not None:
                        progress.write(f"step {done}: eval loss {eval_loss:.4f}")
            if pending is not None:
                record(*pending)
            interrupted = stop.requested and done < train_cfg.steps
            if interrupted:
                checkpointer.save(done, model, optimizer, data_state=data_state, rng=rng)
    finally:
        if tracing:  # the run ended (or stopped) before step b: keep what was traced
            jax.profiler.stop_trace()
        checkpointer.wait()
        metrics_log.close()
        if progress is not None:
            progress.close()

    summary = {"out": str(out), "step": done, "interrupted": interrupted,
               "checkpoint": str(checkpointer.directory / str(checkpointer.latest_step()))}
    log(f"checkpoint: {summary['checkpoint']}")
    if is_writer and not interrupted:
        records = read_metrics(out / "metrics.jsonl")
        plot_losses(records, out / "loss.png")
        summary["final_loss"] = next((r["loss"] for r in reversed(records) if "loss" in r), None)
        summary["eval_loss"] = next(
            (r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
    if sample and not interrupted:
        _print_sample(model, meta["tokenizer"], preset, mesh)
    return summary


def _prepare_data(train_cfg: TrainConfig) -> Path:
    """Download and tokenize on first use. In a multi-process job process 0 goes first and the
    others wait, then reuse its files (shared file system) or prepare their own copy."""
    from minigpt.data import resolve_data

    if jax.process_count() == 1:
        return resolve_data(train_cfg.data, train_cfg.data_root)
    from jax.experimental import multihost_utils

    data_dir = resolve_data(train_cfg.data, train_cfg.data_root) if jax.process_index() == 0 \
        else None
    multihost_utils.sync_global_devices("minigpt: data prepared by process 0")
    return data_dir or resolve_data(train_cfg.data, train_cfg.data_root)


def _drop_records_after(path: Path, step: int) -> None:
    """On resume, forget metrics of steps after the checkpoint: they will be run again."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def _progress_bar(start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _print_sample(model, tokenizer_name: str, preset, mesh) -> None:
    from minigpt.generate import generate
    from minigpt.tokenizer import load_tokenizer

    with sharding.use_preset(preset, mesh):
        story = generate(model, load_tokenizer(tokenizer_name), ["Once upon a time"],
                         max_new_tokens=100, temperature=0.8, top_k=50, rng=jax.random.key(0))[0]
    log(f"sample:\n{story}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minigpt.train", description=__doc__.split("\n")[0])
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
    """Configs from flags; on --resume, the run's saved configs with the flags given on top."""
    given = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()
             if getattr(args, flag) is not None}
    if "data" in given:
        given["data"] = tuple(given["data"])
    out = Path(args.out or TrainConfig.out)
    if args.resume:
        saved = load_run_config(out / "config.json")
        model_cfg = saved["model"]
        train_cfg = TrainConfig(**{**saved["train"], "data": tuple(saved["train"]["data"]),
                                   **given})
        wanted = get_config(args.model) if args.model else model_cfg
        wanted, train_cfg = apply_overrides(wanted, train_cfg, args.set)
        differing = [f.name for f in dataclasses.fields(ModelConfig)
                     if getattr(wanted, f.name) != getattr(model_cfg, f.name)]
        if differing:
            details = ", ".join(f"{n}: {getattr(model_cfg, n)!r} -> {getattr(wanted, n)!r}"
                                for n in differing)
            raise ConfigError(f"cannot resume {out} with a different model ({details}); "
                              f"drop those options or train into a new --out")
        return model_cfg, train_cfg
    model_cfg = get_config(args.model or TrainConfig.model)
    train_cfg = TrainConfig(**{**given, "model": args.model or TrainConfig.model})
    return apply_overrides(model_cfg, train_cfg, args.set)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    if args.distributed or any(v is not None for v in (
            args.coordinator, args.num_processes, args.process_id)):
        join_job(args.coordinator, args.num_processes, args.process_id)
    from minigpt.data import DataError
    from minigpt.tokenizer import TokenizerError

    try:
        model_cfg, train_cfg = resolve_configs(args)
        out = Path(train_cfg.out)
        if not args.resume and (out / "checkpoints").is_dir() and any(
                (out / "checkpoints").iterdir()):
            raise ConfigError(f"{out} already holds checkpoints: pass --resume to continue it, "
                              f"or choose another --out")
        summary = train(model_cfg, train_cfg, resume=args.resume, sample=not args.no_sample)
    except (ConfigError, sharding.PresetError, CheckpointError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    relaunch_with_huge_pages()
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
