"""Safetensors files, the format Hugging Face checkpoints use: read memory-mapped, written whole.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. A checkpoint larger than one file is several files and a
`model.safetensors.index.json` saying which file holds which tensor; `Checkpoint` reads both
layouts the same way.

Checkpoint folders come from strangers, so this is the one door their bytes come in by. A
header is checked whole when its file is opened, before any tensor exists (a bounded length, a
JSON object, known dtypes, byte counts that match dtype x shape, byte ranges inside the data and
never shared), and the files an index names must stay inside the folder (or, in a Hugging Face
cache, in that repository's blobs), checked before anything is opened. A refusal is one-line
`WeightsError` naming the file, tensor or index entry, and never showing the bytes of anything.

We read the format ourselves, though the `safetensors` package reads it too (the tests check the
two agree), because our reader hands out NumPy views of a memory-mapped file: transposes, splits
and reshapes compose on the views before a device's slice is taken, so loading one device's
shard of a parameter reads only that shard's bytes from disk.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from minigpt.errors import UserError
from minigpt.files import write_chunks_atomic, write_text_atomic

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own bound; real headers are kilobytes
MAX_RANK = 32  # NumPy 1's bound on an array's dimensions; no checkpoint comes near it


class WeightsError(UserError, RuntimeError):
    """A weights file is missing, damaged or not what its header says; the message says which."""


class _Invalid(Exception):
    """What is wrong with a file, said without the file's name, which the caller adds."""


class Entry(NamedTuple):
    """One tensor as a checked header describes it: bytes [begin, end) of the data section."""
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One .safetensors file, checked whole when opened, then memory-mapped: `file[name]` is a
    read-only NumPy view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                length, header = _read_header(f, size)
                data_size = size - 8 - length
                self.metadata, self.entries = _check_header(header, data_size)
                # the file already open is mapped: a path swapped after the checks changes nothing
                self._data = (np.memmap(f, np.uint8, mode="r", offset=8 + length,
                                        shape=(data_size,))
                              if data_size else np.zeros(0, np.uint8))
        except _Invalid as problem:
            raise WeightsError(f"{self.path}: {problem}") from None
        except OSError as error:
            raise WeightsError(f"{self.path} cannot be read ({error.strerror or error})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name].dtype

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        return self._data[entry.begin:entry.end].view(entry.dtype).reshape(entry.shape)


def _read_header(f, size: int) -> tuple[int, Any]:
    """The header's length and parsed JSON; a length no real file has is refused unread."""
    if size < 8:
        raise _Invalid(f"the file is truncated: {size} bytes cannot hold the 8-byte header "
                       f"length (an interrupted download? fetch the file again)")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > MAX_HEADER_BYTES:
        raise _Invalid(f"its first 8 bytes announce a header of {length:,} bytes, beyond the "
                       f"{MAX_HEADER_BYTES:,} any safetensors file has: is it one?")
    raw = f.read(length)
    if len(raw) < length:
        raise _Invalid(f"the file is truncated: its header needs {length:,} bytes but "
                       f"{len(raw):,} follow (an interrupted download? fetch the file again)")
    return length, _parse_json(raw, "the header")


def _check_header(header: Any, data_size: int) -> tuple[dict[str, str], dict[str, Entry]]:
    if not isinstance(header, dict):
        raise _Invalid(f"the header is a JSON {_kind(header)}, not an object naming tensors")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is what the safetensors package reads
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _Invalid("the header's __metadata__ is not an object of strings")
    entries = {name: _check_entry(f"tensor {_quote(name)}", entry, data_size)
               for name, entry in header.items()}
    _check_disjoint(entries)
    return metadata, entries


def _check_entry(what: str, entry: Any, data_size: int) -> Entry:
    if not isinstance(entry, dict):
        raise _Invalid(f"{what} is a JSON {_kind(entry)}, not an object of dtype, shape and "
                       f"data_offsets")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise _Invalid(f"{what} has no {' and no '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _Invalid(f"{what} has dtype {_quote(dtype)}, which minigpt does not read (it "
                       f"reads {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK
            and all(type(n) is int and n >= 0 for n in shape)):  # bool is not int here
        raise _Invalid(f"{what} has shape {_quote(shape)}, not a list of at most {MAX_RANK} "
                       f"non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(n) is int for n in offsets)):
        raise _Invalid(f"{what} has data_offsets {_quote(offsets)}, not two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _Invalid(f"{what} has data_offsets {_quote(offsets)}, not 0 <= begin <= end")
    itemsize = DTYPES[dtype].itemsize
    if end - begin != math.prod(shape) * itemsize:
        raise _Invalid(f"{what} holds {end - begin:,} bytes but its shape {_quote(shape)} of "
                       f"{dtype} needs {math.prod(shape) * itemsize:,}")
    if math.prod(n for n in shape if n) * itemsize >= 2**63:  # NumPy's bound, even when empty
        raise _Invalid(f"{what} has shape {_quote(shape)}, larger than any array can be")
    if end > data_size:
        raise _Invalid(f"{what} ends at byte {end:,}, past the {data_size:,}-byte data section: "
                       f"the file is truncated (an interrupted download? fetch it again) or "
                       f"damaged")
    return Entry(DTYPES[dtype], tuple(shape), begin, end)


def _check_disjoint(entries: dict[str, Entry]) -> None:
    """Refuse two tensors sharing bytes, which would hand one the other's values: sorted by
    where they begin, each must end before the next begins (empty ones hold no bytes)."""
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise _Invalid(f"tensors {_quote(first)} and {_quote(second)} share bytes {begin:,} "
                           f"to {end:,}: each tensor needs bytes of its own (a damaged or "
                           f"hand-made file)")


def _parse_json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise _Invalid(f"{what} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise _Invalid(f"{what} is not JSON ({error.msg} at byte {error.pos:,})") from None
    except (ValueError, RecursionError):  # a number of thousands of digits, nesting too deep
        raise _Invalid(f"{what} is JSON too deeply nested or with too long a number") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused if a key repeats: the second tensor of a name would hide the first."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Invalid(f"{_quote(key)} appears twice in one JSON object")
        obj[key] = value
    return obj


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), "null")


def _quote(value: Any) -> str:
    """A name or value from a file, on one line and cut short: the file may hold anything."""
    if isinstance(value, dict) or (isinstance(value, list)
                                   and any(isinstance(v, (dict, list)) for v in value)):
        return f"a JSON {_kind(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Checkpoint:
    """The weights of a Hugging Face model directory: `model.safetensors`, or the files an
    index names. `checkpoint[name]` is a memory-mapped view."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / INDEX
        self.files: dict[str, SafetensorsFile] = {}
        if os.path.lexists(index):  # not following a link before checking where it leads
            weight_map = _read_index(resolve_inside(directory, INDEX, str(index)), index)
            paths = {file: resolve_inside(directory, file, f"{index} entry {_quote(name)}")
                     for name, file in weight_map.items()}  # all checked before any is opened
            for file, path in paths.items():
                if not path.is_file():
                    raise WeightsError(f"{index} names {_quote(file)}, which is not in "
                                       f"{directory}")
            opened = {file: SafetensorsFile(path) for file, path in paths.items()}
            for name, file in weight_map.items():
                if name not in opened[file]:
                    raise WeightsError(f"{index} puts {_quote(name)} in {_quote(file)}, which "
                                       f"does not hold it")
                self.files[name] = opened[file]
        elif os.path.lexists(directory / SINGLE):
            single = SafetensorsFile(resolve_inside(directory, SINGLE, str(directory / SINGLE)))
            self.files = {name: single for name in single.keys()}
        else:
            found = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pth"))
            hint = (f" (it holds {', '.join(found[:3])}: PyTorch pickles, which minigpt does "
                    f"not load; convert them to safetensors first)" if found else "")
            raise WeightsError(f"{directory} holds neither {SINGLE} nor {INDEX}{hint}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[name].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.files[name].dtype(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.files[name][name]


def _read_index(path: Path, shown: Path) -> dict[str, str]:
    """An index's weight_map, from tensor names to the file names that hold them."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
        if len(raw) > MAX_HEADER_BYTES:
            raise _Invalid(f"it is larger than {MAX_HEADER_BYTES:,} bytes")
        index = _parse_json(raw, "it")
        if not isinstance(index, dict):
            raise _Invalid(f"it is a JSON {_kind(index)}, not an object with a weight_map")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise _Invalid(f"its weight_map is a JSON {_kind(weight_map)}, not an object from "
                           f"tensor names to file names")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise _Invalid(f"its weight_map gives tensor {_quote(name)} a JSON "
                               f"{_kind(file)}, not a file name")
        return weight_map
    except _Invalid as problem:
        raise WeightsError(f"{shown} is not a safetensors index: {problem}") from None
    except OSError as error:
        raise WeightsError(f"{shown} cannot be read ({error.strerror or error})") from None


def resolve_inside(directory: Path, name: str, what: str) -> Path:
    """The real path `name` leads to from `directory`, refused (naming `what`, and saying
    nothing of what lies outside) unless it stays in the folder or, in a Hugging Face cache,
    leads from a snapshot to that repository's blobs. Deciding follows links; it opens nothing."""
    if (not name or "\0" in name or "\\" in name or PureWindowsPath(name).drive
            or PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts):
        raise WeightsError(f"{what} names {_quote(name)}, which is not a path relative to the "
                           f"model folder; refusing it")
    root = Path(os.path.realpath(directory))
    target = Path(os.path.realpath(root / name))
    if target.is_relative_to(root) or _hub_blob(root, target):
        if target.exists() and not target.is_file():  # a FIFO, a device, a folder
            raise WeightsError(f"{what} names {_quote(name)}, which is not a regular file")
        return target
    raise WeightsError(f"{what} names {_quote(name)}, which leads outside {directory}: minigpt "
                       f"opens only files inside a model folder (or, in a Hugging Face cache, "
                       f"the snapshot's own blobs), so it refuses it")


def _hub_blob(root: Path, target: Path) -> bool:
    """Whether `root` lies in a snapshot of a Hugging Face cache repository
    (`models--owner--name/snapshots/<commit>/`) and `target` is one of that repository's
    `blobs/`, where the cache keeps the bytes its snapshots' links point to."""
    snapshot = next((p for p in (root, *root.parents) if p.parent.name == "snapshots"), None)
    if snapshot is None:
        return False
    repo = snapshot.parent.parent
    return repo.name.startswith("models--") and target.parent == repo / "blobs"


def encode(tensors: dict[str, np.ndarray],
           metadata: dict[str, str] | None = None) -> Iterator[bytes]:
    """A safetensors file's bytes, piece by piece: header, then each tensor in name order."""
    header, offset = {}, 0
    for name in sorted(tensors):
        array = tensors[name]
        if array.dtype not in NAMES:
            raise WeightsError(f"cannot write {name}: dtype {array.dtype} has no safetensors name")
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    yield struct.pack("<Q", len(text)) + text
    for name in sorted(tensors):
        yield np.ascontiguousarray(tensors[name]).tobytes()


def save(tensors: dict[str, np.ndarray], directory: str | Path, *, max_file_bytes: int = 2**31,
         metadata: dict[str, str] | None = None) -> list[Path]:
    """Write tensors as `model.safetensors`, or, when they exceed `max_file_bytes`, as
    `model-0000i-of-0000n.safetensors` files and an index; each file is written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if groups[-1] and size + tensors[name].nbytes > max_file_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += tensors[name].nbytes
    metadata = {"format": "pt", **(metadata or {})}  # transformers checks for "pt"
    if len(groups) == 1:
        write_chunks_atomic(directory / SINGLE, encode(groups[0], metadata))
        return [directory / SINGLE]
    paths, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        path = directory / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_chunks_atomic(path, encode(group, metadata))
        paths.append(path)
        weight_map.update(dict.fromkeys(group, path.name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    write_text_atomic(directory / INDEX, json.dumps(index, indent=2) + "\n")
    return [*paths, directory / INDEX]
