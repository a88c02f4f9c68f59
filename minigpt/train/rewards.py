"""Reward functions for GRPO, named on the command line as `--reward FILE.py:FUNC`.

A reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float |
None]`, so TRL's reward functions and reasoning-gym's scorers work unchanged: `prompts` and
`completions` are lists (strings, or for conversational prompts lists of messages, the
completion `[{"role": "assistant", "content": text}]`), `completion_ids` the completions' token
ids, and every other column of the prompts file comes as a list of its values, one per
completion, as TRL passes them. None means "not mine to score" (TRL's NaN, left out of the sums).

Everything a reward can get wrong is one line naming the file and function: a file that does
not import, a function it does not define, one that raises, runs past `timeout` seconds,
returns a count other than one per completion, a NaN, or something that is not a number. A
raising or hanging reward stops the run (`RewardError`); the trainer saves a checkpoint first.
"""

from __future__ import annotations

import importlib.util
import math
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minigpt.errors import UserError
from minigpt.files import first_line


class RewardError(UserError):
    """A reward function that cannot be loaded, or that failed on a batch."""


class Reward:
    """One reward function, loaded from `FILE.py:FUNC`; `name` is the function's `__name__`
    (TRL's metric names: `rewards/<name>/mean`)."""

    def __init__(self, spec: str):
        path, sep, func = spec.rpartition(":")
        if not sep or not path or not func:
            raise RewardError(f"--reward {spec!r}: name a function in a file, FILE.py:FUNC")
        self.spec, self.path = spec, Path(path)
        if not self.path.is_file():
            raise RewardError(f"--reward {spec}: {self.path} does not exist")
        module_name = f"minigpt_reward_{abs(hash(str(self.path.resolve())))}"
        try:
            loader = importlib.util.spec_from_file_location(module_name, self.path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up
            loader.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # whatever the user's file raises on import
            raise RewardError(f"--reward {spec}: {self.path} does not import: "
                              f"{type(error).__name__}: {first_line(error)}") from None
        self.function = getattr(module, func, None)
        if not callable(self.function):
            raise RewardError(f"--reward {spec}: {self.path} defines no function {func!r}")
        self.name = getattr(self.function, "__name__", func)

    def __call__(self, count: int, timeout: float, arguments: dict[str, Any]) -> list[float]:
        """The function's rewards of `count` completions (NaN for None), stopped after
        `timeout` seconds: on the main thread by a timer signal (so rewards that time their
        own work with SIGALRM, as math_verify does, run as under TRL), elsewhere on a thread
        of its own."""
        where = f"reward {self.spec}"
        late = RewardError(f"{where} ran past {timeout:g} s (train.reward_timeout) on a batch "
                           f"of {count} completions")
        try:
            value = (_on_main_thread if _can_signal() else _on_a_thread)(
                lambda: self.function(**arguments), timeout, late)
        except RewardError:
            raise
        except (Exception, SystemExit) as error:  # whatever the user's function raises
            raise RewardError(f"{where} raised {type(error).__name__}: "
                              f"{first_line(error)}") from None
        return _checked(value, count, where)


def _can_signal() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _on_main_thread(call, timeout: float, late: RewardError):
    def expired(signum, frame):
        raise late

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _on_a_thread(call, timeout: float, late: RewardError):
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - raised again below
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise late
    if "error" in box:
        raise box["error"]
    return box["value"]


def _checked(value: Any, count: int, where: str) -> list[float]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise RewardError(f"{where} returned {type(value).__name__}, not a list of {count} "
                          f"numbers (or None)")
    if len(value) != count:
        raise RewardError(f"{where} returned {len(value)} rewards for {count} completions")
    rewards = []
    for i, r in enumerate(value):
        if r is None:
            rewards.append(math.nan)
            continue
        if isinstance(r, bool) or not isinstance(r, (int, float)) and not hasattr(r, "__float__"):
            raise RewardError(f"{where} returned {r!r} for completion {i}: rewards are numbers "
                              f"(or None)")
        if not math.isfinite(float(r)):
            raise RewardError(f"{where} returned {float(r)} for completion {i}: rewards must "
                              f"be finite (None leaves a completion unscored)")
        rewards.append(float(r))
    return rewards


def load(specs: Sequence[str], weights: Sequence[float]) -> list[Reward]:
    """The rewards a run scores with, checked against their weights (one each, or none: 1)."""
    if not specs:
        raise RewardError("--objective grpo scores completions with --reward FILE.py:FUNC "
                          "(give one or more)")
    if weights and len(weights) != len(specs):
        raise RewardError(f"train.reward_weights has {len(weights)} weights for "
                          f"{len(specs)} --reward functions")
    rewards = [Reward(spec) for spec in specs]
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        raise RewardError(f"two --reward functions share a name ({', '.join(names)}): their "
                          f"metrics would be one")
    return rewards


def score(rewards: Sequence[Reward], weights: Sequence[float], timeout: float,
          arguments: dict[str, Any]) -> tuple[list[float], dict[str, list[float]]]:
    """Each completion's reward (the weighted sum of the functions' rewards, those that
    returned None left out, as TRL sums them; NaN where none scored it, which TRL 1.16 leaves
    out of its group's figures too) and each function's own rewards."""
    count = len(arguments["completions"])
    each = {r.name: r(count, timeout, arguments) for r in rewards}
    weights = list(weights) or [1.0] * len(rewards)
    total = [sum(w * v[i] for w, v in zip(weights, each.values()) if not math.isnan(v[i]))
             if any(not math.isnan(v[i]) for v in each.values()) else math.nan  # unscored
             for i in range(count)]
    return total, each



