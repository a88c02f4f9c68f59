"""Folders of the one-file layout (`train.bin`, `val.bin` and `meta.json`), which versions before
shards wrote for TinyStories and text files: whether one is current for its sources, so that it
is kept and read as it is (its runs resume on the very batches they would have read), and the
rule every preparation shares, that documents must be told apart.

Such a folder holds each split's stories end to end, each followed by the tokenizer's end token
(and preceded by its begin token where it has one); with no validation file, story i was held
out when floor((i+1)*f) > floor(i*f) for the val_fraction f. Everything is prepared in shards
now (`minigpt.data.prepare_source`); `minigpt.data.corpus` reads both layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minigpt.data.token_files import DataError, load_meta, token_file_problem
from minigpt.files import sha256
from minigpt.tokenizer import load_tokenizer


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


def separating_tokenizer(name: str):
    """The tokenizer `name`, which must have an end or a begin token to mark documents apart."""
    enc = load_tokenizer(name)
    if enc.eot_token is None and enc.bos_token is None:
        raise DataError(f"the tokenizer {name} has neither an end nor a begin token, so "
                        f"documents cannot be told apart in the token stream: give it one "
                        f"(eos_token in its tokenizer_config.json)")
    return enc
