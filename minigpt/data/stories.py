"""Story text files: how a file of stories is read, in batches of whole stories.

Everything that reads raw story text (pre-tokenization, tokenizer training, the learning-quality
benchmark) reads it here, so the rules are the same everywhere (data/README.md says them for
users):

- Layout: a file holding `<|endoftext|>` anywhere is split on it (the TinyStories `.txt` layout,
  a separator line between stories). A file without it holds one story per blank-line-separated
  block. A file with neither is refused: it is one undivided text, most likely the wrong file.
- Each story is stripped of surrounding whitespace; empty ones are skipped.
- A last story with no closing separator is kept if the file ends with a line break and dropped
  if the file ends mid-line, which is what a cut-off copy looks like (the drop is reported and
  recorded). Verified downloads are complete by construction and always keep it.
- Text must be UTF-8; an invalid byte is reported with the file and its byte offset.

A file is read in chunks of about 8 MB of whole stories, so a 2 GB source never sits in memory as
one string, and its sha256 is computed on the way. Each chunk starts where the stories of the one
before end, so reading from any of those places cuts the rest of the file the same way.
"""

from __future__ import annotations

import hashlib
import mmap
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from minigpt.data.token_files import DataError

SEPARATOR = "<|endoftext|>"
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

    def batches(self, chunk_bytes: int | None = None, start: int = 0
                ) -> Iterator[tuple[list[str], int]]:
        """Yield (stories, bytes of the file they span), computing the file's sha256 on the way
        (of the whole file only when reading from its `start` 0). `position` is then the byte
        where the stories not yet yielded start: a later call may begin there."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        hasher = hashlib.sha256()
        offset, buf = start, b""
        self.position = start
        with open(self.path, "rb") as f:
            f.seek(start)
            while chunk := f.read(chunk_bytes):
                buf = buf + chunk if buf else chunk
                if offset == 0 and buf.startswith(_BOM):
                    hasher.update(_BOM)
                    buf, offset = buf[len(_BOM):], len(_BOM)
                boundary = self._last_boundary(buf)
                if boundary is None:
                    continue  # a story longer than a chunk: read on
                stories = self._split(buf[:boundary[0]], offset)
                hasher.update(buf[:boundary[1]])
                offset += boundary[1]
                # The next batch is read afresh from the byte after this one's last separator,
                # so batches begin at the same places whatever `start` was: a preparation that
                # resumes at one cuts the rest of the file as an uninterrupted one did.
                buf = b""
                f.seek(offset)
                self.stories += len(stories)
                self.position = offset
                yield stories, boundary[1]
        hasher.update(buf)
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
        self.position = offset + len(buf)
        yield tail, len(buf)
