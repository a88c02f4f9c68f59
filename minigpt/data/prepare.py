"""Pre-tokenization: story text files in; token files `train.bin`, `val.bin` and `meta.json` out.

Each story is encoded once and followed by the tokenizer's end token (`<|endoftext|>`, 50256 for
GPT-2; an imported model's own, such as Llama 3's `<|end_of_text|>`), and preceded by its begin
token where its tokenizer adds one (Llama's), so the token files are the stories' concatenated
stream: no padding, nothing lost, no id the vocabulary lacks.
Files are read in batches of whole stories (`minigpt.data.stories`, which also says how a file is
split into stories) and encoded with tiktoken's thread-parallel batch encoder, so a 2 GB source
never sits in memory as one string or one list of tokens. Without an official validation file,
every `round(1/val_fraction)`-th story (exactly: story i goes to validation when
floor((i+1)*f) > floor(i*f)) is held out, spread evenly over the text.

Outputs are written under temporary names and renamed when complete; `meta.json` comes last and
records the tokenizer, counts and each source's size and sha256. Calling `prepare` again with
unchanged sources and settings reuses the files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from minigpt.data.stories import SEPARATOR, StoryFile
from minigpt.data.token_files import (
    SPLITS,
    DataError,
    load_meta,
    split_path,
    token_file_problem,
    write_meta,
)
from minigpt.files import sha256
from minigpt.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

FORMAT = 1
DEFAULT_VAL_FRACTION = 0.1


def _held_out(first: int, count: int, fraction: Fraction) -> np.ndarray:
    """Which of stories first..first+count-1 go to validation: exact and evenly spread."""
    index = np.arange(first, first + count + 1, dtype=np.int64)
    return np.diff(index * fraction.numerator // fraction.denominator) > 0


class _TokenFile:
    """A token file written under a temporary name and renamed once complete."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.tokens = self.stories = 0

    def write(self, token_lists: Sequence[list[int]], enc) -> None:
        """Each story's tokens, after the tokenizer's begin token (if it has one, as Llama's)
        and before its end token (if it has one)."""
        ends = [t for t in (enc.bos_token, enc.eot_token) if t is not None]
        total = sum(map(len, token_lists)) + len(ends) * len(token_lists)
        flat = np.empty(total, self.dtype)
        i = 0
        for tokens in token_lists:
            if enc.bos_token is not None:
                flat[i] = enc.bos_token
                i += 1
            flat[i:i + len(tokens)] = tokens
            i += len(tokens)
            if enc.eot_token is not None:
                flat[i] = enc.eot_token
                i += 1
        self.file.write(flat.tobytes())
        self.tokens += total
        self.stories += len(token_lists)

    def commit(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _fingerprint(path: Path, split: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Size and sha256 of a source; the hash is reused from `previous` if size and mtime match."""
    stat = path.stat()
    if previous and (previous["bytes"], previous["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
        digest = previous["sha256"]
    else:
        digest = sha256(path)
    return {"split": split, "bytes": stat.st_size, "sha256": digest}


def is_current(out_dir: str | Path, expected: dict[str, Any], inputs: list[tuple[Path, str]],
               *, allow_deleted: bool = False) -> bool:
    """Whether `out_dir` holds complete token files that `prepare` made from exactly these
    (path, split) sources with these settings, none changed since.

    `expected` maps meta.json keys (a dotted key reaches inside: "dataset.revision") to the
    values they must have. A source is unchanged when its size and sha256 are (the hash is only
    recomputed when the size or modification time moved). With `allow_deleted`, a source that
    no longer exists counts as unchanged: a user may delete a 2 GB text once it is tokenized.
    """
    try:
        meta = load_meta(out_dir)
    except DataError:
        return False
    for key, value in expected.items():
        found: Any = meta
        for part in key.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found != value:
            return False
    recorded = meta.get("sources", [])
    if token_file_problem(out_dir, meta) or len(recorded) != len(inputs):
        return False
    for (path, split), old in zip(inputs, recorded):
        if allow_deleted and not path.exists() and old.get("file") == path.name:
            continue
        if not path.exists():
            return False
        new = _fingerprint(path, split, old if old.get("path") == str(path.resolve()) else None)
        if any(old.get(k) != v for k, v in new.items()):
            return False
    return True


def _tokenize(files: list[StoryFile], splits_of: list[str], splits: dict[str, _TokenFile], enc,
              fraction: Fraction, progress: bool) -> list[dict[str, Any]]:
    """Encode every story of every file into its split's token file; return the sources'
    records for meta.json. A file marked "train+val" sends `fraction` of its stories to val."""
    sources, seen = [], 0
    with tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True,
              unit_divisor=1024, desc="tokenizing", disable=not progress) as bar:
        for story_file, split in zip(files, splits_of):
            for stories, nbytes in story_file.batches():
                tokens = enc.encode_ordinary_batch(stories, num_threads=os.cpu_count() or 1)
                if split == "train+val":
                    val = _held_out(seen, len(stories), fraction)
                    splits["train"].write([t for t, v in zip(tokens, val) if not v], enc)
                    splits["val"].write([t for t, v in zip(tokens, val) if v], enc)
                    seen += len(stories)
                else:
                    splits[split].write(tokens, enc)
                bar.update(nbytes)
            path = story_file.path
            if story_file.stories == 0:
                raise DataError(f"{path} contains no stories, only separators and space")
            stat = path.stat()
            sources.append({
                "file": path.name, "path": str(path.resolve()), "split": split,
                "layout": story_file.layout, "bytes": stat.st_size,
                "mtime_ns": stat.st_mtime_ns, "sha256": story_file.sha256,
                "stories": story_file.stories,
                "dropped_partial_story": story_file.dropped_partial_story})
    return sources


def separating_tokenizer(name: str):
    """The tokenizer `name`, which must have an end or a begin token to mark documents apart."""
    enc = load_tokenizer(name)
    if enc.eot_token is None and enc.bos_token is None:
        raise DataError(f"the tokenizer {name} has neither an end nor a begin token, so "
                        f"documents cannot be told apart in the token stream: give it one "
                        f"(eos_token in its tokenizer_config.json)")
    return enc


def prepare(out_dir: str | Path, train_files: Sequence[str | Path], *,
            val_files: Sequence[str | Path] = (), val_fraction: float = DEFAULT_VAL_FRACTION,
            tokenizer: str = DEFAULT_TOKENIZER, complete: bool = False,
            dataset: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Tokenize story files into `out_dir/{train,val}.bin` + `meta.json`; return the meta.

    `val_files` are the validation split, or else `val_fraction` of the stories are held out.
    `complete`: sources known to be whole (verified downloads), their last story kept without a
    closing separator. `dataset`: provenance for meta.json. Unchanged inputs reuse the files.
    """
    out_dir = Path(out_dir)
    if not train_files:
        raise DataError("no text files given to prepare")
    if not val_files and not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    inputs = [(Path(p), "train" if val_files else "train+val") for p in train_files]
    inputs += [(Path(p), "val") for p in val_files]
    settings = {"format": FORMAT, "tokenizer": tokenizer,
                "val_fraction": None if val_files else val_fraction}
    if is_current(out_dir, settings, inputs):
        return load_meta(out_dir)

    enc = separating_tokenizer(tokenizer)
    dtype = np.dtype(np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32)
    files = [StoryFile(path, complete=complete) for path, _ in inputs]  # fails fast on bad files
    fraction = Fraction(val_fraction).limit_denominator(10_000)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # the old files no longer describe the data
    splits = {s: _TokenFile(split_path(out_dir, s), dtype) for s in SPLITS}
    try:
        sources = _tokenize(files, [split for _, split in inputs], splits, enc, fraction,
                            progress)
        empty = [name for name, split_file in splits.items() if split_file.stories == 0]
        if empty:
            hint = ("more text or a larger val_fraction" if empty == ["val"] and not val_files
                    else "files that contain stories")
            raise DataError(f"the {empty[0]} split would be empty ({sum(f.stories for f in files)}"
                            f" stories in all, val_fraction {val_fraction}): give {hint}")
    except BaseException:
        for split_file in splits.values():
            split_file.discard()
        raise
    for split_file in splits.values():
        split_file.commit()

    meta = {
        **settings,
        "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "bos_token": enc.bos_token,
        "dtype": dtype.name,
        "separator": SEPARATOR,
        "train_tokens": splits["train"].tokens, "train_stories": splits["train"].stories,
        "val_tokens": splits["val"].tokens, "val_stories": splits["val"].stories,
        "val_split": ("the validation file(s)" if val_files else
                      f"held out: {fraction} of the stories, evenly spread"),
        "sources": sources,
        "dataset": dataset,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_meta(out_dir, meta)
    return meta

