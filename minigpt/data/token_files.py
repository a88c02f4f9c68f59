"""The prepared-data format: token files, their meta.json, and the one check that they agree.

A prepared data directory holds `train.bin` and `val.bin`, each the stream of a split's stories as
token ids (`uint16` when the vocabulary fits, stories separated by the `<|endoftext|>` token), and
`meta.json`, which records the tokenizer, the dtype, each split's token and story counts and where
the text came from. meta.json is written last, so a directory whose meta.json exists and whose
token files have exactly the sizes it records is complete. Everything that prepares or reads data
(`pretokenize`, `download`, `data`, `loader`) builds on this module, which imports none of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.errors import UserError
from minigpt.files import read_json_object, write_text_atomic

SPLITS = ("train", "val")


class DataError(UserError, ValueError):
    """A problem with data a user gave or asked for; the message says what to do."""


def split_path(data_dir: str | Path, split: str) -> Path:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    return Path(data_dir) / f"{split}.bin"


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    """The meta.json of a prepared directory: tokenizer, token and story counts, source hashes."""
    path = Path(data_dir) / "meta.json"
    missing = (f"{path} not found: {data_dir} is not a prepared data directory; run "
               f"`python -m minigpt.data prepare`")
    try:
        return read_json_object(path, DataError, missing=missing)
    except DataError as error:
        raise DataError(str(error) if str(error) == missing
                        else f"{error}; prepare the data again") from None


def write_meta(data_dir: str | Path, meta: dict[str, Any]) -> None:
    write_text_atomic(Path(data_dir) / "meta.json", json.dumps(meta, indent=2) + "\n")


def token_file_problem(data_dir: str | Path, meta: dict[str, Any]) -> str | None:
    """Why the token files do not match meta.json (missing, or another size), or None."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        path = split_path(data_dir, split)
        expected = meta[f"{split}_tokens"] * itemsize
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected:
            return (f"{path} has {path.stat().st_size:,} bytes, not the {expected:,} that "
                    f"meta.json records")
    return None


def open_split(data_dir: str | Path, split: str) -> np.ndarray:
    """A split's tokens, memory-mapped; refused if the directory is incomplete or damaged."""
    path = split_path(data_dir, split)
    meta = load_meta(data_dir)
    problem = token_file_problem(data_dir, meta)
    if problem:
        raise DataError(f"{problem}: delete {data_dir} and prepare the data again")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
