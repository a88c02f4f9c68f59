"""Loader throughput: pre-tokenized windows (minigpt.data) against tokenizing on the fly.

The on-the-fly pipeline is the one the original miniGPT tutorial uses: the text is split into
stories, and a Grain DataLoader encodes each story with tiktoken as it is read, truncates or pads
it to 256 tokens with id 0, and batches. minigpt's pipeline tokenizes the same text once
(`prepare_text`, timed separately) and then serves windows of the token file.

Both are measured in one process as tokens per second delivered to the trainer (batch * seq_len
per batch, pads included for the tutorial; the share of real tokens is shown beside it). The
result is printed and appended, with the command and the machine, to bench/RESULTS.md.

    python bench/bench_loader.py [--seconds 10] [--batch-size 256] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import grain.python as pygrain
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import RESULTS, append_section, table  # noqa: E402
from minigpt.data import prepare_text  # noqa: E402
from minigpt.data.loader import batch_iterator  # noqa: E402
from minigpt.tokenizer import load_tokenizer  # noqa: E402

ASSET_FILES = ("TinyStories-train-head.txt", "TinyStoriesV2-GPT4-train-head.txt",
               "TinyStories-subset-3k.txt")


class _TutorialStories:
    """The tutorial's data source: encode one story per read, then truncate or pad with id 0."""

    def __init__(self, stories: list[str], maxlen: int):
        self.stories, self.maxlen, self.enc = stories, maxlen, load_tokenizer()

    def __len__(self) -> int:
        return len(self.stories)

    def __getitem__(self, index: int) -> np.ndarray:
        tokens = self.enc.encode(self.stories[index], allowed_special={"<|endoftext|>"})
        tokens = tokens[:self.maxlen]
        return np.array(tokens + [0] * (self.maxlen - len(tokens)), dtype=np.int32)


def tutorial_batches(files: list[Path], batch_size: int, seq_len: int, seed: int):
    stories = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        stories += [s + "<|endoftext|>" for s in text.split("<|endoftext|>") if s.strip()]
    source = _TutorialStories(stories, seq_len)
    sampler = pygrain.IndexSampler(len(source), shuffle=True, seed=seed, num_epochs=None,
                                   shard_options=pygrain.NoSharding())
    loader = pygrain.DataLoader(data_source=source, sampler=sampler,
                                operations=[pygrain.Batch(batch_size, drop_remainder=True)])
    return iter(loader)


def measure(batches, seconds: float, pad_id: int | None = None) -> dict[str, float]:
    """Tokens per second over at least `seconds`, after one warm-up batch."""
    first = next(batches)
    tokens_per_batch = first.size if pad_id is not None else first["inputs"].size
    real = count = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        batch = next(batches)
        count += 1
        if pad_id is not None:
            real += int(np.count_nonzero(batch != pad_id))
    elapsed = time.perf_counter() - start
    return {"batches": count, "seconds": elapsed,
            "tokens_per_s": count * tokens_per_batch / elapsed,
            "real_share": real / (count * tokens_per_batch) if pad_id is not None else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", default=os.environ.get(
        "MINIGPT_ASSETS", str(REPO.parent / "shared" / "assets")))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()

    files = [Path(args.assets) / "tinystories" / name for name in ASSET_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        sys.exit(f"error: missing TinyStories text {', '.join(missing)}; set --assets or "
                 f"MINIGPT_ASSETS to the offline assets directory")
    total_bytes = sum(f.stat().st_size for f in files)

    tutorial = measure(tutorial_batches(files, args.batch_size, args.seq_len, seed=0),
                       args.seconds, pad_id=0)
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        data_dir = prepare_text(files, root, progress=False)
        prepare_s = time.perf_counter() - start
        ours = measure(batch_iterator(data_dir, "train", seq_len=args.seq_len,
                                      batch_size=args.batch_size, seed=0), args.seconds)
    speedup = ours["tokens_per_s"] / tutorial["tokens_per_s"]

    body = table(["pipeline", "tokens/s", "real (non-pad) share", "batches timed"], [
        (name, f"{r['tokens_per_s']:,.0f}", f"{r['real_share']:.0%}", r["batches"])
        for name, r in [("tutorial: encode + pad per story", tutorial),
                        ("minigpt: pre-tokenized windows", ours)]])
    append_section("loader throughput", [
        f"text: {len(files)} files from {Path(args.assets) / 'tinystories'}, "
        f"{total_bytes:,} bytes; "
        f"batch {args.batch_size} x {args.seq_len} tokens, one process, "
        f"{args.seconds:g} s per pipeline",
        f"one-off preparation (tokenize to token files): {prepare_s:.2f} s",
    ], body + ["", f"**Speed-up: {speedup:,.0f}x** the on-the-fly rate "
                   f"({speedup * tutorial['real_share']:,.0f}x counting only the tutorial's "
                   f"real tokens)."], results=Path(args.results))

if __name__ == "__main__":
    main()
