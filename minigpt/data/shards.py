"""The shard file: a split's tokens in files of a fixed number of tokens, each with a small
header and an index of the documents that start in it, written whole or not at all.

A shard is `HEADER_BYTES` of header, then its tokens (`uint16` where the vocabulary fits, else
`uint32`), then two `uint64` arrays of its document index: where each document that starts in
the shard starts (an offset into the shard) and its number in the source (its ordinal, counted
over the whole corpus in source order). The header holds the magic `MGPTSHRD`, the format
version, the token size, the header's length, the shard's first token's place in its split,
its token and document counts, and the tokenizer that made it: its name and the sha256 of its
vocabulary (`vocabulary_hash`), so a shard names what its ids mean without its folder. Every
shard of a split but the last holds exactly `shard_tokens` tokens, so a split is one stream of
tokens cut at fixed places and documents run across the cuts. `read_header` is the one door
shards come in by: the magic, the version, the sizes and the file's length are checked before
any token is read. `ShardWriter` writes a split's shards under temporary names, each renamed
when complete, so a killed preparation leaves only whole shards behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from minigpt.data.token_files import DataError

MAGIC = b"MGPTSHRD"
VERSION = 1
HEADER_BYTES = 1024  # room for a long tokenizer path; tokens start aligned after it
# magic, version, token size, header length, first token, tokens, documents, vocabulary hash,
# length of the tokenizer's name (the name follows, UTF-8)
_FIELDS = struct.Struct("<8sHHIQQQ32sH")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token type that holds every id of a vocabulary."""
    return _DTYPES[2] if vocab_size <= 1 << 16 else _DTYPES[4]


@contextlib.contextmanager
def _naming(path: Callable[[], Path]):
    """A failed write (a full disk) names the file it was writing: a write's OSError has no
    file name of its own."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror, str(path())) from error


def tokens_checksum(path: str | Path) -> str:
    """sha256 (hex) of a shard's tokens and document index (what follows its header, which
    `read_header` checks on its own and which names the tokenizer by a path that may differ
    between two preparations of the same text), read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.bin"


@functools.cache
def vocabulary_hash(tokenizer_name: str) -> str:
    """sha256 (hex) of what a tokenizer's ids mean: a tiktoken vocabulary's ranks, split
    pattern and special tokens; a Hugging Face tokenizer's tokens and added tokens by id."""
    from minigpt.tokenizer import load_tokenizer

    enc = load_tokenizer(tokenizer_name)
    digest = hashlib.sha256()
    ranks = getattr(enc, "ranks", None)
    if ranks is not None:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            digest.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
        digest.update(json.dumps([enc.pattern, sorted(enc.special_tokens.items())]).encode())
    else:
        vocab = enc.inner.get_vocab(with_added_tokens=True)
        digest.update(json.dumps(sorted(vocab.items(), key=lambda item: item[1])).encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says, checked against the file's length."""

    path: Path
    dtype: np.dtype
    header_bytes: int
    first: int  # the place of the shard's first token in its split's stream
    tokens: int
    documents: int
    vocab_hash: str
    tokenizer: str

    @property
    def index_offset(self) -> int:
        return self.header_bytes + self.tokens * self.dtype.itemsize


def pack_header(*, dtype: np.dtype, first: int, tokens: int, documents: int, vocab_hash: str,
                tokenizer: str) -> bytes:
    name = tokenizer.encode("utf-8")
    if _FIELDS.size + len(name) > HEADER_BYTES:
        raise DataError(f"the tokenizer's name {tokenizer!r} is too long for a shard header "
                        f"({len(name)} bytes; at most {HEADER_BYTES - _FIELDS.size}): give its "
                        f"folder a shorter path")
    fields = _FIELDS.pack(MAGIC, VERSION, dtype.itemsize, HEADER_BYTES, first, tokens, documents,
                          bytes.fromhex(vocab_hash), len(name))
    return (fields + name).ljust(HEADER_BYTES, b"\0")


def read_header(path: str | Path) -> ShardHeader:
    """A shard's header, refused (DataError, saying to prepare again) unless it is a minigpt
    shard of a version this code reads whose length is what its counts say."""
    path = Path(path)
    again = "prepare the corpus again (python -m minigpt.data prepare --source ...)"
    try:
        with open(path, "rb") as f:
            raw = f.read(_FIELDS.size)
            size = os.fstat(f.fileno()).st_size
            (magic, version, itemsize, header_bytes, first, tokens, documents, vocab, name_len
             ) = _FIELDS.unpack(raw) if len(raw) == _FIELDS.size else (b"",) + (0,) * 8
            f.seek(_FIELDS.size)
            name = f.read(name_len)
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror}; {again}") from None
    if magic != MAGIC:
        raise DataError(f"{path} is not a minigpt shard (its header does not start with "
                        f"{MAGIC.decode()}): {again}")
    if version != VERSION:
        raise DataError(f"{path} is a shard of format version {version}; this minigpt reads "
                        f"version {VERSION}: {again} with this version")
    if itemsize not in _DTYPES or not _FIELDS.size + name_len <= header_bytes <= size:
        raise DataError(f"{path} has a damaged header (token size {itemsize}, header "
                        f"{header_bytes} bytes): {again}")
    expected = header_bytes + tokens * itemsize + 16 * documents
    if size != expected:
        raise DataError(f"{path} has {size:,} bytes, but its header counts {tokens:,} tokens "
                        f"and {documents:,} documents ({expected:,} bytes): it is cut short or "
                        f"damaged; {again}")
    try:
        tokenizer = name.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} has a damaged header (the tokenizer's name): {again}") from None
    return ShardHeader(path, _DTYPES[itemsize], header_bytes, first, tokens, documents,
                       vocab.hex(), tokenizer)


def document_index(header: ShardHeader) -> tuple[np.ndarray, np.ndarray]:
    """A shard's document index: (starts in the shard, ordinals), each uint64 [documents]."""
    if header.documents == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    index = np.fromfile(header.path, dtype="<u8", count=2 * header.documents,
                        offset=header.index_offset)
    return index[:header.documents], index[header.documents:]


class ShardWriter:
    """Writes one split's stream into shards of `shard_tokens` tokens under `folder`.

    `append` takes tokens and where documents start in them; tokens before `position` (the
    place in the stream where writing resumes: a whole number of shards) are dropped, so a
    resumed preparation can feed the writer from the start of the document the last finished
    shard ends inside (`done`: that shard's `complete`). Each full shard is renamed into place
    and `on_shard` is called with the writer; `finish` writes the last, shorter one."""

    def __init__(self, folder: Path, split: str, *, shard_tokens: int, dtype: np.dtype,
                 tokenizer: str, vocab_hash: str, position: int = 0,
                 done: tuple[int, int] | None = None,
                 on_shard: Callable[[ShardWriter], None] | None = None):
        if position % shard_tokens:
            raise ValueError("a writer resumes at a shard boundary")
        self.folder, self.split, self.shard_tokens, self.dtype = folder, split, shard_tokens, dtype
        self.tokenizer, self.vocab_hash, self.on_shard = tokenizer, vocab_hash, on_shard
        self.position = position  # stream tokens written or dropped so far
        self.shards = position // shard_tokens  # complete shards in place
        # (ordinal, end in the stream) of the last document wholly in finished shards, and of
        # the last one wholly appended
        self.complete, self._done = done, done
        self._file = None
        self._starts: list[np.ndarray] = []
        self._ordinals: list[np.ndarray] = []

    @property
    def _shard_first(self) -> int:
        return self.shards * self.shard_tokens

    def append(self, tokens: np.ndarray, starts: np.ndarray, ordinals: np.ndarray,
               stream_start: int) -> None:
        """Write `tokens`, which begin at `stream_start` in the split's stream, with documents
        (numbered `ordinals`) starting at offsets `starts` into them; the first starts at 0."""
        if not len(starts):
            return
        ends = np.append(starts[1:], len(tokens))
        skip = max(0, self.position - stream_start)
        done = 0
        while skip + done < len(tokens):
            at = stream_start + skip + done
            room = self._shard_first + self.shard_tokens - at
            piece = tokens[skip + done: skip + done + room]
            self._write(piece, starts, ordinals, stream_start, at)
            done += len(piece)
            self.position = at + len(piece)
            if self.position == self._shard_first + self.shard_tokens:
                self._note_complete(ends, ordinals, stream_start)
                self._close_shard()
        if len(ordinals):  # every append holds whole documents
            self._done = (int(ordinals[-1]), stream_start + len(tokens))

    def _write(self, piece: np.ndarray, starts, ordinals, stream_start: int, at: int) -> None:
        with _naming(lambda: self._tmp):
            self._write_piece(piece, starts, ordinals, stream_start, at)

    def _write_piece(self, piece: np.ndarray, starts, ordinals, stream_start: int,
                     at: int) -> None:
        if self._file is None:
            self._tmp = self.folder / (shard_name(self.split, self.shards) + ".tmp")
            self._file = open(self._tmp, "wb")
            self._file.write(b"\0" * HEADER_BYTES)
            self._starts, self._ordinals = [], []
        absolute = starts.astype(np.int64) + stream_start
        inside = (absolute >= at) & (absolute < at + len(piece))
        self._starts.append((absolute[inside] - self._shard_first).astype(np.uint64))
        self._ordinals.append(ordinals[inside].astype(np.uint64))
        self._file.write(piece.astype(self.dtype, copy=False).tobytes())

    def _note_complete(self, ends, ordinals, stream_start: int) -> None:
        """Remember the last document that ends at or before the finished shard's end: a
        resumed preparation skips every document up to it."""
        boundary = self._shard_first + self.shard_tokens
        finished = np.flatnonzero(ends.astype(np.int64) + stream_start <= boundary)
        if len(finished):
            self._done = (int(ordinals[finished[-1]]), int(ends[finished[-1]]) + stream_start)
        self.complete = self._done

    def _close_shard(self) -> None:
        with _naming(lambda: self._tmp):
            self._close()

    def _close(self) -> None:
        starts = np.concatenate(self._starts) if self._starts else np.zeros(0, np.uint64)
        ordinals = np.concatenate(self._ordinals) if self._ordinals else np.zeros(0, np.uint64)
        tokens = self.position - self._shard_first
        self._file.write(starts.tobytes() + ordinals.tobytes())
        self._file.seek(0)
        self._file.write(pack_header(dtype=self.dtype, first=self._shard_first, tokens=tokens,
                                     documents=len(starts), vocab_hash=self.vocab_hash,
                                     tokenizer=self.tokenizer))
        self._file.flush()
        os.fsync(self._file.fileno())  # a shard that is named is on the disk
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.folder / shard_name(self.split, self.shards))
        self.shards += 1
        if self.on_shard is not None:
            self.on_shard(self)

    def finish(self) -> None:
        """Write the last shard (shorter than the others) if it holds any token."""
        if self._file is not None:
            self._close_shard()

    def discard(self) -> None:
        """Close and delete the shard being written (a refused or interrupted preparation)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._tmp.unlink(missing_ok=True)
