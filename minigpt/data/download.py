"""Downloads of the official TinyStories text files: resumable, verified, never half-named.

Files come from the Hugging Face dataset `roneneldan/TinyStories` at a pinned revision, so every
user tokenizes the same bytes (the V1 `.txt` files changed content in a later commit, "Fix
encoding problem"). A transfer writes to `<name>.part` and resumes it with an HTTP Range request
after a dropped connection, in this call or a later one; only a file whose size (and sha256, where
known) checks out is renamed to its final name. The Hub address can be pointed elsewhere, a
mirror or a test server, with `MINIGPT_HF_BASE` or the `base_url` argument.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tqdm import tqdm

from minigpt import files
from minigpt.data.token_files import DataError

HF_BASE = "https://huggingface.co"
HF_REPO = "roneneldan/TinyStories"
# The head of the dataset's main branch, after "Fix encoding problem"; the revision that public
# projects pin when they record the sizes and sha256 below; the hash was taken from those
# records.
TINYSTORIES_REVISION = "f54c09fd23315a6f9c86f9dc80f725de7d8f9c64"

TINYSTORIES_FILES = {
    "v1": {"train": "TinyStories-train.txt", "val": "TinyStories-valid.txt"},
    "v2": {"train": "TinyStoriesV2-GPT4-train.txt", "val": "TinyStoriesV2-GPT4-valid.txt"},
}

# Exact sizes and sha256 of the files at TINYSTORIES_REVISION (the Hub's LFS pointers, as recorded
# by several independent projects pinned to that revision). Files of any other revision are
# checked against the server's Content-Length only, and their sha256 lands in meta.json.
KNOWN_FILES: dict[str, tuple[int, str]] = {
    "TinyStories-train.txt":
        (1_924_281_556, "c5cf5e22ff13614e830afbe61a99fbcbe8bcb7dd72252b989fa1117a368d401f"),
    "TinyStories-valid.txt":
        (19_447_282, "94e431816c4cce81ff71e4408ff8d3bda9a42e8d2663986697c3954288cb38b4"),
    "TinyStoriesV2-GPT4-train.txt":
        (2_227_753_162, "6418d412de72888f52b5142c761ac21a582f7d1166f0bfbdb5f03ccfdec90443"),
    "TinyStoriesV2-GPT4-valid.txt":
        (22_502_601, "6874bae9a4c1a4e7edcf0e53b86c17817e9cf881fc75ff2368da457b80c0585d"),
}

CHUNK_BYTES = 1 << 20


def hf_url(filename: str, *, revision: str | None = None, base_url: str | None = None) -> str:
    """Address of one dataset file at `revision` (default: the pinned one).

    The base is `base_url`, else $MINIGPT_HF_BASE, else the Hub.
    """
    revision = revision or TINYSTORIES_REVISION
    base = (base_url or os.environ.get("MINIGPT_HF_BASE") or HF_BASE).rstrip("/")
    return f"{base}/datasets/{HF_REPO}/resolve/{revision}/{filename}"


def expected_file(filename: str, revision: str) -> tuple[int | None, str | None]:
    """(size, sha256) a file must have, or Nones where this revision's values are not known."""
    if revision == TINYSTORIES_REVISION and filename in KNOWN_FILES:
        return KNOWN_FILES[filename]
    return None, None


def _open(url: str, start: int, timeout: float) -> http.client.HTTPResponse:
    request = urllib.request.Request(url, headers={"User-Agent": "minigpt"})
    if start:
        request.add_header("Range", f"bytes={start}-")
    return urllib.request.urlopen(request, timeout=timeout)


def _total_size(response: http.client.HTTPResponse, start: int) -> int | None:
    """Full size of the file as the server reports it, if it does."""
    content_range = response.headers.get("Content-Range", "")
    if response.status == 206 and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    return start + int(length) if length and length.isdigit() else None


class _Part:
    """The `<name>.part` file a transfer appends to, with the running sha256 of its bytes."""

    def __init__(self, path: Path, size: int | None):
        self.path = path
        self.have = path.stat().st_size if path.exists() else 0
        if size is not None and self.have > size:  # longer than the file: not a prefix of it
            self.restart()
        self.hasher = hashlib.sha256()
        if self.have:
            files.sha256(path, self.hasher)

    def restart(self) -> None:
        self.path.unlink(missing_ok=True)
        self.have, self.hasher = 0, hashlib.sha256()

    def append_from(self, response, total: int | None, progress: bool) -> None:
        with open(self.path, "ab") as out, tqdm(
                total=total, initial=self.have, unit="B", unit_scale=True, unit_divisor=1024,
                desc=self.path.name.removesuffix(".part"), disable=not progress) as bar:
            while chunk := response.read(CHUNK_BYTES):
                out.write(chunk)
                self.hasher.update(chunk)
                self.have += len(chunk)
                bar.update(len(chunk))


def download_file(url: str, dest: str | Path, *, size: int | None = None,
                  sha256: str | None = None, attempts: int = 5, retry_wait: float = 2.0,
                  timeout: float = 60.0, progress: bool = True) -> str:
    """Fetch `url` to `dest` and return the file's sha256.

    An existing `dest` is checked, not fetched again. Bytes arrive in `dest.part`; after a
    dropped connection the transfer resumes from the bytes already there (up to `attempts`
    tries, and again in a later call). The part is renamed to `dest` only once its size matches
    `size` (or the server's Content-Length) and its hash matches `sha256`; a part that fails the
    hash is deleted. Raises DataError when the file cannot be had intact.
    """
    dest = Path(dest)
    if dest.exists():
        return _verify_existing(dest, size, sha256)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = _Part(dest.with_name(dest.name + ".part"), size)
    last_error = ""
    for attempt in range(attempts):
        if size is not None and part.have == size:
            break
        try:
            size, last_error = _fetch_once(url, part, size, dest.name, timeout, progress)
            if not last_error:
                break
        except urllib.error.HTTPError as error:
            if error.code == 416 and part.have:
                # Range not satisfiable: the part is not a prefix of this file; start over.
                part.restart()
                last_error = "the partial file did not match the server's file"
                continue
            if 400 <= error.code < 500 and error.code not in (408, 429):
                raise DataError(f"{url}: HTTP {error.code} {error.reason}; check the file "
                                f"name, the revision and MINIGPT_HF_BASE") from error
            last_error = f"HTTP {error.code} {error.reason}"
        except (OSError, http.client.HTTPException) as error:
            last_error = f"{type(error).__name__}: {error}"
            if not part.have and _unreachable(error):  # retrying would only wait
                raise DataError(f"cannot reach {urllib.parse.urlsplit(url).netloc} ({last_error})"
                                f": check the network (or MINIGPT_HF_BASE), or train on "
                                f"local text files (--data FILE... on the command line, "
                                f"TrainConfig.data in Python)") from error
        if attempt + 1 < attempts:
            time.sleep(retry_wait * 2**attempt)
    else:
        advice = (f"{part.have:,} bytes are kept in {part.path}: run the same command again to "
                  f"resume" if part.have else
                  "check the network or MINIGPT_HF_BASE and run the command again")
        raise DataError(f"downloading {url} failed after {attempts} attempts ({last_error}); "
                        f"{advice}")
    return _accept(part, dest, url, size, sha256)


def _unreachable(error: BaseException) -> bool:
    """Whether the host cannot be reached at all (its name does not resolve, or nothing listens
    or routes there), as opposed to a transfer that failed midway and may succeed on retry."""
    reason = getattr(error, "reason", error)  # urllib wraps the socket's error in a URLError
    return isinstance(reason, socket.gaierror | ConnectionRefusedError) or (
        isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH))


def _fetch_once(url: str, part: _Part, size: int | None, name: str, timeout: float,
                progress: bool) -> tuple[int | None, str]:
    """One request for the bytes after those in `part`; returns (the file's size if now known,
    why the transfer stopped short, or "" when it is complete)."""
    with _open(url, part.have, timeout) as response:
        if part.have and response.status != 206:
            part.restart()  # the server ignored the Range header and sends the whole file
        total = _total_size(response, part.have)
        if size is not None and total is not None and total != size:
            raise DataError(f"{url} is {total:,} bytes, but {name} at this revision has "
                            f"{size:,}: the server sends a different file; check the revision "
                            f"or MINIGPT_HF_BASE")
        part.append_from(response, total, progress)
    if total is None or part.have == total:
        return (size if size is not None else part.have), ""
    return size, f"connection closed after {part.have:,} of {total:,} bytes"


def _accept(part: _Part, dest: Path, url: str, size: int | None, sha256: str | None) -> str:
    """Rename a complete part to `dest` if its size and hash check out; return its sha256."""
    if size is not None and part.have != size:
        raise DataError(f"{part.path} has {part.have:,} bytes, expected {size:,}; delete it "
                        f"and retry")
    digest = part.hasher.hexdigest()
    if sha256 is not None and digest != sha256:
        part.path.unlink()
        raise DataError(
            f"{dest.name} from {url} has sha256 {digest}, expected {sha256}: the download "
            f"is corrupt or not the pinned file; the partial file was deleted, run again")
    part.path.replace(dest)
    return digest


def _verify_existing(dest: Path, size: int | None, sha256: str | None) -> str:
    actual = dest.stat().st_size
    if size is not None and actual != size:
        raise DataError(f"{dest} has {actual:,} bytes, but the pinned file has {size:,}: "
                        f"delete it and run again to download it afresh")
    digest = files.sha256(dest)
    if sha256 is not None and digest != sha256:
        raise DataError(f"{dest} has sha256 {digest}, but the pinned file has {sha256}: "
                        f"delete it and run again to download it afresh")
    return digest
