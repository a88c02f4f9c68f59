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
import json
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


def first_line(error: BaseException) -> str:
    """What an exception says, as one short line (its type's name where it says nothing):
    libraries raise messages of many lines, and a user's error is one."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


# A JSON file a user gives (a checkpoint's config, a run's config.json, a tokenizer's configs)
# is small; a larger one is not what it claims to be, and is not read into memory to find out.
JSON_LIMIT = 64 << 20


def read_json_object(path: str | Path, error: type[Exception], *, missing: str | None = None,
                     kind: str = "a JSON object") -> dict[str, Any]:
    """The one reader of the JSON-object files minigpt is given: the object a file holds,
    refusing (as `error`, one line naming the file) one that is not UTF-8, not JSON, nested
    too deeply, larger than JSON_LIMIT or not an object. An absent file is {} (or, with
    `missing`, the refusal that message gives). Values are checked where they are used, each
    field with the type check of the configs (`minigpt.config.values.check_value`)."""
    path = Path(path)
    try:
        if path.stat().st_size > JSON_LIMIT:
            raise error(f"{path} holds {path.stat().st_size:,} bytes: too large for the JSON "
                        f"file it should be (at most {JSON_LIMIT:,})")
        value = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        if missing is None:
            return {}
        raise error(missing) from None
    except UnicodeDecodeError:
        raise error(f"{path} is not UTF-8 text, so it is not the JSON file it should be") \
            from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to be the JSON file it should be") from None
    except (OSError, ValueError) as problem:  # json.JSONDecodeError is a ValueError
        raise error(f"{path} is not valid JSON ({first_line(problem)})") from None
    if not isinstance(value, dict):
        raise error(f"{path} is not {kind} (it holds a JSON {_json_kind(value)})")
    return value


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


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
        if path.stat().st_size > JSON_LIMIT:
            raise error(f"{kind} {path.stem!r} ({path}) is {path.stat().st_size:,} bytes: a "
                        f"{kind} file is a few lines of TOML")
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise error(f"{kind} {path.stem!r} ({path}) is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise error(f"{kind} {path.stem!r} ({path}) is not UTF-8 text (TOML files are): save it "
                    f"as UTF-8") from None
    except RecursionError:
        raise error(f"{kind} {path.stem!r} ({path}) nests tables or arrays too deeply") from None
    except OSError as e:
        raise error(f"{kind} {path.stem!r} ({path}) cannot be read: {e.strerror}") from None


def shadowed(name: str, path: Path) -> str | None:
    """Where `name` (a preset or recipe given by name) was read from `path`, a shipped file, but
    a file of that name lies in the working folder too: the note that says which was read."""
    local = Path(f"{name}.toml")
    if Path(name).suffix == ".toml" or not local.is_file() or local.resolve() == path.resolve():
        return None
    return (f"note: {name} is the shipped {path}, not ./{local} in this folder: give "
            f"./{local} to use that one")
