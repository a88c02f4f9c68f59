"""The training command line's flags, and the refusals that need no JAX.

`build_parser` is `python -m minigpt.train`'s flags. `early_refusal` checks what can be checked
from files alone (a preset or recipe name that names no file, a run to resume or start from that
does not exist) before anything heavy is imported, so a typo is refused in a fraction of a second
instead of after JAX has started; everything else is checked where it is used
(`minigpt.train.cli`, the trainer). This module imports nothing of minigpt but the config and
the file helpers, neither of which imports JAX.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from minigpt.config import TrainConfig
from minigpt.files import read_named_toml, shipped_folder


def build_parser() -> argparse.ArgumentParser:
    """The flags; each help text names the default a new run gets (the config's, or the
    recipe's when one is given; a resumed run keeps its own). It is long because each flag is
    a statement of its own, read as a list."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m minigpt.train",
                                description="Train a model of the zoo under a parallelism preset.")
    p.add_argument("--recipe", help="a named way to train (a file in recipes/, e.g. "
                                    "stories-cpu, or a .toml path): model, tokenizer and "
                                    "settings; the other flags override it")
    p.add_argument("--time-budget", metavar="DURATION",
                   help="train for this long (e.g. 10m, 90s, 1h; compilation included) with "
                        "the learning-rate schedule fitted to it, instead of --steps")
    p.add_argument("--tokenizer", help="gpt2, a shipped vocabulary (tinystories-4k) or a "
                                       ".tiktoken file; sets the model's vocabulary to match "
                                       "(default: the model's own)")
    p.add_argument("--preset", help=f"parallelism preset: a name in presets/ or a .toml path, "
                                    f"or auto: the fastest that fits (default {d.preset})")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="with --preset auto, choose for devices of this memory, e.g. 16GiB or "
                        "80GB (default: what the devices report; on a CPU the machine's share)")
    p.add_argument("--model", help=f"model name from the zoo (default {d.model})")
    p.add_argument("--data", nargs="+", help=f"'tinystories', 'tinystories-v2' or text files "
                                             f"(default {d.data[0]})")
    p.add_argument("--steps", type=int, help=f"train to this step (default {d.steps}; on "
                                             f"--resume: a new end, see docs/training.md)")
    p.add_argument("--batch-size", type=int, help=f"global batch in sequences "
                                                  f"(default {d.batch_size})")
    p.add_argument("--seq-len", type=int, help="training context (default: the model's)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr:g})")
    p.add_argument("--seed", type=int, help=f"(default {d.seed})")
    p.add_argument("--out", help=f"run directory (default {d.out})")
    p.add_argument("--init-from", metavar="RUN",
                   help="start a new run from RUN's latest weights (trained here, or imported "
                        "with python -m minigpt.hub): its model and tokenizer, a fresh "
                        "optimizer, step 0")
    p.add_argument("--objective", choices=("lm", "dpo", "grpo"),
                   help="what the run learns: lm, the next token of text or chats (default); "
                        "dpo, preference pairs from --data prefs.jsonl against a frozen "
                        "reference; grpo, rewards (--reward) of its own completions to the "
                        "prompts of --data prompts.jsonl (docs/post_training.md)")
    p.add_argument("--reward", action="append", metavar="FILE.py:FUNC",
                   help="with --objective grpo: a reward function, f(prompts, completions, "
                        "**columns) -> list of floats (TRL's signature); repeat for several")
    p.add_argument("--reference", metavar="RUN",
                   help="with --objective dpo: the run whose weights are the reference "
                        "(default: the --init-from run's, as they are at the start)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint "
                                                         "(the flags that started it may stay)")
    p.add_argument("--devices", type=int, default=0,
                   help="simulate this many CPU devices, to try any preset on a laptop "
                        "(default: the devices present; a resumed run: as many as it was "
                        "trained on)")
    p.add_argument("--eval-every", type=int, help=f"(default {d.eval_every})")
    p.add_argument("--log-every", type=int,
                   help=f"steps between the progress line's figures (default {d.log_every}); "
                        f"metrics.jsonl has a row for every step")
    p.add_argument("--save-every", type=int, help=f"(default {d.save_every})")
    p.add_argument("--no-sample", action="store_true",
                   help="do not tell a sample story at the end")
    p.add_argument("--no-memory-check", action="store_true",
                   help="train even where the planner expects the step not to fit the devices' "
                        "memory (python -m minigpt.plan shows its estimate)")
    p.add_argument("--profile-steps", help="'a:b': write a profiler trace of steps a..b-1 "
                                           "(into <out>/tensorboard, for its profile plugin)")
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




def early_refusal(argv: Sequence[str]) -> str | None:
    """Why the command line cannot train, where files alone tell (see the module docstring), or
    None. Argument errors (an unknown flag, a malformed number) exit as argparse exits them."""
    args = build_parser().parse_args(argv)
    for kind, name in (("preset", args.preset), ("recipe", args.recipe)):
        if name and name != "auto":
            try:
                read_named_toml(name, shipped_folder(f"{kind}s"), kind, ValueError)
            except ValueError as error:
                return str(error)
    if args.resume:
        out = Path(args.out or TrainConfig.out)
        if not (out / "config.json").is_file():
            return (f"cannot resume {out}: it holds no run (no config.json); give the --out of "
                    f"a run trained before, or drop --resume to start one")
    for flag, run in (("--init-from", args.init_from), ("--reference", args.reference)):
        if run and not (Path(run) / "config.json").is_file():
            return (f"{flag} {run} is not a run directory (one trained here, or made by "
                    f"python -m minigpt.hub import)")
    return None
