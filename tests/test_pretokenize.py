"""Preparing text files (`prepare_text`, what `--data file.txt` does): stories in, shards out,
by the documented reading rules (layouts, cut-off last story, UTF-8), each story held out by the
hash of its text; reused while nothing changed; a folder an earlier version wrote in one file a
split is kept as it is, so the runs trained on it resume on the same batches."""

import hashlib

import numpy as np
import pytest
from conftest import EOT, expected_stories, tokens_of, write_one_file_layout

from minigpt.data import prepare_text, resolve_data, stories
from minigpt.data.encoding import held_out
from minigpt.data.loader import batch_iterator
from minigpt.data.token_files import DataError, load_meta


def test_shards_decode_to_the_source_stories(data_dir, gpt2, stories_file):
    told = expected_stories(stories_file.read_bytes(), keep_unterminated=False)
    val = [s for s in told if held_out(s, 0.1)]
    train = [s for s in told if not held_out(s, 0.1)]
    assert 0 < len(val) < len(told) / 5
    for split, texts in (("train", train), ("val", val)):
        assert gpt2.decode(tokens_of(data_dir, split).tolist()) == "".join(s + EOT for s in texts)
    meta = load_meta(data_dir)
    assert meta["kind"] == "shards" and meta["tokenizer"] == "gpt2" and meta["eot_token"] == 50256
    assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val))
    assert meta["train_tokens"] == sum(len(gpt2.encode_ordinary(s)) + 1 for s in train)
    assert data_dir.name == "text-" + hashlib.sha256(
        hashlib.sha256(stories_file.read_bytes()).digest()).hexdigest()[:12]


def test_small_chunks_give_identical_tokens(data_dir, tmp_path, monkeypatch, stories_file):
    monkeypatch.setattr(stories, "CHUNK_BYTES", 20_011)  # ~100 chunk edges mid-story
    out = prepare_text([stories_file], tmp_path, progress=False)
    for split in ("train", "val"):
        assert np.array_equal(tokens_of(out, split), tokens_of(data_dir, split))


def test_blank_line_layout(tmp_path, gpt2, monkeypatch):
    told = ["First story.\nStill first.", "Second story.", "Third story.", "Fourth.", "Sixth."]
    path = tmp_path / "blank.txt"
    path.write_text("First story.\nStill first.\n\nSecond story.\n \n\n\nThird story.\n\n"
                    "Fourth.\n\nSixth.\n")  # "Sixth." alone is held out at 0.5
    for chunk in (None, 5):  # whole file, then 5-byte chunks
        monkeypatch.setattr(stories, "CHUNK_BYTES", chunk or 8 << 20)
        out = prepare_text([path], tmp_path / f"out{chunk}", val_fraction=0.5, progress=False)
        for split, chosen in (("val", True), ("train", False)):
            assert gpt2.decode(tokens_of(out, split).tolist()) == "".join(
                s + EOT for s in told if held_out(s, 0.5) is chosen)


@pytest.mark.parametrize("ending, kept", [("", False), ("\n", True)])
def test_cut_off_last_story_rule(tmp_path, gpt2, ending, kept):
    path = tmp_path / "cut.txt"
    path.write_text(f"Story A.\n{EOT}\nFourth.\n{EOT}\nStory C is cut off mid{ending}")
    meta = load_meta(prepare_text([path], tmp_path / "out", val_fraction=0.5, progress=False))
    assert meta["train_documents"] + meta["val_documents"] == (3 if kept else 2)


def test_reused_while_unchanged_and_a_changed_file_is_prepared_anew(tmp_path, gpt2):
    path = tmp_path / "s.txt"
    path.write_text("".join(f"Story {i} about a cat.\n{EOT}\n" for i in range(40)))
    out = prepare_text([path], tmp_path / "data", progress=False)
    shard = next(out.glob("train-*.bin"))
    mtime = shard.stat().st_mtime_ns
    assert prepare_text([path], tmp_path / "data", progress=False) == out
    assert shard.stat().st_mtime_ns == mtime
    with open(path, "a") as f:
        f.write(f"A brand new story about a dog.\n{EOT}\n")
    again = prepare_text([path], tmp_path / "data", progress=False)
    meta = load_meta(again)
    assert again != out and meta["train_documents"] + meta["val_documents"] == 41
    assert not list(again.glob("*.tmp"))


def test_a_folder_of_the_one_file_layout_is_kept_and_read_in_its_order(tmp_path, gpt2,
                                                                      stories_file):
    """What `--data file.txt` prepared before shards is current for the same file: it is used
    as it is (no shard is written), and read in its runs' order (a permutation per epoch)."""
    combined = hashlib.sha256(hashlib.sha256(stories_file.read_bytes()).digest()).hexdigest()
    old = write_one_file_layout(tmp_path / "data" / f"text-{combined[:12]}",
                                [(stories_file, "train+val")])
    before = {p.name: p.stat().st_mtime_ns for p in old.iterdir()}
    assert resolve_data([str(stories_file)], tmp_path / "data") == old
    assert {p.name: p.stat().st_mtime_ns for p in old.iterdir()} == before
    batch = next(batch_iterator(old, "train", seq_len=16, batch_size=4, seed=3))
    n = (load_meta(old)["train_tokens"] - 1) // 16
    order = np.random.default_rng([3, 0]).permutation(n)[:4]
    train = tokens_of(old, "train")
    assert np.array_equal(batch["inputs"], np.stack([train[w * 16:w * 16 + 16] for w in order]))


@pytest.mark.parametrize("content, message", [
    (b"", r"input\.txt is empty"),
    (b"One long text with no breaks at all.\nAnother line.\n", r"has no story separators"),
    (b"\n<|endoftext|>\n  \n<|endoftext|>\n", r"went to the train split"),
    (b"Good story.\n<|endoftext|>\nBad \xff byte.\n<|endoftext|>\n",
     r"input\.txt: invalid UTF-8 at byte offset 30 \(bytes b'\\xff by'\)"),
    (b"Only one story.\n<|endoftext|>\n", r"went to the val split"),
])
def test_bad_text_is_refused_clearly(tmp_path, gpt2, content, message):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare_text([path], tmp_path / "out", progress=False)
    assert not list(tmp_path.glob("out/*/*.bin*"))
    assert not list(tmp_path.glob("out/*/meta.json"))


def test_invalid_utf8_offset_in_a_later_chunk(tmp_path, gpt2, monkeypatch):
    good = b"A fine story.\n<|endoftext|>\n" * 50
    path = tmp_path / "late.txt"
    path.write_bytes(good + "Caf\u00e9 \u201cok\u201d\n".encode() + b"\xc3(\n<|endoftext|>\n")
    monkeypatch.setattr(stories, "CHUNK_BYTES", 64)
    offset = path.read_bytes().index(b"\xc3(")
    with pytest.raises(DataError, match=f"late.txt: invalid UTF-8 at byte offset {offset:,}"):
        prepare_text([path], tmp_path / "out", progress=False)
