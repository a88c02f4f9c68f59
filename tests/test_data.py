"""Data preparation by name: TinyStories downloaded (from a local HTTP server) and tokenized once,
text files prepared by content, prepared directories used as they are; the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    ASSETS,
    EOT,
    REPO,
    SYNTHETIC_STORIES,
    expected_stories,
    tokens_of,
    write_one_file_layout,
    write_synthetic_stories,
)

from minigpt.data import download, main, prepare_tinystories, resolve_data
from minigpt.data.token_files import DataError, load_meta


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    """A second story file, standing in for the official validation file."""
    real = ASSETS / "tinystories" / "TinyStories-subset-3k.txt"
    if real.is_file():
        return real
    return write_synthetic_stories(tmp_path_factory.mktemp("valid") / "valid.txt", copies=20)


def test_prepare_tinystories_end_to_end(server, tmp_path, monkeypatch, gpt2, stories_file,
                                        valid_file):
    server.files = {"TinyStories-train.txt": stories_file.read_bytes(),
                    "TinyStories-valid.txt": valid_file.read_bytes()}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    out = prepare_tinystories(tmp_path, "v1", revision="test-rev", progress=False)
    assert out == tmp_path / "tinystories"
    assert all("/datasets/roneneldan/TinyStories/resolve/test-rev/" in r["path"]
               for r in server.log)
    meta = load_meta(out)
    train = expected_stories(stories_file.read_bytes(), keep_unterminated=True)
    val = expected_stories(valid_file.read_bytes(), keep_unterminated=True)
    # The dataset's own validation file is the val split; a verified download is whole: its
    # unterminated last story is kept, not dropped.
    assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val))
    assert gpt2.decode(tokens_of(out, "val").tolist()) == "".join(s + EOT for s in val)
    assert meta["kind"] == "shards" and meta["dataset"]["revision"] == "test-rev"
    assert meta["split_rule"] == "each file's own split"
    assert [(s["path"], s["split"]) for s in meta["sources"]] == [
        (str(out / "TinyStories-train.txt"), "train"), (str(out / "TinyStories-valid.txt"), "val")]
    shard = out / meta["splits"]["train"]["shards"][0]
    mtime, requests = shard.stat().st_mtime_ns, len(server.log)
    assert prepare_tinystories(tmp_path, "v1", revision="test-rev", progress=False) == out
    assert len(server.log) == requests and shard.stat().st_mtime_ns == mtime
    # The text may be deleted once tokenized: the folder is still current.
    (out / "TinyStories-train.txt").unlink()
    assert prepare_tinystories(tmp_path, "v1", revision="test-rev", progress=False) == out
    assert len(server.log) == requests


def test_tinystories_prepared_before_shards_is_kept(server, tmp_path, monkeypatch, stories_file,
                                                    valid_file):
    """A TinyStories folder of the one-file layout, current for its revision, is used as it is:
    nothing downloaded, nothing written (its runs resume on the same batches); one of another
    revision is prepared again, in shards, beside the downloaded text."""
    out = tmp_path / "tinystories"
    out.mkdir()
    for name, source in (("TinyStories-train.txt", stories_file),
                         ("TinyStories-valid.txt", valid_file)):
        (out / name).write_bytes(source.read_bytes())
    write_one_file_layout(out, [(out / "TinyStories-train.txt", "train"),
                                (out / "TinyStories-valid.txt", "val")],
                          dataset={"name": "tinystories", "revision": "old-rev"}, complete=True)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    assert prepare_tinystories(tmp_path, "v1", revision="old-rev", progress=False) == out
    assert not server.log and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    server.files = {"TinyStories-train.txt": stories_file.read_bytes(),
                    "TinyStories-valid.txt": valid_file.read_bytes()}
    assert prepare_tinystories(tmp_path, "v1", revision="new-rev", progress=False) == out
    meta = load_meta(out)
    assert meta["kind"] == "shards" and meta["dataset"]["revision"] == "new-rev"
    assert not (out / "train.bin").exists() and (out / "TinyStories-valid.txt").is_file()


def test_pinned_revision_refuses_a_file_of_another_size(server, tmp_path, monkeypatch):
    server.files = {"TinyStories-train.txt": b"not the real file\n<|endoftext|>\n"}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    with pytest.raises(DataError, match="at this revision has 1,924,281,556"):
        prepare_tinystories(tmp_path, "v1", progress=False)
    assert not list((tmp_path / "tinystories").glob("TinyStories-train.txt*"))


def test_resolve_data_by_name_downloads_v2(server, tmp_path, monkeypatch, gpt2, stories_file,
                                           valid_file):
    server.files = {"TinyStoriesV2-GPT4-train.txt": stories_file.read_bytes(),
                    "TinyStoriesV2-GPT4-valid.txt": valid_file.read_bytes()}
    monkeypatch.setenv("MINIGPT_HF_BASE", server.url)
    monkeypatch.setattr(download, "TINYSTORIES_REVISION", "test-rev")
    monkeypatch.setattr(download, "KNOWN_FILES", {})
    out = resolve_data("tinystories-v2", root=tmp_path)
    assert out == tmp_path / "tinystories-v2"
    assert {p.name for p in out.iterdir()} >= {"train-000000.bin", "val-000000.bin",
                                                "meta.json"}
    assert resolve_data([str(out)], root=tmp_path / "elsewhere") == out  # a prepared directory


def test_resolve_data_for_text_files(tmp_path, gpt2):
    a = write_synthetic_stories(tmp_path / "a.txt", copies=3)
    b = tmp_path / "b.txt"
    b.write_text("\n\n".join(SYNTHETIC_STORIES) + "\n")
    out = resolve_data([str(a), str(b)], root=tmp_path / "data")
    assert out.parent == tmp_path / "data" and out.name.startswith("text-")
    meta = load_meta(out)
    assert meta["train_documents"] + meta["val_documents"] == 15 + 5
    assert resolve_data([str(b), str(a)], root=tmp_path / "data") != out  # order matters
    with pytest.raises(DataError, match="no such file: missing.txt"):
        resolve_data(["missing.txt"], root=tmp_path)
    with pytest.raises(DataError, match="not a prepared data directory"):
        load_meta(tmp_path)


def test_cli(tmp_path, capsys, gpt2, stories_file):
    assert main(["prepare", "--text", str(stories_file), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    meta = load_meta(next(tmp_path.glob("text-*")))
    assert f"train {meta['train_tokens']:,} tokens" in out
    # The real entry point, in a fresh process: a user error is one line and exit status 2.
    result = subprocess.run(
        [sys.executable, "-m", "minigpt.data", "prepare", "--text", str(tmp_path / "nope.txt"),
         "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no such file: {tmp_path / 'nope.txt'} (data is 'tinystories', "
        f"'tinystories-v2', a prepared directory, or text files)"]
