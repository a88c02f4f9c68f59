"""A prepared folder opened for reading, whichever way it was written: each split as one stream
of tokens over memory-mapped pieces, its documents found by number, and what `inspect` says.

Two layouts exist. A corpus prepared with `prepare --source` (`kind: "shards"` in meta.json)
holds each split in shards of a fixed number of tokens (`minigpt.data.shards`); a folder from
`prepare --text`, `--dataset tinystories` or earlier versions holds one headerless token file per
split (`train.bin`, `val.bin`). Both are read here as a `TokenStream`: a split's pieces mapped
into memory (never read whole), window i being tokens [i*T, i*T + T + 1) of the stream whatever
piece they lie in, so the loader has one way to read either. Opening a sharded folder checks
every shard's header against meta.json (tokenizer, vocabulary hash, counts, places) before a
token is read. Mapped pages count towards a process's resident memory until unmapped, and a
page fault may map a whole page-cache folio around the page it needs (2 MB here: 64 windows of a
batch mapped 120 MB), so a stream unmaps what a batch's windows mapped as soon as it has copied
them (`madvise(MADV_DONTNEED)` over their `FOLIO`-aligned span in each piece: the pages stay in
the page cache). Its reader asks the kernel for a batch's pages before copying them
(`will_need`: `MADV_WILLNEED`), so that reads from a folder larger than memory wait on the disk
together rather than one by one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.data.shards import ShardHeader, document_index, read_header, tokens_checksum
from minigpt.data.token_files import SPLITS, DataError, load_meta, split_path, token_file_problem

SHARDS = "shards"  # meta.json's "kind" for a sharded corpus
FOLIO = 2 << 20  # the most a page fault maps around the page it needs (a huge page)


def _mapped(path: Path, offset: int, count: int, dtype: np.dtype
            ) -> tuple[np.ndarray, mmap.mmap | None]:
    """`count` tokens of a file from byte `offset`, memory-mapped read-only, and the mapping."""
    if count == 0:
        return np.zeros(0, dtype), None
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)  # windows are read in a shuffled order: no readahead
    return np.frombuffer(mapping, dtype=dtype, count=count, offset=offset), mapping


class TokenStream:
    """A split's tokens as one stream over pieces mapped from files (`pieces`: (path, byte
    offset, tokens) each), read by slices or by windows; memory stays bounded however much is
    read."""

    def __init__(self, pieces: list[tuple[Path, int, int]], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        mapped = [_mapped(path, offset, count, self.dtype) for path, offset, count in pieces]
        self._arrays = [array for array, _ in mapped]
        self._maps = [m for _, m in mapped]
        self._offsets = np.array([offset for _, offset, _ in pieces], np.int64)  # in the files
        self.starts = np.cumsum([0] + [count for _, _, count in pieces])  # [pieces + 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, copied out of the mapping."""
        out = np.empty(max(0, stop - start), self.dtype)
        self._copy_into(out, start)
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of `length` tokens beginning at each of `starts`, as int32 [len(starts), length]:
        one gather per piece the rows lie in, a row across two pieces copied on its own. (From
        a folder larger than memory, call `will_need` with the same rows first.)"""
        piece, local = self._places(starts)
        out = np.empty((len(starts), length), np.int32)
        inside = local + length <= self.starts[piece + 1] - self.starts[piece]
        span = np.arange(length)
        for p in np.unique(piece[inside]):
            rows = np.flatnonzero(inside & (piece == p))
            out[rows] = self._arrays[p][local[rows, None] + span]  # [r, length]
            self._unmap(p, local[rows], length)
        for row in np.flatnonzero(~inside):
            self._copy_into(out[row], int(starts[row]))
        if (~inside).any():
            self.release()  # rare: a window across two shards
        return out

    def _copy_into(self, out: np.ndarray, start: int) -> None:
        done, piece = 0, int(np.searchsorted(self.starts, start, side="right")) - 1
        while done < len(out):
            local = start + done - int(self.starts[piece])
            take = min(len(out) - done, len(self._arrays[piece]) - local)
            if take <= 0:
                raise IndexError(f"tokens {start}..{start + len(out)} run past the stream's "
                                 f"{len(self)}")
            out[done:done + take] = self._arrays[piece][local:local + take]
            done += take
            piece += 1

    def _places(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece each of the stream's `starts` lies in, and where in it: [b] each."""
        starts = np.asarray(starts, np.int64)
        piece = np.searchsorted(self.starts, starts, side="right") - 1
        return piece, starts - self.starts[piece]

    def will_need(self, starts: np.ndarray, length: int) -> None:
        """Ask the kernel to start reading the pages of rows of `length` tokens from each of
        `starts` now (madvise(MADV_WILLNEED) over each row's pages), all of them at once, so
        that reads from the disk wait together rather than one after another."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        piece, local = self._places(starts)
        begin = self._offsets[piece] + local * self.dtype.itemsize
        first = begin - begin % mmap.PAGESIZE
        last = begin + length * self.dtype.itemsize
        for p, a, b in zip(piece.tolist(), first.tolist(), last.tolist()):
            mapping = self._maps[p]
            if mapping is not None:
                mapping.madvise(mmap.MADV_WILLNEED, a, min(b, len(mapping)) - a)

    def _unmap(self, piece: int, local: np.ndarray, length: int) -> None:
        """Unmap the `FOLIO`-aligned span that a piece's copied rows lie in, in one call (the
        kernel skips the span's unmapped blocks cheaply, one call a row costs more)."""
        mapping = self._maps[piece]
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        size = self.dtype.itemsize
        begin = int(self._offsets[piece] + local.min() * size)
        end = int(self._offsets[piece] + (local.max() + length) * size)
        first, last = begin - begin % FOLIO, min(-(-end // FOLIO) * FOLIO, len(mapping))
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)

    def release(self) -> None:
        """Unmap every page mapped so far: the resident memory they took is freed, the data
        stays in the page cache for whoever reads it next."""
        for mapping in self._maps:
            if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
                mapping.madvise(mmap.MADV_DONTNEED)


@dataclasses.dataclass
class Corpus:
    """A prepared folder: its meta.json and, for a sharded one, every shard's checked header."""

    path: Path
    meta: dict[str, Any]
    shards: dict[str, list[ShardHeader]]  # split -> its shards in order; empty for one file

    @property
    def sharded(self) -> bool:
        return self.meta.get("kind") == SHARDS

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> int:
        return int(self.meta[f"{split}_tokens"])

    def stream(self, split: str) -> TokenStream:
        """A split's tokens, memory-mapped."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
        if not self.sharded:
            return TokenStream([(split_path(self.path, split), 0, self.tokens(split))],
                               self.dtype)
        return TokenStream([(h.path, h.header_bytes, h.tokens) for h in self.shards[split]],
                           self.dtype)

    def documents(self, split: str) -> int:
        return int(self.meta.get(f"{split}_documents", self.meta.get(f"{split}_stories", 0)))

    def document(self, number: int) -> dict[str, Any]:
        """Document `number` (counted from 0 over the whole corpus, in source order): its
        split and its ids as stored (begin token, text, end token), what training reads."""
        total = sum(self.documents(s) for s in SPLITS)
        if not 0 <= number < total:
            raise DataError(f"{self.path} holds documents 0 to {total - 1}, not {number}")
        split, start, stop = (self._sharded_document(number) if self.sharded
                              else self._stream_document(number))
        ids = self.stream(split).read(start, stop)
        return {"number": number, "split": split, "start": start, "tokens": len(ids),
                "ids": ids.tolist()}

    def _sharded_document(self, number: int) -> tuple[str, int, int]:
        for split in SPLITS:
            headers = self.shards[split]
            for k, header in enumerate(headers):
                starts, ordinals = document_index(header)
                at = int(np.searchsorted(ordinals, number))
                if at < len(ordinals) and ordinals[at] == number:
                    return split, header.first + int(starts[at]), _next_start(headers, k, at)
        raise DataError(f"document {number} is in no shard's index of {self.path}: prepare "
                        f"the corpus again")

    def _stream_document(self, number: int) -> tuple[str, int, int]:
        """A one-file folder keeps no index: the split and place follow from how `prepare`
        held documents out, and the document is found by its end tokens."""
        fraction = self.meta.get("val_fraction")
        if fraction is None:  # validation files: every training document comes first
            train = self.documents("train")
            split, nth = ("train", number) if number < train else ("val", number - train)
        else:
            f = Fraction(fraction).limit_denominator(10_000)
            before = number * f.numerator // f.denominator  # held-out documents before it
            held = (number + 1) * f.numerator // f.denominator > before
            split, nth = ("val", before) if held else ("train", number - before)
        end = self.meta.get("eot_token")
        marker = end if end is not None else self.meta.get("bos_token")
        return (split, *_nth_between(self.stream(split), nth, marker, after=end is not None))


def _next_start(headers: list[ShardHeader], k: int, at: int) -> int:
    """Where the document after entry `at` of shard `k` starts: the split's end after its last."""
    starts, _ = document_index(headers[k])
    if at + 1 < len(starts):
        return headers[k].first + int(starts[at + 1])
    for header in headers[k + 1:]:
        following, _ = document_index(header)
        if len(following):
            return header.first + int(following[0])
    return headers[-1].first + headers[-1].tokens


def _nth_between(stream: TokenStream, nth: int, marker: int, *, after: bool,
                 chunk: int = 1 << 24) -> tuple[int, int]:
    """[start, stop) of the nth document of a stream whose documents each end with (`after`)
    or begin with `marker`, found by scanning in chunks."""
    wanted = [nth - 1, nth] if after else [nth, nth + 1]  # which markers bound it
    found: dict[int, int] = {}
    seen, start = 0, 0
    while start < len(stream) and wanted[1] not in found:
        block = stream.read(start, min(len(stream), start + chunk))
        hits = np.flatnonzero(block == marker) + start
        for k in wanted:
            if seen <= k < seen + len(hits):
                found[k] = int(hits[k - seen]) + (1 if after else 0)
        seen += len(hits)
        start += chunk
    first = found.get(wanted[0], 0)
    return first, found.get(wanted[1], len(stream))


def open_corpus(data_dir: str | Path) -> Corpus:
    """A prepared folder, checked: token files of the sizes meta.json records, or shards whose
    headers agree with it and with each other. Problems are one DataError saying what to do."""
    path = Path(data_dir)
    meta = load_meta(path)
    if meta.get("kind") != SHARDS:
        problem = token_file_problem(path, meta)
        if problem:
            raise DataError(f"{problem}: delete {path} and prepare the data again")
        return Corpus(path, meta, {})
    return Corpus(path, meta, {split: _checked_shards(path, meta, split) for split in SPLITS})


def _checked_shards(path: Path, meta: dict[str, Any], split: str) -> list[ShardHeader]:
    again = f"delete {path} and prepare it again"
    names = meta.get("splits", {}).get(split, {}).get("shards", [])
    headers, first = [], 0
    for k, name in enumerate(names):
        if Path(name).name != name:
            raise DataError(f"{path}/meta.json names a shard outside the folder ({name!r}): "
                            f"{again}")
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing: {again}")
        header = read_header(path / name)
        if (header.tokenizer, header.vocab_hash) != (meta["tokenizer"], meta["vocab_hash"]):
            raise DataError(f"{path / name} was tokenized with {header.tokenizer!r} (vocabulary "
                            f"{header.vocab_hash[:12]}), but meta.json says {meta['tokenizer']!r} "
                            f"({meta['vocab_hash'][:12]}): shards of two preparations are "
                            f"mixed; {again}")
        full = k + 1 < len(names)
        if header.first != first or header.dtype != np.dtype(meta["dtype"]) or (
                full and header.tokens != meta["shard_tokens"]):
            raise DataError(f"{path / name} does not continue the {split} split where the shard "
                            f"before it ends: {again}")
        first += header.tokens
        headers.append(header)
    if first != meta[f"{split}_tokens"]:
        raise DataError(f"the {split} shards of {path} hold {first:,} tokens, but meta.json "
                        f"records {meta[f'{split}_tokens']:,}: {again}")
    return headers


def verify(corpus: Corpus) -> tuple[int, list[str]]:
    """Check every shard's bytes against the sha256 meta.json records (a corpus prepared with
    `--source` since checksums were kept): (shards checked, the problems found, one line each).
    A folder of the one-file layout, or shards prepared before checksums, has none to check."""
    checksums = corpus.meta.get("checksums")
    if not corpus.sharded or not isinstance(checksums, dict):
        return 0, []
    problems, checked = [], 0
    for split in SPLITS:
        for header in corpus.shards[split]:
            name = header.path.name
            if name not in checksums:
                problems.append(f"{header.path} has no checksum in meta.json")
            elif tokens_checksum(header.path) != checksums[name]:
                problems.append(f"{header.path} is not the shard that was prepared (its tokens "
                                f"differ from the checksum in meta.json)")
            checked += 1
    return checked, problems


def fingerprint(corpus: Corpus) -> str:
    """What a run records of the corpus it trains on, to know it again: the shards' checksums
    where meta.json keeps them, else meta.json's counts and the token files' sizes."""
    meta = corpus.meta
    if isinstance(meta.get("checksums"), dict):
        basis: Any = [meta.get("vocab_hash"), sorted(meta["checksums"].items())]
    else:
        basis = [meta.get(k) for k in ("tokenizer", "vocab_hash", "train_tokens", "val_tokens",
                                       "train_documents", "val_documents")]
        basis += [split_path(corpus.path, split).stat().st_size
                  if split_path(corpus.path, split).is_file() else None for split in SPLITS]
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()


def describe(corpus: Corpus) -> dict[str, Any]:
    """What `python -m minigpt.data inspect DIR --json` prints: the tokenizer, counts per split,
    and each shard (a one-file folder: each split's file)."""
    meta = corpus.meta
    splits = {split: {"tokens": corpus.tokens(split), "documents": corpus.documents(split)}
              for split in SPLITS}
    if corpus.sharded:
        shards = [{"file": h.path.name, "split": split, "first": h.first, "tokens": h.tokens,
                   "documents": h.documents} for split in SPLITS for h in corpus.shards[split]]
    else:
        shards = [{"file": split_path(corpus.path, split).name, "split": split, "first": 0,
                   **splits[split]} for split in SPLITS]
    return {"path": str(corpus.path), "layout": "shards" if corpus.sharded else "one file a split",
            "tokenizer": meta.get("tokenizer"), "vocab_hash": meta.get("vocab_hash"),
            "vocab_size": meta.get("vocab_size"), "dtype": meta.get("dtype"),
            "eot_token": meta.get("eot_token"), "bos_token": meta.get("bos_token"),
            "tokens": sum(s["tokens"] for s in splits.values()),
            "documents": sum(s["documents"] for s in splits.values()),
            "splits": splits, "shard_tokens": meta.get("shard_tokens"),
            "val_fraction": meta.get("val_fraction"), "split_rule": meta.get("split_rule"),
            "shards": shards,
            "source": meta.get("source", meta.get("dataset"))}
