"""Writing files so that a crash never leaves half of one under its real name.

Every file minigpt writes whole (config.json, meta.json, metrics.jsonl when it is rewritten on
resume, loss.png) goes to a temporary name beside its destination and is renamed over it only
once complete; a rename within one directory is atomic, so readers see the old file or the new
one, never a torn one. Files are fingerprinted with `sha256` (downloads, prepared data, tokenizer
provenance, imported checkpoints): one routine, reading in chunks so a 2 GB file never sits in
memory.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.resources
import os
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on failure it is removed.

    The temporary name keeps the destination's suffix (`loss.tmp.png`), so tools that pick a
    format by suffix, such as matplotlib, still do.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_chunks_atomic(path: str | Path, chunks: Iterable[bytes]) -> None:
    """Write the chunks one after another (a large file never sits whole in memory)."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


CHUNK_BYTES = 1 << 20


def sha256(path: str | Path, hasher=None) -> str:
    """The hex sha256 of a file's bytes. A running `hasher` (hashlib.sha256()) is updated with
    them instead of a new one, so a download can hash the part it already holds, then go on."""
    hasher = hasher or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def shipped_folder(name: str) -> Path:
    """A folder of files minigpt ships beside its code (`presets`, `recipes`): inside the
    installed package (a wheel puts the repository's top-level folder there), or, running from
    a source checkout (an editable install), that top-level folder itself. The repository keeps
    one copy of each file; pyproject.toml maps the folder into the package."""
    installed = Path(str(importlib.resources.files("minigpt"))) / name
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / name


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """" (did you mean 'fsdp'?)" for a name close to one of `known`, else ""."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(kind: str, name: str, known: Sequence[str], *, also: str = "") -> str:
    """The one-line refusal of a name that is not one of `known`: what was asked, the closest
    known name, and every known one."""
    return (f"unknown {kind} {name!r}{did_you_mean(name, known)}: choose one of "
            f"{', '.join(known) or '(none found)'}{also}")


def read_named_toml(name_or_path: str | Path, directory: Path, kind: str,
                    error: type[Exception]) -> tuple[Path, dict[str, Any]]:
    """The file `directory/<name>.toml` (a preset, a recipe), or the .toml file at a path, and
    its contents. An unknown name (the message names the closest and lists the known ones) or
    invalid TOML raises `error`."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = directory / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.toml"))
        raise error(unknown_name(kind, str(name_or_path), known,
                                 also=" or give the path of a .toml file"))
    try:
        return path, tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise error(f"{kind} {path.stem!r} ({path}) is not valid TOML: {e}") from None
