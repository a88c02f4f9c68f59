"""Pre-tokenization: story files in, token files and meta.json out, by the documented reading
rules (layouts, cut-off last story, UTF-8, held-out stories), reused while nothing changed."""

import hashlib

import numpy as np
import pytest
from conftest import EOT, expected_stories, tokens_of, write_synthetic_stories

from minigpt.data import prepare, prepare_text, stories
from minigpt.data.token_files import DataError, load_meta


def test_token_files_decode_to_the_source_stories(data_dir, gpt2, stories_file):
    told = expected_stories(stories_file.read_bytes(), keep_unterminated=False)
    train = [s for i, s in enumerate(told) if i % 10 != 9]
    val = [s for i, s in enumerate(told) if i % 10 == 9]
    assert gpt2.decode(tokens_of(data_dir / "train.bin").tolist()) == "".join(
        s + EOT for s in train)
    assert gpt2.decode(tokens_of(data_dir / "val.bin").tolist()) == "".join(s + EOT for s in val)
    meta = load_meta(data_dir)
    assert meta["train_tokens"] == sum(len(gpt2.encode_ordinary(s)) + 1 for s in train)
    assert meta["val_tokens"] == sum(len(gpt2.encode_ordinary(s)) + 1 for s in val)
    assert (meta["train_stories"], meta["val_stories"]) == (len(train), len(val))
    assert meta["tokenizer"] == "gpt2" and meta["eot_token"] == 50256
    assert meta["sources"][0]["sha256"] == hashlib.sha256(stories_file.read_bytes()).hexdigest()
    assert data_dir.name == "text-" + hashlib.sha256(
        hashlib.sha256(stories_file.read_bytes()).digest()).hexdigest()[:12]


def test_small_chunks_give_identical_tokens(data_dir, tmp_path, monkeypatch, stories_file):
    monkeypatch.setattr(stories, "CHUNK_BYTES", 20_011)  # ~100 chunk edges mid-story
    out = prepare_text([stories_file], tmp_path, progress=False)
    for split in ("train", "val"):
        assert np.array_equal(tokens_of(out / f"{split}.bin"), tokens_of(data_dir / f"{split}.bin"))


def test_blank_line_layout(tmp_path, gpt2, monkeypatch):
    text = "First story.\nStill first.\n\nSecond story.\n \n\n\nThird story.\n\nFourth.\n"
    path = tmp_path / "blank.txt"
    path.write_text(text)
    for chunk in (None, 5):  # whole file, then 5-byte chunks
        monkeypatch.setattr(stories, "CHUNK_BYTES", chunk or 8 << 20)
        out = prepare.prepare(tmp_path / f"out{chunk}", [path], val_fraction=0.5,
                                  progress=False)
        assert out["sources"][0]["layout"] == "blank-line"
        train = gpt2.decode(tokens_of(tmp_path / f"out{chunk}" / "train.bin").tolist())
        val = gpt2.decode(tokens_of(tmp_path / f"out{chunk}" / "val.bin").tolist())
        assert train == f"First story.\nStill first.{EOT}Third story.{EOT}"
        assert val == f"Second story.{EOT}Fourth.{EOT}"


@pytest.mark.parametrize("ending, kept", [("", False), ("\n", True)])
def test_cut_off_last_story_rule(tmp_path, gpt2, ending, kept):
    path = tmp_path / "cut.txt"
    path.write_text(f"Story A.\n{EOT}\nStory B.\n{EOT}\nStory C is cut off mid{ending}")
    meta = prepare.prepare(tmp_path / "out", [path], val_fraction=0.5, progress=False)
    assert meta["sources"][0]["dropped_partial_story"] is not kept
    assert meta["train_stories"] + meta["val_stories"] == (3 if kept else 2)
    assert gpt2.decode(tokens_of(tmp_path / "out" / "train.bin").tolist()) == (
        f"Story A.{EOT}Story C is cut off mid{EOT}" if kept else f"Story A.{EOT}")


def test_reuse_and_rebuild(tmp_path, gpt2):
    path = write_synthetic_stories(tmp_path / "s.txt", copies=4)
    out = tmp_path / "out"
    first = prepare.prepare(out, [path], progress=False)
    mtime = (out / "train.bin").stat().st_mtime_ns
    assert prepare.prepare(out, [path], progress=False) == first
    assert (out / "train.bin").stat().st_mtime_ns == mtime
    with open(path, "a") as f:
        f.write("A brand new story about a dog.\n<|endoftext|>\n")
    second = prepare.prepare(out, [path], progress=False)
    assert second["train_stories"] + second["val_stories"] == 5 * 4 + 1
    assert second["sources"][0]["sha256"] != first["sources"][0]["sha256"]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("content, message", [
    (b"", r"input\.txt is empty"),
    (b"One long text with no breaks at all.\nAnother line.\n", r"has no story separators"),
    (b"\n<|endoftext|>\n  \n<|endoftext|>\n", r"contains no stories"),
    (b"Good story.\n<|endoftext|>\nBad \xff byte.\n<|endoftext|>\n",
     r"input\.txt: invalid UTF-8 at byte offset 30 \(bytes b'\\xff by'\)"),
    (b"Only one story.\n<|endoftext|>\n", r"the val split would be empty"),
])
def test_bad_text_is_refused_clearly(tmp_path, gpt2, content, message):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare.prepare(tmp_path / "out", [path], progress=False)
    assert not (tmp_path / "out" / "train.bin").exists()
    assert not list(tmp_path.glob("out/*.tmp"))


def test_invalid_utf8_offset_in_a_later_chunk(tmp_path, gpt2, monkeypatch):
    good = b"A fine story.\n<|endoftext|>\n" * 50
    path = tmp_path / "late.txt"
    path.write_bytes(good + "Caf\u00e9 \u201cok\u201d\n".encode() + b"\xc3(\n<|endoftext|>\n")
    monkeypatch.setattr(stories, "CHUNK_BYTES", 64)
    offset = path.read_bytes().index(b"\xc3(")
    with pytest.raises(DataError, match=f"late.txt: invalid UTF-8 at byte offset {offset:,}"):
        prepare.prepare(tmp_path / "out", [path], progress=False)
