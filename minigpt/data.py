"""Training data: prepared token files found or made by name, and a Grain pipeline of batches.

`resolve_data("tinystories")` downloads and tokenizes the dataset on first use (see
`minigpt.download` and `minigpt.pretokenize`) and returns its directory; local text files are
prepared the same way. `batch_iterator` reads a split as one stream of tokens, documents joined by
`<|endoftext|>`, cut into windows of `seq_len + 1` tokens that overlap by one (inputs are a
window's first `seq_len` tokens, targets its last), so nothing is padded and no token is wasted.
Windows are shuffled with a seed (a new order each epoch), and each JAX process reads only its own
rows of every global batch. The iterator's state is one batch index, so a checkpoint
restores it exactly and batches do not depend on how many processes read them.

    python -m minigpt.data prepare --dataset tinystories [--version v1|v2] [--out data/]
    python -m minigpt.data prepare --text FILE... [--val-fraction 0.1] [--out data/]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

DATASETS = {"tinystories": "v1", "tinystories-v1": "v1", "tinystories-v2": "v2"}
SPLITS = ("train", "val")


class DataError(ValueError):
    """A problem with data a user gave or asked for; the message says what to do."""


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    """The meta.json of a prepared directory: tokenizer, token and story counts, source hashes."""
    path = Path(data_dir) / "meta.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} not found: {data_dir} is not a prepared data directory; run "
                        f"`python -m minigpt.data prepare`") from None
    except ValueError as error:
        raise DataError(f"{path} is not valid JSON ({error}); prepare the data again") from None


# The preparation modules import DataError and load_meta from here, so they are imported inside
# the functions that need them; reading batches never loads them.

def prepare_tinystories(root: str | Path = "data", version: str = "v1", *,
                        base_url: str | None = None, revision: str | None = None,
                        progress: bool = True) -> Path:
    """Download (once) and tokenize (once) TinyStories into `root/tinystories[-v2]/`."""
    from minigpt import download, pretokenize

    if version not in download.TINYSTORIES_FILES:
        raise DataError(f"unknown TinyStories version {version!r}: choose v1 or v2")
    revision = revision or download.TINYSTORIES_REVISION
    out = Path(root) / ("tinystories" if version == "v1" else f"tinystories-{version}")
    if _still_prepared(out, revision):
        return out
    files = download.TINYSTORIES_FILES[version]
    urls = {split: download.hf_url(name, revision=revision, base_url=base_url)
            for split, name in files.items()}
    for split, name in files.items():
        size, sha256 = download.expected_file(name, revision)
        download.download_file(urls[split], out / name, size=size, sha256=sha256,
                               progress=progress)
    pretokenize.prepare(
        out, [out / files["train"]], val_files=[out / files["val"]], complete=True,
        dataset={"name": "tinystories", "version": version, "repo": download.HF_REPO,
                 "revision": revision, "urls": urls},
        progress=progress)
    return out


def _still_prepared(out: Path, revision: str) -> bool:
    """Token files of this revision are complete and no source changed since (deleted is fine:
    a user may remove the 2 GB text once tokenized)."""
    try:
        meta = load_meta(out)
    except DataError:
        return False
    if (meta.get("dataset") or {}).get("revision") != revision:
        return False
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        path = out / f"{split}.bin"
        if not path.is_file() or path.stat().st_size != meta[f"{split}_tokens"] * itemsize:
            return False
    for source in meta["sources"]:
        path = out / source["file"]
        if path.exists() and (path.stat().st_size, path.stat().st_mtime_ns) != (
                source["bytes"], source["mtime_ns"]):
            return False
    return True


def prepare_text(files: Sequence[str | Path], root: str | Path = "data", *,
                 val_fraction: float | None = None, progress: bool = True) -> Path:
    """Tokenize local text files into `root/text-<hash of their contents>/`."""
    from minigpt import pretokenize

    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"no such file: {', '.join(missing)} (data is 'tinystories', "
                        f"'tinystories-v2', a prepared directory, or text files)")
    combined = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            combined.update(hashlib.file_digest(f, "sha256").digest())
    out = Path(root) / f"text-{combined.hexdigest()[:12]}"
    pretokenize.prepare(out, paths, progress=progress,
                        val_fraction=(pretokenize.DEFAULT_VAL_FRACTION if val_fraction is None
                                      else val_fraction),
                        dataset={"name": "text", "files": [str(p.resolve()) for p in paths]})
    return out


def resolve_data(data: str | Sequence[str], root: str | Path = "data") -> Path:
    """A prepared directory (train.bin, val.bin, meta.json) for a dataset name or text files.

    `"tinystories"` / `"tinystories-v2"` download and prepare into `root` on first use; a
    directory holding meta.json is used as it is; anything else is a list of text files.
    """
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not items:
        raise DataError("no data given: name a dataset (tinystories, tinystories-v2) or files")
    if len(items) == 1 and str(items[0]).lower() in DATASETS:
        return prepare_tinystories(root, DATASETS[str(items[0]).lower()])
    if len(items) == 1 and (Path(items[0]) / "meta.json").is_file():
        return Path(items[0])
    return prepare_text(items, root)


def _open_split(data_dir: Path, split: str) -> np.ndarray:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    meta = load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    dtype = np.dtype(meta["dtype"])
    expected = meta[f"{split}_tokens"] * dtype.itemsize
    if not path.is_file() or path.stat().st_size != expected:
        raise DataError(f"{path} is missing or not the {expected:,} bytes meta.json records: "
                        f"delete {data_dir} and prepare the data again")
    return np.memmap(path, dtype=dtype, mode="r")


class _ReadRows:
    """Global batch k -> this process's rows of it, as one gather from the token file.

    The window order of epoch e is a permutation seeded by (seed, e), computed with NumPy once
    per epoch. Grain's own per-index shuffle gives the same guarantees but costs 5-15 us of
    Python per window, a hundred times the cost of reading the window.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, rows: int,
                 first_row: int, seed: int, shuffle: bool):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.batch_size, self.rows, self.first_row = batch_size, rows, first_row
        self.num_windows = (len(tokens) - 1) // seq_len
        self.span = np.arange(seq_len + 1)
        # A batch touches at most two epochs; keep both permutations, not one per epoch seen.
        self._order = functools.lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        first = k * self.batch_size + self.first_row
        epoch, windows = np.divmod(np.arange(first, first + self.rows), self.num_windows)
        if self.shuffle:
            for e in np.unique(epoch):
                windows[epoch == e] = self._order(int(e))[windows[epoch == e]]
        chunk = self.tokens[(windows * self.seq_len)[:, None] + self.span]  # [b, T+1]
        chunk = chunk.astype(np.int32)
        return {"inputs": np.ascontiguousarray(chunk[:, :-1]),   # [b, T]
                "targets": np.ascontiguousarray(chunk[:, 1:])}   # [b, T]


def batch_iterator(data_dir: str | Path, split: str, *, seq_len: int, batch_size: int, seed: int,
                   shuffle: bool = True, num_epochs: int | None = None, process_index: int = 0,
                   process_count: int = 1) -> grain.DatasetIterator:
    """Batches `{"inputs", "targets"}` (int32 [batch_size // process_count, seq_len]) of a split.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]. Global batch k holds windows
    order[k*batch_size : (k+1)*batch_size] of the (shuffled, repeated) window order, and process
    p yields its rows p*b .. (p+1)*b - 1. `num_epochs=None` repeats forever; a last partial batch
    is dropped. `get_state()` / `set_state()` save and restore the position.
    """
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    if not 0 <= process_index < process_count or batch_size % process_count:
        raise DataError(f"global batch size {batch_size} must split evenly over "
                        f"{process_count} processes (process index {process_index})")
    if seed < 0:
        raise DataError(f"seed must be non-negative, got {seed}")
    if num_epochs is not None and num_epochs < 1:
        raise DataError(f"num_epochs must be positive or None (forever), got {num_epochs}")
    tokens = _open_split(Path(data_dir), split)
    num_windows = (len(tokens) - 1) // seq_len
    if num_windows < batch_size:
        raise DataError(
            f"the {split} split of {data_dir} has {len(tokens):,} tokens, fewer than one batch "
            f"of {batch_size} windows of {seq_len} + 1 tokens needs ({batch_size * seq_len + 1:,})"
            f": use a smaller batch size or sequence length, or more text")
    rows = batch_size // process_count
    read = _ReadRows(tokens, seq_len=seq_len, batch_size=batch_size, rows=rows,
                     first_row=process_index * rows, seed=seed, shuffle=shuffle)
    num_batches = (sys.maxsize if num_epochs is None else num_epochs * num_windows) // batch_size
    batches = grain.MapDataset.range(num_batches).map(read)
    # Batches are cheap to gather from the page cache; a small prefetch overlaps them with the
    # train step without holding hundreds of them in memory (Grain's default buffer is 500).
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
    return iter(batches.to_iter_dataset(options))


def main(argv: Sequence[str] | None = None) -> int:
    from minigpt.tokenizer import TokenizerError

    parser = argparse.ArgumentParser(prog="python -m minigpt.data", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download and/or tokenize a dataset once")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=["tinystories"], help="an official dataset")
    source.add_argument("--text", nargs="+", metavar="FILE",
                        help="local text: stories separated by <|endoftext|> lines or blank lines")
    prep.add_argument("--version", choices=["v1", "v2"], default="v1",
                      help="TinyStories v1 (GPT-3.5 + GPT-4) or v2 (GPT-4 only)")
    prep.add_argument("--val-fraction", type=float, default=None,
                      help="share of local-text stories held out for validation (default 0.1)")
    prep.add_argument("--out", default="data", help="root directory (default: data)")
    args = parser.parse_args(argv)
    if args.dataset and args.val_fraction is not None:
        parser.error("--val-fraction applies to --text; TinyStories has a validation file")
    try:
        if args.dataset:
            out = prepare_tinystories(args.out, args.version)
        else:
            out = prepare_text(args.text, args.out, val_fraction=args.val_fraction)
        meta = load_meta(out)
    except (DataError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"{out}: train {meta['train_tokens']:,} tokens ({meta['train_stories']:,} stories), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_stories']:,} stories), "
          f"tokenizer {meta['tokenizer']}")
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: the preparation modules raise the
    # DataError of `minigpt.data`, which this copy's class would not catch.
    from minigpt.data import main as _main

    sys.exit(_main())
