"""Any corpus into shards (`prepare --source`): jsonl, parquet, text and a local Hugging Face
dataset read back as their tokenizer encodes them, in order; fixed-size shards with a checked
header and a document index; a held-out split stable as the corpus grows; a killed preparation
that goes on from its last finished shard; `inspect --json`; and the refusals, each one
`error:` line, exit 2, nothing of the preparation left behind."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env, refused

from minigpt.data import main, readers, shards
from minigpt.data.corpus import open_corpus
from minigpt.data.encoding import held_out
from minigpt.data.prepare_source import prepare_source
from minigpt.data.token_files import DataError
from minigpt.tokenizer import load_tokenizer

WORDS = ("Once upon a time there was a little fox who loved the moon . She ran , jumped and "
         "sang ; café naïve 東京 🦊 “quotes” 1234 <|endoftext|> tabs\tand\nnew lines").split(" ")


def documents(count: int, seed: int = 0) -> list[str]:
    """Texts of varied length and content: accents, CJK, emoji, digits, line breaks, and the
    end token's name written as text (which must stay text)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))) for _ in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}, ensure_ascii=i % 2 == 0) + "\n")
            if i % 50 == 7:
                f.write("\n")  # blank lines are no documents
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="parquet files are read with the [datasets] extra")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path,
                   row_group_size=97)
    return path


def write_text(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(t.replace("<|endoftext|>", "").strip() + "\n<|endoftext|>\n"
                            for t in texts), encoding="utf-8")
    return path


def prepare(source, out, **options):
    return prepare_source(str(source), out, progress=False, **{"shard_tokens": 700,
                                                               "workers": 2, **options})


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text", "hf"])
def test_every_document_reads_back_as_its_tokenizer_encodes_it_in_order(kind, tmp_path,
                                                                         monkeypatch):
    for name, small in (("JSONL_BYTES", 4000), ("PARQUET_ROWS", 50), ("DATASET_ROWS", 64)):
        monkeypatch.setattr(readers, name, small)  # many tasks, finished out of order
    texts = documents(400, seed=1)
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "c.jsonl", texts[:200])
        write_jsonl(tmp_path / "d.jsonl", ["", *texts[200:]])  # an empty text is no document
        source = tmp_path / "*.jsonl"
    elif kind == "parquet":
        source = write_parquet(tmp_path / "c.parquet", texts)
    elif kind == "text":
        source = write_text(tmp_path / "c.txt", texts)
        texts = [t.replace("<|endoftext|>", "").strip() for t in texts]
    else:
        pytest.importorskip("datasets", reason="Hugging Face datasets are the [datasets] extra")
        (tmp_path / "dataset").mkdir()
        write_jsonl(tmp_path / "dataset" / "train.jsonl", texts)
        source = f"hf:{tmp_path / 'dataset'}"
    tokenizer = "tinystories-4k" if kind == "text" else "gpt2"
    meta = prepare(source, tmp_path / "out", tokenizer=tokenizer)
    enc = load_tokenizer(tokenizer)
    corpus = open_corpus(tmp_path / "out")
    expected = [enc.encode_ordinary(t) + [enc.eot_token] for t in texts]
    assert [corpus.document(n)["ids"] for n in range(len(texts))] == expected
    assert meta["train_documents"] + meta["val_documents"] == len(texts)
    for split in ("train", "val"):  # each split is its documents end to end, in source order
        mine = [ids for t, ids in zip(texts, expected) if held_out(t, 0.1) == (split == "val")]
        stream = corpus.stream(split)
        assert stream.read(0, len(stream)).tolist() == [i for ids in mine for i in ids]
    with pytest.raises(DataError, match=f"holds documents 0 to {len(texts) - 1}, not 400"):
        corpus.document(400)


def test_shards_have_a_fixed_size_a_checked_header_and_a_document_index(tmp_path):
    texts = documents(300, seed=2)
    meta = prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out")
    names = meta["splits"]["train"]["shards"]
    headers = [shards.read_header(tmp_path / "out" / name) for name in names]
    assert len(headers) > 5 and {h.tokens for h in headers[:-1]} == {700}
    assert 0 < headers[-1].tokens <= 700
    assert [h.first for h in headers] == [700 * k for k in range(len(headers))]
    assert {(h.tokenizer, h.vocab_hash, h.dtype.name) for h in headers} == {
        ("gpt2", shards.vocabulary_hash("gpt2"), "uint16")}
    raw = (tmp_path / "out" / names[0]).read_bytes()
    assert raw[:8] == b"MGPTSHRD" and len(raw) == 1024 + 700 * 2 + 16 * headers[0].documents
    starts, ordinals = shards.document_index(headers[1])
    tokens = np.frombuffer(raw[1024:1024 + 1400], np.uint16)
    assert tokens[0] != 50256 or 0 in starts  # a document begins right after an end token
    first_starts, first_ordinals = shards.document_index(headers[0])
    assert first_starts[0] == 0 and first_ordinals[0] == 0
    assert all(tokens[s - 1] == 50256 for s in first_starts[1:])
    assert np.all(np.diff(np.concatenate([first_ordinals, ordinals]).astype(np.int64)) > 0)


def test_the_held_out_split_is_stable_as_the_corpus_grows(tmp_path):
    texts = documents(600, seed=3)
    small = write_jsonl(tmp_path / "small.jsonl", texts[:300])
    grown = write_jsonl(tmp_path / "grown.jsonl", texts[300:450] + texts[:300] + texts[450:])
    splits = []
    for source in (small, grown):
        out = tmp_path / source.stem
        prepare(source, out, shard_tokens=100_000)
        corpus = open_corpus(out)
        val = set()
        for n in range(sum(corpus.documents(s) for s in ("train", "val"))):
            doc = corpus.document(n)
            if doc["split"] == "val":
                val.add(load_tokenizer("gpt2").decode(doc["ids"][:-1]))
        splits.append(val)
    assert splits[0] and splits[0] == {t for t in texts[:300] if held_out(t, 0.1)}
    assert splits[0] < splits[1]  # every held-out document stays held out


def test_a_killed_preparation_goes_on_from_its_last_finished_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "JSONL_BYTES", 3000)  # many tasks: a restart has a place
    source = write_jsonl(tmp_path / "c.jsonl", documents(400, seed=4))
    whole = prepare(source, tmp_path / "whole")
    killed = tmp_path / "killed"
    script = (f"import os, signal\nfrom minigpt.data import readers, shards\n"
              f"from minigpt.data.prepare_source import prepare_source\n"
              f"readers.JSONL_BYTES = 3000\nreal = shards.ShardWriter._close_shard\n"
              f"def dying(self):\n"
              f"    if self.split == 'train' and self.shards == 30:  # mid-shard, a .tmp written\n"
              f"        os.kill(os.getpid(), signal.SIGKILL)\n"
              f"    real(self)\n"
              f"shards.ShardWriter._close_shard = dying\n"
              f"prepare_source({str(source)!r}, {str(killed)!r}, shard_tokens=700, workers=2, "
              f"progress=False)\n")
    # Read from stdin, a __main__ the workers cannot import again (nor need to).
    done = subprocess.run([sys.executable, "-"], input=script, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = sorted(p.name for p in killed.iterdir())
    assert "progress.json" in left and "train-000030.bin.tmp" in left
    assert "meta.json" not in left and "train-000029.bin" in left and "val-000000.bin" in left
    finished = {p.name: p.stat().st_mtime_ns for p in killed.glob("*.bin")}
    progress = json.loads((killed / "progress.json").read_text())
    assert progress["restart"]["seq"] > 0  # it does not begin again from the start
    resumed = prepare(source, killed)
    assert {**resumed, "created": None} == {**whole, "created": None}
    for name in sorted(p.name for p in (tmp_path / "whole").glob("*.bin")):
        assert (killed / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert {n: (killed / n).stat().st_mtime_ns for n in finished} == finished  # not rewritten
    assert sorted(p.name for p in killed.iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir())


def test_the_same_command_again_reuses_a_finished_corpus(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", documents(50, seed=5))
    first = prepare(source, tmp_path / "out", shard_tokens=100_000)
    stamp = (tmp_path / "out" / "train-000000.bin").stat().st_mtime_ns
    assert prepare(source, tmp_path / "out", shard_tokens=100_000) == first
    assert (tmp_path / "out" / "train-000000.bin").stat().st_mtime_ns == stamp


def test_inspect_json_gives_the_tokenizer_counts_shards_and_a_documents_ids(tmp_path, capsys):
    texts = documents(120, seed=6)
    meta = prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out")
    assert main(["inspect", str(tmp_path / "out"), "--json", "--doc", "7"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["tokenizer"] == "gpt2" and found["vocab_hash"] == shards.vocabulary_hash("gpt2")
    assert found["tokens"] == meta["train_tokens"] + meta["val_tokens"]
    assert found["documents"] == 120
    assert found["splits"]["val"] == {"tokens": meta["val_tokens"],
                                      "documents": meta["val_documents"]}
    assert [s["file"] for s in found["shards"]] == (meta["splits"]["train"]["shards"]
                                                    + meta["splits"]["val"]["shards"])
    assert sum(s["tokens"] for s in found["shards"]) == found["tokens"]
    gpt2 = load_tokenizer("gpt2")
    assert found["doc"]["ids"] == gpt2.encode_ordinary(texts[7]) + [50256]
    assert found["doc"]["split"] == ("val" if held_out(texts[7], 0.1) else "train")


def test_inspect_reads_a_folder_of_the_one_file_layout(tmp_path, capsys):
    from conftest import write_one_file_layout

    texts = [f"Story number {i} about a {WORDS[i % 9]}." for i in range(40)]
    out = write_one_file_layout(tmp_path / "data", [(write_text(tmp_path / "s.txt", texts),
                                                     "train+val")])
    assert main(["inspect", str(out), "--json", "--doc", "19"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["layout"] == "one file a split" and found["documents"] == 40
    assert found["doc"]["split"] == "val"  # every 10th story is held out
    assert found["doc"]["ids"] == load_tokenizer("gpt2").encode_ordinary(texts[19]) + [50256]
    assert main(["inspect", str(out), "--doc", "3"]) == 0
    assert "document 3 (train" in capsys.readouterr().out


def test_a_record_without_the_text_field_is_refused_and_nothing_is_left(tmp_path, capsys):
    path = write_jsonl(tmp_path / "c.jsonl", documents(300, seed=7))
    with open(path, "a") as f:
        f.write(json.dumps({"body": "no text here"}) + "\n")
    lines = len(path.read_text().splitlines())
    refused(capsys, main(["prepare", "--source", str(path), "--out", str(tmp_path / "out"),
                          "--shard-tokens", "500", "--workers", "2"]),
            f"c.jsonl, line {lines}: no field 'text' (it has body)", "--text-field")
    assert not (tmp_path / "out").exists()
    refused(capsys, main(["prepare", "--source", str(tmp_path / "c.jsonl"), "--out",
                          str(tmp_path / "out"), "--text-field", "body"]),
            "line 1: no field 'body'")
    assert not (tmp_path / "out").exists()


def test_a_damaged_parquet_row_group_and_a_negative_worker_count_are_refused(tmp_path,
                                                                          capsys):
    source = write_parquet(tmp_path / "c.parquet", [t * 20 for t in documents(400, seed=5)])
    raw = bytearray(source.read_bytes())
    middle = len(raw) // 2  # inside a row group's pages; the footer at the end stays intact
    raw[middle:middle + 16] = bytes(16)
    source.write_bytes(bytes(raw))
    refused(capsys, main(["prepare", "--source", str(source), "--out", str(tmp_path / "out"),
                          "--workers", "1"]),
            "c.parquet: the rows from", "cannot be read", "the file is damaged")
    assert not (tmp_path / "out").exists()
    refused(capsys, main(["prepare", "--source", str(source), "--out", str(tmp_path / "out"),
                          "--workers", "-1"]), "--workers must be at least 1")
    assert not (tmp_path / "out").exists()


def test_damaged_shards_are_refused_in_one_line(tmp_path, capsys):
    prepare(write_jsonl(tmp_path / "c.jsonl", documents(100, seed=8)), tmp_path / "out")
    shard = tmp_path / "out" / "train-000001.bin"
    raw = shard.read_bytes()
    shard.write_bytes(b"NOTASHRD" + raw[8:])
    refused(capsys, main(["inspect", str(tmp_path / "out")]), "is not a minigpt shard")
    shard.write_bytes(raw[:-5])
    refused(capsys, main(["inspect", str(tmp_path / "out")]), "is cut short or damaged")
    shard.write_bytes(raw)
    other = tmp_path / "other"
    prepare(tmp_path / "c.jsonl", other, tokenizer="tinystories-4k")
    (tmp_path / "out" / "train-000001.bin").write_bytes((other / "train-000001.bin").read_bytes())
    refused(capsys, main(["inspect", str(tmp_path / "out"), "--json"]),
            "shards of two preparations are mixed")


def test_a_folder_holding_another_preparation_is_refused_not_overwritten(tmp_path, capsys):
    source = write_jsonl(tmp_path / "c.jsonl", documents(50, seed=9))
    prepare(source, tmp_path / "out", shard_tokens=100_000)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    refused(capsys, main(["prepare", "--source", str(source), "--out", str(tmp_path / "out"),
                          "--tokenizer", "tinystories-4k"]),
            "already holds a prepared corpus", "tokenizer")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    refused(capsys, main(["prepare", "--source", str(tmp_path / "none*.jsonl"), "--out",
                          str(tmp_path / "x")]), "no such file, folder or matching files")


def test_training_refuses_a_corpus_of_another_tokenizer_in_one_line(tmp_path, capsys):
    from minigpt import train

    prepare(write_jsonl(tmp_path / "c.jsonl", documents(200, seed=10)), tmp_path / "corpus",
            tokenizer="tinystories-4k")
    code = train.main(["--data", str(tmp_path / "corpus"), "--model", "minigpt-tiny",
                       "--preset", "dp", "--steps", "1", "--batch-size", "8",
                       "--out", str(tmp_path / "run")])
    refused(capsys, code, "was tokenized with 'tinystories-4k', not 'gpt2'",
            "--tokenizer tinystories-4k")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_end_token_written_as_text_stays_text(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", [f"{i} before <|endoftext|> after"
                                                for i in range(20)])
    prepare(source, tmp_path / "out", val_fraction=0.5)
    ids = open_corpus(tmp_path / "out").document(0)["ids"]
    assert ids.count(50256) == 1 and ids[-1] == 50256


def test_a_workers_refusal_names_the_file_and_line_and_keeps_nothing(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"c\.jsonl, line 2: 'text' holds int, not text"):
        prepare(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert os.environ.get("TOKENIZERS_PARALLELISM") != "false"  # set in the workers alone


@pytest.mark.slow
def test_a_larger_corpus_in_many_tasks_reads_back_exactly(tmp_path, monkeypatch):
    """23 MB of jsonl in 86 tasks over 2 workers: both splits are the documents' own ids, end
    to end, in source order."""
    monkeypatch.setattr(readers, "JSONL_BYTES", 256 << 10)
    texts = documents(60_000, seed=12)
    meta = prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out",
                   shard_tokens=1_000_000)
    enc = load_tokenizer("gpt2")
    encoded = enc.encode_ordinary_batch(texts)
    corpus = open_corpus(tmp_path / "out")
    for split in ("train", "val"):
        mine = [ids + [50256] for t, ids in zip(texts, encoded)
                if held_out(t, 0.1) == (split == "val")]
        stream = corpus.stream(split)
        assert np.array_equal(stream.read(0, len(stream)),
                              np.concatenate([np.array(ids, np.uint16) for ids in mine]))
    assert meta["train_documents"] + meta["val_documents"] == len(texts)


def test_a_full_disk_names_the_shard_it_could_not_write(tmp_path, capsys, monkeypatch):
    import errno
    import io

    import minigpt.data.shards as shards_module

    class Full(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards_module, "open", lambda path, mode: Full(), raising=False)
    source = write_jsonl(tmp_path / "c.jsonl", documents(50, seed=3))
    refused(capsys, main(["prepare", "--source", str(source), "--out", str(tmp_path / "out"),
                          "--workers", "1"]),
            f"cannot write {tmp_path / 'out'}/", ".bin.tmp: No space left on device")
