"""Safetensors files, the format Hugging Face checkpoints use: read memory-mapped, written whole.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. Reading maps the file into memory and hands out NumPy views, so
a tensor is read from disk only when (and where) it is sliced: loading one device's shard of a
parameter touches only those bytes. A checkpoint larger than one file is several files and a
`model.safetensors.index.json` saying which file holds which tensor; `Checkpoint` reads both
layouts the same way.

The format is small enough that reading it ourselves is simpler than the `safetensors` package's
NumPy API, which has no bfloat16; the tests check both against that package.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from minigpt.files import write_chunks_atomic, write_text_atomic

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WeightsError(RuntimeError):
    """A weights file is missing, damaged or not what its header says; the message says which."""


class SafetensorsFile:
    """One .safetensors file, memory-mapped: `file[name]` is a read-only NumPy view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError(f"header of {length:,} bytes in a {size:,}-byte file")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as error:  # JSONDecodeError is a ValueError
            raise WeightsError(f"{self.path} is not a readable safetensors file "
                               f"({type(error).__name__}: {error})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict] = header
        data_size = size - 8 - length
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                raise WeightsError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, "
                                   f"which minigpt does not read")
            itemsize = DTYPES[entry["dtype"]].itemsize
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * itemsize
            if end - begin != expected:
                raise WeightsError(f"{self.path}: tensor {name} holds {end - begin:,} bytes but "
                                   f"its shape {entry['shape']} needs {expected:,}")
            if end > data_size:
                raise WeightsError(f"{self.path} is truncated: tensor {name} ends at byte "
                                   f"{end:,} of a {data_size:,}-byte data section (an "
                                   f"interrupted download? fetch the file again)")
        self._data = (np.memmap(self.path, np.uint8, mode="r", offset=8 + length)
                      if data_size else np.zeros(0, np.uint8))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        return self._data[begin:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


class Checkpoint:
    """The weights of a Hugging Face model directory: `model.safetensors`, or the files an
    index names. `checkpoint[name]` is a memory-mapped view."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / INDEX
        self.files: dict[str, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as error:
                raise WeightsError(f"{index} is not a safetensors index ({error})") from None
            opened = {}
            for name, file in weight_map.items():
                if file not in opened:
                    if not (directory / file).is_file():
                        raise WeightsError(f"{index} names {file}, which is not in {directory}")
                    opened[file] = SafetensorsFile(directory / file)
                if name not in opened[file]:
                    raise WeightsError(f"{index} puts {name} in {file}, which does not hold it")
                self.files[name] = opened[file]
        elif (directory / SINGLE).is_file():
            single = SafetensorsFile(directory / SINGLE)
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
