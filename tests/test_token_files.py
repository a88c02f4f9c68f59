"""The prepared-data format: one check that token files agree with meta.json, and files written
under a temporary name so that a crash never leaves a torn one."""

import json

import numpy as np
import pytest

from minigpt.data.token_files import (
    DataError,
    load_meta,
    open_split,
    token_file_problem,
    write_meta,
)
from minigpt.files import replacing, write_text_atomic

META = {"dtype": "uint16", "tokenizer": "gpt2", "train_tokens": 10, "val_tokens": 4}


@pytest.fixture
def prepared(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "val.bin")
    write_meta(tmp_path, META)
    return tmp_path


def test_an_intact_directory_opens_its_splits(prepared):
    assert token_file_problem(prepared, META) is None
    assert open_split(prepared, "val").tolist() == [0, 1, 2, 3]
    assert load_meta(prepared) == META


def test_a_short_or_missing_token_file_is_named(prepared):
    (prepared / "train.bin").write_bytes(b"\0" * 6)
    assert token_file_problem(prepared, META) == (
        f"{prepared / 'train.bin'} has 6 bytes, not the 20 that meta.json records")
    with pytest.raises(DataError, match="not the 20 that meta.json records: delete .* again"):
        open_split(prepared, "val")
    (prepared / "train.bin").unlink()
    assert token_file_problem(prepared, META) == f"{prepared / 'train.bin'} is missing"


def test_unknown_splits_and_missing_or_broken_meta_are_refused(prepared, tmp_path_factory):
    with pytest.raises(DataError, match="unknown split 'test'"):
        open_split(prepared, "test")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(DataError, match="not a prepared data directory"):
        load_meta(empty)
    (empty / "meta.json").write_text("{")
    with pytest.raises(DataError, match="not valid JSON"):
        load_meta(empty)


def test_atomic_writes_replace_whole_files_and_clean_up_after_a_failure(tmp_path):
    path = tmp_path / "config.json"
    write_text_atomic(path, json.dumps({"a": 1}))
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_text('{"a": ')  # half written when the writer fails
        raise RuntimeError("crash")
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with replacing(tmp_path / "loss.png") as tmp:
        assert tmp.name == "loss.tmp.png"  # the suffix stays, for tools that go by it
        tmp.write_bytes(b"png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "loss.png"]
