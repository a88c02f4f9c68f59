"""Documents from a corpus source, in order, in tasks a worker can tokenize, each with the place a
resumed preparation starts again from.

A source (`python -m minigpt.data prepare --source ...`) is a file, a folder (its files, by
name, all the way down), a glob (`dumps/*.parquet`, `**` too), or `hf:NAME[:CONFIG][@REVISION]`:
a Hugging Face dataset's train split, streamed through `datasets` (the `datasets` extra; a local
dataset folder works as NAME). A file is read by its suffix: `.jsonl` / `.json` (one JSON object
a line, its text in `text_field`), `.parquet` (the `text_field` column; needs pyarrow, in the
extra), anything else as plain text, documents separated by `<|endoftext|>` lines (or blank
lines), read by `minigpt.data.stories`' rules. A document whose text is empty (or null) is left
out; every other is document number n of the corpus, counted from 0 in source order.

`tasks` cuts a source into `Task`s of a few MB: raw JSON lines (a worker parses them, so parsing
runs on every core), or texts. Each task carries its `position` (file and byte offset, file and
row batch, or documents into a dataset) so that a preparation can begin again at any task.
`texts` turns a task's payload into its documents' texts, naming the file and line of any
record it refuses.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minigpt.data.stories import StoryFile
from minigpt.data.token_files import DataError

JSONL_BYTES = 1 << 20  # raw JSON lines per task: about 250,000 tokens, a quarter second
PARQUET_ROWS = 2048  # rows per task
DATASET_ROWS = 1024  # records of a streamed dataset per task
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED = (".gz", ".zst", ".bz2", ".xz")


@dataclasses.dataclass(frozen=True)
class Source:
    """What `--source` names: files in order, or a Hugging Face dataset. A caller may also fix
    each file's split (`splits`, one per file: a dataset's own validation file; none: every
    document's split by the hash of its text) and say the text files are whole (`complete`:
    verified downloads, whose last story needs no closing separator)."""

    spec: str
    files: tuple[Path, ...] = ()
    dataset: tuple[str, str | None, str | None] | None = None  # name, config, revision
    splits: tuple[str, ...] = ()
    complete: bool = False

    def identity(self) -> list[dict[str, Any]]:
        """What the corpus was made of, for meta.json; a changed file changes it."""
        if self.dataset is not None:
            name, config, revision = self.dataset
            return [{"dataset": name, "config": config, "revision": revision}]
        fixed = self.splits or (None,) * len(self.files)
        return [{"path": str(p.resolve()), "bytes": p.stat().st_size,
                 "mtime_ns": p.stat().st_mtime_ns, **({"split": split} if split else {})}
                for p, split in zip(self.files, fixed)]

    def total_bytes(self) -> int | None:
        return None if self.dataset is not None else sum(p.stat().st_size for p in self.files)


@dataclasses.dataclass(frozen=True)
class Task:
    """A piece of the source for one worker: `kind` "jsonl" (payload: raw lines) or "texts"."""

    seq: int  # tasks are numbered from 0 through the whole source
    position: dict[str, int]  # where this task starts: `tasks(source, position)` begins here
    kind: str
    payload: Any
    where: str  # the file (and first line) it comes from, for messages
    nbytes: int  # bytes of the source it spans, for the progress bar
    split: str | None = None  # its documents' split, where its file's is fixed


def parse_source(spec: str, exclude: Path | None = None) -> Source:
    """The files or dataset `--source` names (never those under `exclude`: the output folder,
    should it lie inside a source folder); a name that matches nothing is refused."""
    if spec.startswith("hf:"):
        rest, _, revision = spec[3:].partition("@")
        name, _, config = rest.partition(":")
        if not name:
            raise DataError(f"--source {spec}: give a dataset, as hf:NAME[:CONFIG][@REVISION]")
        return Source(spec, dataset=(name, config or None, revision or None))
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
    if exclude is not None:
        files = [p for p in files if not p.resolve().is_relative_to(exclude.resolve())]
    if not files:
        raise DataError(f"--source {spec}: no such file, folder or matching files (a source is "
                        f"a .jsonl, .parquet or text file, a folder or glob of them, or "
                        f"hf:NAME[:CONFIG][@REVISION])")
    packed = [str(p) for p in files if p.suffix.lower() in COMPRESSED]
    if packed:
        raise DataError(f"{packed[0]} is compressed: decompress it first (a resumed preparation "
                        f"needs to seek in the text)")
    return Source(spec, files=tuple(files))


def kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSON_SUFFIXES else "parquet" if suffix == ".parquet" else "text"


def tasks(source: Source, text_field: str, start: dict[str, int] | None = None,
          seq: int = 0) -> Iterator[Task]:
    """The source's tasks in order, from `start` (a task's position; None: the beginning),
    numbered from `seq`."""
    start = start or {}
    if source.dataset is not None:
        readers = [(None, _dataset_tasks(source, text_field, start.get("documents", 0)))]
    else:
        first = start.get("file", 0)
        fixed = source.splits or (None,) * len(source.files)
        readers = ((fixed[i], _file_tasks(i, path, text_field, start if i == first else {},
                                          complete=source.complete))
                   for i, path in enumerate(source.files) if i >= first)
    for split, reader in readers:
        for position, kind, payload, where, nbytes in reader:
            yield Task(seq, position, kind, payload, where, nbytes, split)
            seq += 1


def _file_tasks(index: int, path: Path, text_field: str, start: dict[str, int], *,
                complete: bool = False):
    kind = kind_of(path)
    if kind == "jsonl":
        yield from _jsonl_tasks(index, path, start.get("offset", 0))
    elif kind == "parquet":
        yield from _parquet_tasks(index, path, text_field, start.get("batch", 0))
    else:
        story_file = StoryFile(path, complete=complete)
        offset = start.get("offset", 0)
        for stories, nbytes in story_file.batches(start=offset):
            yield {"file": index, "offset": offset}, "texts", stories, str(path), nbytes
            offset = story_file.position


def _jsonl_tasks(index: int, path: Path, offset: int):
    """Chunks of whole lines from `offset` (a line's start). Each is read afresh from where the
    one before ended, so a reader started at any chunk's start cuts the same chunks after it."""
    line = 1 + (_count_lines(path, offset) if offset else 0)
    with open(path, "rb") as f:
        while True:
            f.seek(offset)
            body = f.read(JSONL_BYTES)
            if not body:
                return
            cut = body.rfind(b"\n") + 1
            while cut == 0:  # a line longer than a chunk, or a last line without its break
                more = f.read(JSONL_BYTES)
                cut = len(body) + more.find(b"\n") + 1 if more else len(body)
                body += more
            body = body[:cut]
            yield {"file": index, "offset": offset}, "jsonl", body, f"{path}, line {line}", cut
            offset += cut
            line += body.count(b"\n")


def _count_lines(path: Path, offset: int) -> int:
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(JSONL_BYTES, offset - done))
            count += block.count(b"\n")
            done += len(block)
    return count


def _parquet_tasks(index: int, path: Path, text_field: str, batch: int):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install -e "
                        f"\".[datasets]\" (or pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own errors for a file it cannot read
        raise DataError(f"{path} cannot be read as parquet: {error}") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path} has no column {text_field!r} (it has {', '.join(columns)}): "
                        f"--text-field names the column that holds the text")
    size = max(1, path.stat().st_size // max(1, parquet.metadata.num_rows) * PARQUET_ROWS)
    batches, number = parquet.iter_batches(batch_size=PARQUET_ROWS, columns=[text_field]), 0
    while True:
        try:
            rows = next(batches)
        except StopIteration:
            return
        except Exception as error:  # a damaged row group: pyarrow's own errors, or OSError
            raise DataError(f"{path}: the rows from {number * PARQUET_ROWS:,} on cannot be read "
                            f"({error}): the file is damaged; replace it or leave it out of "
                            f"--source") from None
        if number >= batch:
            yield ({"file": index, "batch": number}, "texts", rows.column(0).to_pylist(),
                   f"{path}, rows from {number * PARQUET_ROWS}", size)
        number += 1


def _dataset_tasks(source: Source, text_field: str, skip: int):
    name, config, revision = source.dataset
    try:
        import datasets
    except ImportError:
        raise DataError(f"--source {source.spec} streams a Hugging Face dataset, which needs "
                        f"the datasets library: pip install -e \".[datasets]\"") from None
    try:
        stream = datasets.load_dataset(name, config, revision=revision, split="train",
                                       streaming=True)
        if skip:
            stream = stream.skip(skip)
        batch, done = [], skip
        for record in stream:
            if text_field not in record:
                raise DataError(f"{source.spec}: its records have no field {text_field!r} "
                                f"(they have {', '.join(record)}): --text-field names the "
                                f"field that holds the text")
            batch.append(record[text_field])
            if len(batch) == DATASET_ROWS:
                yield ({"documents": done}, "texts", batch, f"{source.spec}, record {done}",
                       sum(len(t or "") for t in batch))
                done += len(batch)
                batch = []
        if batch:
            yield ({"documents": done}, "texts", batch, f"{source.spec}, record {done}",
                   sum(len(t or "") for t in batch))
    except DataError:
        raise
    except Exception as error:  # the library's many errors: not found, offline, bad config
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"--source {source.spec}: the datasets library cannot stream it "
                        f"({first[:200]})") from None


def texts(kind: str, payload: Any, where: str, text_field: str) -> list[str | None]:
    """A task's documents' texts (None or "" for an empty one, left out later)."""
    if kind == "texts":
        for i, text in enumerate(payload):
            if text is not None and not isinstance(text, str):
                raise DataError(f"{where}: record {i} holds {type(text).__name__}, not text, "
                                f"in {text_field!r}")
        return payload
    lines = [line for line in payload.split(b"\n") if line.strip()]
    try:  # one parse for the whole task: half the time of a parse per line
        records = json.loads(b"[" + b",".join(lines) + b"]")
        found = [r[text_field] for r in records]
        if all(t is None or isinstance(t, str) for t in found):
            return found
    except (ValueError, TypeError, KeyError):
        pass
    return _texts_line_by_line(payload, where, text_field)  # to say which line is wrong


def _texts_line_by_line(payload: bytes, where: str, text_field: str) -> list[str | None]:
    path, _, first = where.rpartition(", line ")
    out = []
    for n, line in enumerate(payload.split(b"\n"), int(first)):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataError(f"{path}, line {n}: not a JSON object "
                            f"({getattr(error, 'msg', error)})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}, line {n}: no field {text_field!r} (it has {keys}): "
                            f"--text-field names the field that holds the text")
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{path}, line {n}: {text_field!r} holds "
                            f"{type(text).__name__}, not text")
        out.append(text)
    return out
