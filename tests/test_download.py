"""Downloads: resumable, verified, never half-named; against a local HTTP server that can drop
connections or ignore Range requests."""

import hashlib
from pathlib import Path

import pytest

from minigpt.data import download
from minigpt.data.token_files import DataError


def _fetch(server, tmp_path, data: bytes, **kwargs) -> tuple[Path, str]:
    server.files["f.txt"] = data
    dest = tmp_path / "f.txt"
    kwargs.setdefault("size", len(data))
    kwargs.setdefault("sha256", hashlib.sha256(data).hexdigest())
    digest = download.download_file(f"{server.url}/x/f.txt", dest, retry_wait=0,
                                    progress=False, **kwargs)
    return dest, digest


def test_download_success(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    dest, digest = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert digest == hashlib.sha256(data).hexdigest()
    assert [r["range"] for r in server.log] == [None]
    assert not (tmp_path / "f.txt.part").exists()
    # A second call checks the file on disk instead of fetching it again.
    assert _fetch(server, tmp_path, data)[1] == digest and len(server.log) == 1


def test_download_resumes_after_dropped_connection(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.cuts = [len(data) // 3]
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert [r["range"] for r in server.log] == [None, f"bytes={len(data) // 3}-"]
    assert server.log[1]["sent"] == len(data) - len(data) // 3


def test_download_resumes_part_left_by_an_earlier_run(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    (tmp_path / "f.txt.part").write_bytes(data[:1000])
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data
    assert server.log[0]["range"] == "bytes=1000-" and server.log[0]["sent"] == len(data) - 1000


def test_download_restarts_when_server_ignores_range(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.ignore_range = True
    (tmp_path / "f.txt.part").write_bytes(b"x" * 1000)  # would corrupt the file if appended to
    dest, _ = _fetch(server, tmp_path, data)
    assert dest.read_bytes() == data


def test_download_that_keeps_failing_leaves_only_the_part(server, tmp_path, stories_file):
    data = stories_file.read_bytes()
    server.cuts = [1000, 1000]
    with pytest.raises(DataError, match=r"failed after 2 attempts.*2,000 bytes are kept.*again"):
        _fetch(server, tmp_path, data, attempts=2)
    assert not (tmp_path / "f.txt").exists()
    assert (tmp_path / "f.txt.part").read_bytes() == data[:2000]
    dest, _ = _fetch(server, tmp_path, data)  # the next run picks up from there
    assert dest.read_bytes() == data and server.log[-1]["range"] == "bytes=2000-"


def test_download_size_mismatch_is_refused(server, tmp_path):
    data = b"a story\n<|endoftext|>\n" * 100
    with pytest.raises(DataError, match=r"is 2,200 bytes, but f.txt at this revision has 2,201"):
        _fetch(server, tmp_path, data, size=len(data) + 1)
    assert not (tmp_path / "f.txt").exists() and not (tmp_path / "f.txt.part").exists()


def test_download_hash_mismatch_is_refused_and_part_deleted(server, tmp_path):
    data = b"a story\n<|endoftext|>\n" * 100
    with pytest.raises(DataError, match=r"f.txt from .* has sha256 [0-9a-f]{64}, expected 0{64}"):
        _fetch(server, tmp_path, data, sha256="0" * 64)
    assert not (tmp_path / "f.txt").exists() and not (tmp_path / "f.txt.part").exists()


def test_download_missing_file_and_wrong_existing_file(server, tmp_path):
    with pytest.raises(DataError, match="HTTP 404"):
        download.download_file(f"{server.url}/nothing.txt", tmp_path / "n.txt", progress=False)
    (tmp_path / "f.txt").write_bytes(b"short")
    with pytest.raises(DataError, match="has 5 bytes, but the pinned file has 10.*delete it"):
        _fetch(server, tmp_path, b"0123456789")


def test_hf_url_pins_the_revision_and_honours_the_override(monkeypatch):
    assert download.hf_url("TinyStories-valid.txt") == (
        "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/"
        f"{download.TINYSTORIES_REVISION}/TinyStories-valid.txt")
    assert len(download.TINYSTORIES_REVISION) == 40
    monkeypatch.setenv("MINIGPT_HF_BASE", "http://127.0.0.1:9/")
    assert download.hf_url("a.txt", revision="r").startswith(
        "http://127.0.0.1:9/datasets/roneneldan/TinyStories/resolve/r/")
    assert download.expected_file("TinyStories-valid.txt", "r") == (None, None)
    assert download.expected_file("TinyStories-valid.txt", download.TINYSTORIES_REVISION)[0] \
        == 19_447_282
