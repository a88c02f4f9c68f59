"""Pre-tokenization: story text files in; token files `train.bin`, `val.bin` and `meta.json` out.

Each story is encoded once and followed by the document separator token (`<|endoftext|>`, 50256
for GPT-2), so the token files are the stories' concatenated stream: no padding, nothing lost.
Files are read in chunks of whole stories and encoded with tiktoken's thread-parallel batch
encoder, so a 2 GB source never sits in memory as one string or one list of tokens.

How text is read (data/README.md says the same for users):

- Layout: a file holding `<|endoftext|>` anywhere is split on it (the TinyStories `.txt` layout,
  a separator line between stories). A file without it holds one story per blank-line-separated
  block. A file with neither is refused: it is one undivided text, most likely the wrong file.
- Each story is stripped of surrounding whitespace; empty ones are skipped.
- A last story with no closing separator is kept if the file ends with a line break and dropped
  if the file ends mid-line, which is what a cut-off copy looks like (the drop is reported and
  recorded). Verified downloads are complete by construction and always keep it.
- Text must be UTF-8; an invalid byte is reported with the file and its byte offset.
- Without an official validation file, every `round(1/val_fraction)`-th story (exactly: story i
  goes to validation when floor((i+1)*f) > floor(i*f)) is held out, spread evenly over the text.

Outputs are written under temporary names and renamed when complete; `meta.json` comes last and
records the tokenizer, counts and each source's size and sha256. Calling `prepare` again with
unchanged sources and settings reuses the files.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from minigpt.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from minigpt.tokens import (
    SPLITS,
    DataError,
    load_meta,
    split_path,
    token_file_problem,
    write_meta,
)

SEPARATOR = "<|endoftext|>"
FORMAT = 1
DEFAULT_VAL_FRACTION = 0.1
CHUNK_BYTES = 8 << 20  # about 10,000 TinyStories stories per encoder batch
_BOM = b"\xef\xbb\xbf"
_BLANK_LINES = re.compile(r"\n\s*\n", re.ASCII)  # the same blank lines as the bytes pattern
_BLANK_LINES_BYTES = re.compile(rb"\n\s*\n")


class StoryFile:
    """One text file of stories, read as batches of whole stories."""

    def __init__(self, path: str | Path, *, complete: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file")
        self.size = self.path.stat().st_size
        if self.size == 0:
            raise DataError(f"{self.path} is empty: give a file with stories separated by "
                            f"'{SEPARATOR}' lines or blank lines")
        self.complete = complete
        self.layout = self._detect_layout()
        self.stories = 0
        self.dropped_partial_story = False
        self.sha256 = ""

    def _detect_layout(self) -> str:
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(SEPARATOR.encode()) >= 0:
                return "separator"
            if _BLANK_LINES_BYTES.search(m):
                return "blank-line"
        raise DataError(
            f"{self.path} has no story separators: put a line holding '{SEPARATOR}' between "
            f"stories (the TinyStories layout), or a blank line")

    def _last_boundary(self, buf: bytes) -> tuple[int, int] | None:
        """Start and end of the last story separator in `buf`."""
        if self.layout == "separator":
            start = buf.rfind(SEPARATOR.encode())
            return None if start < 0 else (start, start + len(SEPARATOR))
        last = None
        for last in _BLANK_LINES_BYTES.finditer(buf):  # noqa: B007 - the last match is wanted
            pass
        return None if last is None else last.span()

    def _decode(self, raw: bytes, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad = raw[error.start:error.start + 4]
            raise DataError(
                f"{self.path}: invalid UTF-8 at byte offset {offset + error.start:,} "
                f"(bytes {bad!r}): stories must be UTF-8 text; re-encode the file, e.g. "
                f"`iconv -f latin1 -t utf-8`") from None

    def _split(self, raw: bytes, offset: int) -> list[str]:
        text = self._decode(raw, offset)
        parts = text.split(SEPARATOR) if self.layout == "separator" else _BLANK_LINES.split(text)
        return [s for s in (p.strip() for p in parts) if s]

    def batches(self, chunk_bytes: int | None = None) -> Iterator[tuple[list[str], int]]:
        """Yield (stories, bytes of the file they span), computing the file's sha256 on the way."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        hasher = hashlib.sha256()
        offset, buf = 0, b""
        with open(self.path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                hasher.update(chunk)
                buf = buf + chunk if buf else chunk
                if offset == 0 and buf.startswith(_BOM):
                    buf, offset = buf[len(_BOM):], len(_BOM)
                boundary = self._last_boundary(buf)
                if boundary is None:
                    continue  # a story longer than a chunk: read on
                stories = self._split(buf[:boundary[0]], offset)
                offset += boundary[1]
                buf = buf[boundary[1]:]
                self.stories += len(stories)
                yield stories, boundary[1]
        self.sha256 = hasher.hexdigest()
        tail: list[str] = []
        if buf.strip():
            if self.complete or buf.endswith(b"\n"):
                tail = self._split(buf, offset)
            else:
                self.dropped_partial_story = True
                tqdm.write(f"note: {self.path} ends mid-line, so its last story ({len(buf):,} "
                           f"bytes) looks cut off and is left out; end the file with a line "
                           f"break to keep it", file=sys.stderr)
        self.stories += len(tail)
        yield tail, len(buf)


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

    def write(self, token_lists: Sequence[list[int]], eot: int) -> None:
        total = sum(map(len, token_lists)) + len(token_lists)
        flat = np.empty(total, self.dtype)
        i = 0
        for tokens in token_lists:
            flat[i:i + len(tokens)] = tokens
            i += len(tokens)
            flat[i] = eot
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
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"split": split, "bytes": stat.st_size, "sha256": digest}


def _reusable(out_dir: Path, settings: dict[str, Any], inputs: list[tuple[Path, str]]) -> bool:
    try:
        meta = load_meta(out_dir)
    except DataError:
        return False
    if any(meta.get(k) != v for k, v in settings.items()) or token_file_problem(out_dir, meta):
        return False
    recorded = meta.get("sources", [])
    if len(recorded) != len(inputs):
        return False
    for (path, split), old in zip(inputs, recorded):
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
                    splits["train"].write([t for t, v in zip(tokens, val) if not v],
                                          enc.eot_token)
                    splits["val"].write([t for t, v in zip(tokens, val) if v], enc.eot_token)
                    seen += len(stories)
                else:
                    splits[split].write(tokens, enc.eot_token)
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


def prepare(out_dir: str | Path, train_files: Sequence[str | Path], *,
            val_files: Sequence[str | Path] = (), val_fraction: float = DEFAULT_VAL_FRACTION,
            tokenizer: str = DEFAULT_TOKENIZER, complete: bool = False,
            dataset: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Tokenize story files into `out_dir/{train,val}.bin` + `meta.json`; return the meta.

    With `val_files`, they are the validation split; otherwise `val_fraction` of the stories of
    `train_files` are held out. `complete` marks sources known to be whole (verified downloads),
    whose last story is kept even without a closing separator. `dataset` is provenance stored in
    meta.json. Unchanged sources and settings reuse the existing files.
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
    if _reusable(out_dir, settings, inputs):
        return load_meta(out_dir)

    enc = load_tokenizer(tokenizer)
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
        "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "dtype": dtype.name,
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

