"""Learning per wall-clock minute: train for a time budget, then score held-out stories.

Each run trains with `python -m minigpt.train ... --time-budget B` (compilation counts against the
budget) on text disjoint from the scored stories, then is scored on held-out TinyStories stories
in bits per byte (the same text for every tokenizer, so GPT-2's and TinyStories' vocabularies
compare fairly) and in nats per token of its own tokenizer, with the tokens it saw and three
sample stories.

Data, from the shared TinyStories files (MINIGPT_ASSETS, default ../shared/assets):
- held out: the last 1,000 stories of TinyStories-subset-3k.txt that appear nowhere in the
  training text (ASCII-normalised text; the two train heads are also what the tinystories-4k
  vocabulary was learnt from);
- held out too, scored beside it: the last 300 stories of TinyStoriesV2-GPT4-train-head.txt as
  written (GPT-4's stories, with their curly quotes and dashes), removed from the training text;
- training: TinyStories-train-head.txt, the rest of TinyStoriesV2-GPT4-train-head.txt and the
  rest of the subset (minus any story that is also held out), all of it: the runs' own
  validation split (their eval_loss) is the held-out stories, not a tenth of this text. About
  1.2 M tokens of tinystories-4k, so a ten-minute run reads it about five times.
Each held-out story is scored on its own, from its first token (predicted after <|endoftext|>,
as in training), over its first 256 GPT-2 tokens of text; longer than the model's context, the
rest is scored with a sliding window.

Each run also saves a checkpoint every --curve-every steps; each is scored on the first 200
held-out stories and drawn against its seconds of training (compilation and steps, from the
run's metrics) in a PNG beside RESULTS.md, so the time to reach a given bits per byte is read off
a picture.

    python bench/bench_stories.py --budget 10m \\
        --run "stories-cpu=--recipe stories-cpu" \\
        --run "minigpt=--model minigpt --batch-size 32"

`--steps N` trains each run for N steps instead of a time budget: a screen of changes that do
not change the step's speed (an initialisation, a norm, a rate) then compares learning alone,
however busy the machine was while each ran. `--every-nth-story N` trains on a part of the
text, to see what the score owes to how often a run reads the same stories.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import RESULTS, append_section, table  # noqa: E402
from minigpt.checkpoint import Checkpointer  # noqa: E402
from minigpt.data import prepare  # noqa: E402
from minigpt.data.stories import StoryFile  # noqa: E402
from minigpt.generate import generate, load_for_generation  # noqa: E402
from minigpt.tokenizer import load_tokenizer  # noqa: E402
from minigpt.train import cli  # noqa: E402
from minigpt.train.metrics import run_training_seconds  # noqa: E402

HELD_OUT = 1000
HELD_OUT_V2 = 300
CURVE_STORIES = 200
SCORED_GPT2_TOKENS = 256
SUBSET = "TinyStories-subset-3k.txt"
TRAIN_HEADS = ("TinyStories-train-head.txt", "TinyStoriesV2-GPT4-train-head.txt")
PROMPTS = ("Once upon a time", "One day, a little girl named Lily", "Tom and his dog")


def read_stories(path: Path) -> list[str]:
    return [s for batch, _ in StoryFile(path).batches() for s in batch if s.strip()]


def write_stories(path: Path, stories: list[str]) -> None:
    path.write_text("".join(f"{s.strip()}\n<|endoftext|>\n" for s in stories), encoding="utf-8")


def split_stories(assets: Path, work: Path,
                  every: int = 1) -> tuple[list[Path], Path, list[str], list[str]]:
    """Write the training text (with `every` > 1, one file of every such story of it, from the
    first) and a file of the held-out stories under `work`; return the training files, that
    file and the two held-out sets."""
    heads = [read_stories(assets / name) for name in TRAIN_HEADS]
    v2_held = heads[1][-HELD_OUT_V2:]
    heads[1] = heads[1][:-HELD_OUT_V2]
    seen = {s.strip() for stories in heads for s in stories}
    subset = read_stories(assets / SUBSET)
    held: list[str] = []
    for story in reversed(subset):
        if len(held) == HELD_OUT:
            break
        if story.strip() not in seen:
            held.append(story)
    held.reverse()
    held_set = {s.strip() for s in held}
    rest = [s for s in subset[:len(subset) - len(held)] if s.strip() not in held_set]
    work.mkdir(parents=True, exist_ok=True)
    held_file = work / "held-out.txt"
    write_stories(held_file, held + v2_held)
    if every > 1:
        files = [work / f"train-every-{every}.txt"]
        write_stories(files[0], (heads[0] + heads[1] + rest)[::every])
        return files, held_file, held, v2_held
    files = [assets / TRAIN_HEADS[0], work / "v2-train.txt", work / "subset-train.txt"]
    write_stories(files[1], heads[1])
    write_stories(files[2], rest)
    return files, held_file, held, v2_held


def prepared(train_args: list[str], files: list[Path], held_file: Path, root: Path) -> Path:
    """The training text tokenized as the run's model reads it, every story of it in the train
    split and the held-out stories as the validation split (prepared once per tokenizer and
    choice of text)."""
    model_cfg, _ = cli.resolve_configs(cli.build_parser().parse_args(train_args))
    tag = hashlib.sha256(repr([model_cfg.tokenizer, *map(str, files)]).encode()).hexdigest()[:8]
    out = root / f"bench-{Path(model_cfg.tokenizer).stem}-{tag}"
    prepare.prepare(out, files, val_files=[held_file], tokenizer=model_cfg.tokenizer)
    return out


def scored_text(stories: list[str]) -> list[str]:
    """Each story cut to its first SCORED_GPT2_TOKENS GPT-2 tokens (the same text for every
    tokenizer)."""
    gpt2 = load_tokenizer("gpt2")
    return [gpt2.decode(gpt2.encode_ordinary(s.strip())[:SCORED_GPT2_TOKENS]) for s in stories]


def windows(row: list[int], context: int) -> list[tuple[list[int], list[int], int]]:
    """(inputs, targets, first scored position) windows covering every target of `row` once,
    each target seen with as much preceding context as fits."""
    targets = len(row) - 1
    out, done = [], 0
    while done < targets:
        end = min(done + context, targets) if done == 0 else min(done + context // 2, targets)
        start = max(0, end - context)
        out.append((row[start:end], row[start + 1:end + 1], done - start))
        done = end
    return out


@nnx.jit
def _token_nats(model, inputs, targets):
    logits = model(inputs).astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def score(model, tokenizer, texts: list[str], batch: int = 16) -> dict[str, float]:
    """Summed next-token loss over every token of every text, each text scored on its own."""
    context = model.config.context_len
    pieces = []
    for text in texts:
        pieces += windows([tokenizer.eot_token] + tokenizer.encode_ordinary(text), context)
    nats, tokens = 0.0, 0
    for i in range(0, len(pieces), batch):
        group = pieces[i:i + batch]
        inputs = np.full((batch, context), tokenizer.eot_token, np.int32)
        targets = np.zeros((batch, context), np.int32)
        mask = np.zeros((batch, context), bool)
        for r, (x, y, first) in enumerate(group):
            inputs[r, :len(x)], targets[r, :len(y)] = x, y
            mask[r, first:len(y)] = True
        per_token = np.asarray(_token_nats(model, jnp.asarray(inputs), jnp.asarray(targets)))
        nats += float(per_token[mask].sum())
        tokens += int(mask.sum())
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"nats_per_token": nats / tokens, "bits_per_byte": nats / math.log(2) / text_bytes,
            "tokens": tokens, "bytes": text_bytes}


def train(args: list[str], length: list[str], data: list[Path], out: Path,
          curve_every: int) -> float:
    command = [sys.executable, "-m", "minigpt.train", *args, *length,
               "--data", *map(str, data), "--set", f"data_root={out.parent.parent / 'data'}",
               "--set", f"save_every={curve_every}", "--set", "keep_checkpoints=100000",
               "--out", str(out), "--no-sample"]
    print("$", shlex.join(command), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, env=env)
    return time.perf_counter() - start


def curve(out: Path, model, tokenizer, texts: list[str]) -> list[tuple[float, float]]:
    """(seconds of training, bits per byte on `texts`) at each checkpoint of a run, restored
    in turn into `model` (the run's, as loaded for scoring)."""
    seconds = run_training_seconds(out)
    checkpointer = Checkpointer(out / "checkpoints", read_only=True)
    points = []
    for step in checkpointer.all_steps():
        checkpointer.restore(model, step=step)
        points.append((seconds[step], score(model, tokenizer, texts)["bits_per_byte"]))
    checkpointer.close()
    return points


def plot(curves: dict[str, list[tuple[float, float]]], path: Path, span: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in curves.items():
        ax.plot(*zip(*points), marker="o", markersize=3, label=name)
    ax.set_xlabel("seconds of training (compilation and steps, one CPU device)")
    ax.set_ylabel(f"held-out bits per byte ({CURVE_STORIES} stories)")
    ax.set_title(f"Learning in {span}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", default="10m", help="training time per run (default 10m)")
    p.add_argument("--steps", type=int,
                   help="train each run for this many steps instead of a time budget")
    p.add_argument("--run", action="append", required=True, metavar="NAME=TRAIN ARGS",
                   help="a run: a name and the minigpt.train arguments it trains with")
    p.add_argument("--work", default="bench-stories", help="where runs and data go")
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--curve-every", type=int, default=100,
                   help="steps between the checkpoints the learning curve is scored at")
    p.add_argument("--every-nth-story", type=int, default=1, metavar="N",
                   help="train on every Nth story of the training text only (default 1: all "
                        "of it), to see what the score owes to the amount of text")
    p.add_argument("--plot", default="",
                   help="the curve's PNG (default: bench/stories-BUDGET.png when recording; "
                        "'none' for no picture)")
    args = p.parse_args()
    assets = Path(os.environ.get("MINIGPT_ASSETS", REPO.parent / "shared" / "assets"))
    assets = assets / "tinystories"
    if not (assets / SUBSET).is_file():
        sys.exit(f"error: {assets / SUBSET} not found: set MINIGPT_ASSETS to the offline "
                 f"assets directory")
    work = Path(args.work).resolve()
    files, held_file, held, v2_held = split_stories(assets, work / "text", args.every_nth_story)
    texts, v2_texts = scored_text(held), scored_text(v2_held)
    rows, samples, scored_bytes, curves = [], [], 0, {}
    length = ["--steps", str(args.steps)] if args.steps else ["--time-budget", args.budget]
    for spec in args.run:
        name, _, train_args = spec.partition("=")
        out = work / "runs" / name
        run_args = shlex.split(train_args)
        data = prepared(run_args, files, held_file, work / "data")
        wall = train(run_args, length, [data], out, args.curve_every)
        saved = json.loads((out / "config.json").read_text())
        model, tokenizer, _, _, step = load_for_generation(out)
        result = score(model, tokenizer, texts)
        v2 = score(model, tokenizer, v2_texts)
        scored_bytes = result["bytes"]
        cfg = saved["train"]
        seq = cfg["seq_len"] or saved["model"]["context_len"]
        budget = saved.get("time_budget", {})
        stories = generate(model, tokenizer, list(PROMPTS), max_new_tokens=160,
                           temperature=0.8, top_k=50, rng=jax.random.key(0))
        rows.append([name, f"`{train_args}`", saved["model"]["tokenizer"],
                     f"{result['bits_per_byte']:.3f}", f"{v2['bits_per_byte']:.3f}",
                     f"{result['nats_per_token']:.3f}", step,
                     f"{step * cfg['batch_size'] * seq / 1e6:.2f} M",
                     f"{budget.get('compile_s', float('nan')):.1f}", f"{wall:.0f}"])
        samples += [f"**{name}** (step {step}):", ""]
        samples += [f"> {' '.join(s.split())}" + "\n" for s in stories]
        print(rows[-1], flush=True)
        curves[name] = curve(out, model, tokenizer, texts[:CURVE_STORIES])
        print(f"curve of {name}: " + ", ".join(f"{t:.0f} s {b:.3f}" for t, b in curves[name]),
              flush=True)
    span = f"{args.steps} steps" if args.steps else f"a {args.budget} budget"
    png = Path(args.plot) if args.plot not in ("", "none") else None
    if not args.plot and not args.no_record:
        png = RESULTS.parent / f"stories-{args.steps or args.budget}.png"
    if png is not None:
        plot(curves, png, span)
        print(f"learning curves: {png}")
    if not args.no_record:
        non_ascii = sum(any(ord(c) > 127 for c in t) for t in v2_texts)
        append_section(
            f"learning in {span}: held-out bits per byte",
            [f"scored: {len(texts)} held-out TinyStories stories (last of {SUBSET}, none in the "
             f"training text), each from its first token, {SCORED_GPT2_TOKENS} GPT-2 tokens of "
             f"text at most, {scored_bytes:,} bytes in all",
             f"V2 bits/byte: the last {len(v2_texts)} stories of {TRAIN_HEADS[1]} as written "
             f"({non_ascii} with non-ASCII punctuation), held out of the training text, scored "
             f"the same way",
             f"learning curve: {png.name if png else 'no picture kept'} (the first "
             f"{CURVE_STORIES} held-out stories scored at every {args.curve_every}th step's "
             "checkpoint, against seconds of compilation and steps): " + "; ".join(
                 f"{name} " + ", ".join(f"{t:.0f} s {b:.3f}" for t, b in points)
                 for name, points in curves.items()),
             f"training text: {TRAIN_HEADS[0]}, the rest of {TRAIN_HEADS[1]} and of the "
             "subset, " + ("all of it" if args.every_nth_story == 1 else
                          f"every {args.every_nth_story}th story of it") + " (the runs' "
             "validation split is the held-out stories); one CPU device; "
             + ("" if args.steps else "the budget includes compilation ")
             + "(wall = the whole training command, with data preparation, the final "
             "evaluation and checkpoint)",
             "samples: temperature 0.8, top-k 50, key 0, 160 new tokens"],
            table(["run", "train arguments", "tokenizer", "bits/byte", "V2 bits/byte",
                   "nats/token", "steps", "tokens seen", "compile (s)", "wall (s)"], rows)
            + ["", *samples])


if __name__ == "__main__":
    main()
