"""The learning-rate schedule: warm-up, an optional hold at the peak, a cosine to the floor.

`lr_schedule(cfg)` reads it off a TrainConfig; the compiled train step receives it as numbers
(`LRSchedule` is a pytree), so a time budget that moves its end (`minigpt.train.budget`) or a
resumed run that changes its end (`continued`) runs the same compiled step."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from minigpt.config import TrainConfig
from minigpt.runs import resolved


@functools.partial(jax.tree_util.register_dataclass, data_fields=(
    "peak", "floor", "warmup", "decay_start", "decay_from", "decay_end"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The learning rate at each step: a linear warm-up to `peak` over `warmup` steps (starting
    at peak / warmup, so the first step already learns), `peak` until `decay_start`, then a
    cosine from `decay_from` down to `floor` at step `decay_end`, and `floor` after.

    The values are a pytree of numbers the compiled step receives as arguments, not constants
    compiled into it: a time budget that moves `decay_end`, or a resumed run that starts a new
    decay, runs the same compiled step with other numbers.
    """

    peak: float
    floor: float
    warmup: int
    decay_start: int  # at least `warmup`: a warm-up-stable-decay schedule holds the peak between
    decay_from: float  # the peak, or the rate an extended run had reached when it was extended
    decay_end: int

    def __call__(self, step):
        step = jnp.asarray(step, jnp.float32)
        warm = self.peak * (step + 1) / jnp.maximum(self.warmup, 1)
        span = jnp.maximum(jnp.asarray(self.decay_end, jnp.float32) - self.decay_start, 1.0)
        progress = jnp.clip((step - self.decay_start) / span, 0.0, 1.0)
        cosine = self.floor + (self.decay_from - self.floor) * 0.5 * (
            1 + jnp.cos(math.pi * progress))
        return jnp.where(step < self.warmup, warm,
                         jnp.where(step < self.decay_start, self.peak, cosine))


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    warmup, end = resolved.warmup_steps(cfg), cfg.decay_steps or cfg.steps
    start = cfg.decay_start
    if start < 0 and cfg.decay_fraction:  # warm-up-stable-decay: the last part of the run
        start = end - round(cfg.decay_fraction * end)
    return LRSchedule(peak=cfg.lr, floor=cfg.lr * cfg.min_lr_ratio, warmup=warmup,
                      decay_start=max(start, warmup), decay_from=cfg.decay_start_lr or cfg.lr,
                      decay_end=end)


def continued(saved: TrainConfig, wanted: TrainConfig, step: int) -> tuple[TrainConfig, str]:
    """How a run resumed at `step` with another end (`wanted.steps`, its saved one was
    `saved.steps`) goes on, and a line saying so: from the learning rate it has reached, a new
    cosine to the floor at the new end, so the rate never jumps. A run still warming up or
    holding its peak (warm-up-stable-decay) goes on doing so and decays from the peak where the
    new end puts its decay. The warm-up keeps its saved length."""
    warmup, rates = resolved.warmup_steps(saved), lr_schedule(saved)
    rate = float(rates(step))
    if step < rates.decay_start:  # not decaying yet: decay where the new end says
        fresh = lr_schedule(dataclasses.replace(wanted, warmup_steps=warmup, decay_start=-1,
                                                decay_start_lr=0.0))
        start, start_lr = max(step, fresh.decay_start), saved.lr
    else:
        start, start_lr = step, rate
    cfg = dataclasses.replace(wanted, warmup_steps=warmup, decay_start=start,
                              decay_start_lr=start_lr)
    first = ""  # a run still warming up, or holding its peak, goes on doing so first
    if step < warmup:
        first += f", warms up to {saved.lr:.3g} by step {warmup}"
    if start > max(step, warmup):
        first += f", holds at {saved.lr:.3g} until step {start}"
    return cfg, (f"the run now ends at step {cfg.steps} instead of {saved.steps}: the learning "
                 f"rate goes on from {rate:.3g} (its value at step {step}){first} and "
                 f"{'then ' if first else ''}"
                 f"{_course(start_lr, cfg.lr * cfg.min_lr_ratio, start, cfg.steps)}")


def _course(start_lr: float, floor: float, start: int, end: int) -> str:
    """What a cosine from `start_lr` at step `start` to `floor` at step `end` does, in words."""
    if math.isclose(start_lr, floor, rel_tol=1e-6):
        return f"holds at {floor:.3g} until step {end}"
    way = "decays" if floor < start_lr else "rises"
    return f"{way} by a cosine from {start_lr:.3g} at step {start} to {floor:.3g} at step {end}"
