"""The planner: which preset fits a model on these devices, and which is fastest, before a run.

`python -m minigpt.plan` prints a table over every shipped preset (`cli`); `python -m
minigpt.train --preset auto` trains with the fastest that fits (`auto`). From Python:

    estimates = minigpt.plan.plan_all(model_cfg, train_cfg, devices=8, device_memory=16 * 2**30)
    one = minigpt.plan.estimate(model_cfg, train_cfg, "fsdp", devices=8)

Each `Estimate` says whether the preset applies (and the trainer's reason where not), the bytes
per device of parameters, gradients, optimizer state and activations at the step's peak
(`memory`), whether they fit, and an estimated step time (`speed`). Nothing is compiled: the
model and optimizer are built abstractly, one layer is traced (`activations`), and the presets'
rules give each device's share (`layout`). `compiled` checks a plan against what XLA allocates
for the real train step.
"""

from minigpt.plan.auto import Choice, Preflight, budget, choose, preflight, resolve
from minigpt.plan.memory import Memory
from minigpt.plan.planner import HEADROOM, Estimate, estimate, make_subject, plan_all
from minigpt.plan.sizes import format_size, parse_size
from minigpt.plan.speed import Device, Speed, device

__all__ = ["HEADROOM", "Choice", "Device", "Estimate", "Memory", "Preflight", "Speed", "budget",
           "choose", "device", "estimate", "format_size", "make_subject", "parse_size",
           "plan_all", "preflight", "resolve"]
