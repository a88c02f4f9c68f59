"""Training from a folder of shards: windows read across shard boundaries as from one stream,
each process reading only its own windows (disjoint, together the epoch), the iterator
restored mid-epoch and mid-shard, a run stopped and resumed giving the uninterrupted run's
losses bit for bit, and folders of the one-file layout read in the order their runs were
trained in (tests/fixtures/loader_order_v1.json, written by the loader before shards)."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import losses, small_vocab

import minigpt
from minigpt.config import TrainConfig
from minigpt.data import shards
from minigpt.data.corpus import open_corpus
from minigpt.data.loader import Windows, batch_iterator
from minigpt.data.order import IndexShuffle

FIXTURES = Path(__file__).parent / "fixtures"
SEQ = 16


def write_counting_corpus(out: Path, tokens: int, shard_tokens: int) -> Path:
    """A sharded folder whose train stream holds 0, 1, 2, ..., so a window names where it was
    read from; val holds a short stream of its own."""
    out.mkdir()
    meta = {"format": 2, "kind": "shards", "tokenizer": "gpt2",
            "vocab_hash": shards.vocabulary_hash("gpt2"), "vocab_size": 50257,
            "eot_token": 50256, "bos_token": None, "dtype": "uint16",
            "shard_tokens": shard_tokens, "splits": {}}
    for split, count in (("train", tokens), ("val", 999)):
        writer = shards.ShardWriter(out, split, shard_tokens=shard_tokens,
                                    dtype=np.dtype("<u2"), tokenizer="gpt2",
                                    vocab_hash=meta["vocab_hash"])
        ids = np.arange(count)
        starts = np.arange(0, count, 37)  # a document every 37 tokens
        writer.append(ids, starts, np.arange(len(starts)), 0)
        writer.finish()
        meta["splits"][split] = {"shards": sorted(p.name for p in out.glob(f"{split}-*.bin"))}
        meta[f"{split}_tokens"], meta[f"{split}_documents"] = count, len(starts)
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def counting(tmp_path_factory) -> Path:
    return write_counting_corpus(tmp_path_factory.mktemp("shards") / "c", 3000 * SEQ + 1,
                                 shard_tokens=1000)  # 3,000 windows over 49 shards


def starts(batches) -> list[int]:
    return [int(row[0]) for b in batches for row in b["inputs"]]


def test_windows_read_across_shards_as_one_stream(counting):
    assert len(open_corpus(counting).shards["train"]) == 49
    batches = list(batch_iterator(counting, "train", seq_len=SEQ, batch_size=40, seed=0,
                                  shuffle=False, num_epochs=1))
    inputs = np.concatenate([b["inputs"] for b in batches])  # [3000, T]
    targets = np.concatenate([b["targets"] for b in batches])
    stream = np.arange(3000 * SEQ + 1)
    assert np.array_equal(inputs, stream[:-1].reshape(3000, SEQ))
    assert np.array_equal(targets, stream[1:].reshape(3000, SEQ))
    windows = Windows(open_corpus(counting).stream("train"), SEQ, None)  # one by one
    assert len(windows) == 3000 and windows[62]["inputs"].tolist() == list(range(992, 1008))
    assert windows[62]["targets"][-1] == 1008  # read across the end of the first shard


def test_two_processes_read_disjoint_windows_that_cover_each_epoch(counting):
    epochs = 2
    per_process = []
    for p in range(2):
        it = batch_iterator(counting, "train", seq_len=SEQ, batch_size=40, seed=7,
                            process_index=p, process_count=2, num_epochs=epochs)
        per_process.append([s // SEQ for s in starts(it)])
    for e in range(epochs):
        mine = [w[e * 1500:(e + 1) * 1500] for w in per_process]  # 75 batches of 20 rows
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == list(range(3000))
    assert per_process[0][:1500] != per_process[0][1500:]  # another order each epoch
    whole = starts(batch_iterator(counting, "train", seq_len=SEQ, batch_size=40, seed=7,
                                  num_epochs=1))
    halves = [starts(batch_iterator(counting, "train", seq_len=SEQ, batch_size=40, seed=7,
                                    process_index=p, process_count=2, num_epochs=1))
              for p in range(2)]
    for k in range(75):  # global batch k is the two processes' rows side by side
        assert whole[k * 40:(k + 1) * 40] == halves[0][k * 20:(k + 1) * 20] + halves[1][
            k * 20:(k + 1) * 20]


def test_a_restored_iterator_continues_mid_epoch_and_mid_shard(counting):
    it = batch_iterator(counting, "train", seq_len=SEQ, batch_size=8, seed=3)
    for _ in range(372):  # 3,000 windows are 375 batches: the next ones cross into epoch 1
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"next_index": 372}
    expected = [next(it) for _ in range(6)]
    resumed = batch_iterator(counting, "train", seq_len=SEQ, batch_size=8, seed=3)
    resumed.set_state(state)
    for a, b in zip([next(resumed) for _ in range(6)], expected):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_documents_stay_apart_in_windows_read_from_shards(counting):
    batch = next(batch_iterator(counting, "train", seq_len=SEQ, batch_size=8, seed=1,
                                documents=(36, None)))  # here token 36 marks a document start
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    for row, ids in zip(batch["inputs"], batch["segment_ids"]):
        assert np.array_equal(np.diff(ids) != 0, row[1:] == 36)


def test_the_shuffle_is_a_bijection_of_any_size_and_new_each_epoch():
    for n in (1, 2, 3, 7, 100, 4097, 65_537):
        order = IndexShuffle(n, seed=5, epoch=0)(np.arange(n))
        assert sorted(order.tolist()) == list(range(n))
    first, second = (IndexShuffle(4000, 5, e)(np.arange(4000)) for e in (0, 1))
    assert not np.array_equal(first, second)
    assert np.array_equal(IndexShuffle(4000, 5, 0)(np.arange(4000)), first)


def test_the_shuffle_keeps_the_order_runs_from_shards_were_trained_in():
    """A run resumed from a folder of shards reads the windows its saved position counts in:
    the shuffle of the fixture's time. A new shuffle would need its own version, kept beside
    this one for the runs that saved it."""
    fixture = json.loads((FIXTURES / "shard_order_v1.json").read_text())
    for case in fixture["cases"]:
        order = IndexShuffle(case["n"], case["seed"], case["epoch"])
        assert order(np.arange(len(case["first"]))).tolist() == case["first"], case


def test_a_folder_of_the_one_file_layout_is_read_in_its_runs_order(tmp_path):
    """Runs trained before shards saved {"next_index": k}; restored, they read the batches the
    loader of that time read next, recorded in the fixture."""
    fixture = json.loads((FIXTURES / "loader_order_v1.json").read_text())
    np.arange(fixture["tokens"], dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps(
        {"dtype": "uint16", "tokenizer": "gpt2", "train_tokens": fixture["tokens"],
         "val_tokens": 500}))
    for case in fixture["cases"]:
        it = batch_iterator(tmp_path, "train", seq_len=fixture["seq_len"],
                            batch_size=fixture["batch_size"], seed=case["seed"],
                            process_index=case["process_index"],
                            process_count=case["process_count"])
        it.set_state(case["state"])
        read = [[int(r[0]) // fixture["seq_len"] for r in next(it)["inputs"]] for _ in range(4)]
        assert read == case["windows"], case


MODEL = small_vocab("minigpt-tiny")


@pytest.fixture(scope="module")
def corpus_4k(tmp_path_factory) -> Path:
    """A jsonl corpus prepared with the TinyStories vocabulary in shards of 2,000 tokens."""
    from test_shards import documents, write_jsonl

    from minigpt.data.prepare_source import prepare_source

    root = tmp_path_factory.mktemp("corpus")
    source = write_jsonl(root / "c.jsonl", documents(700, seed=11))
    prepare_source(str(source), root / "shards", tokenizer="tinystories-4k",
                   shard_tokens=2000, workers=2, progress=False)
    return root / "shards"


def test_a_run_stopped_mid_shard_and_resumed_gives_the_same_losses(corpus_4k, tmp_path):
    config = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(corpus_4k),),
                         out=str(tmp_path / "whole"), steps=6, decay_steps=6, batch_size=8,
                         seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=1,
                         save_every=3, log_every=1)
    minigpt.train(MODEL, config, sample=False)
    # Stopped after step 3 (its checkpoint holds the loader at batch 3, inside a shard), then
    # resumed: the first run's own checkpoint, its later ones gone, as a killed run leaves it.
    shutil.copytree(tmp_path / "whole", tmp_path / "stopped")
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "6")
    minigpt.train(MODEL, dataclasses.replace(config, out=str(tmp_path / "stopped")),
                  resume=True, sample=False)
    assert len(losses(tmp_path / "whole")) == 6
    assert losses(tmp_path / "stopped") == losses(tmp_path / "whole")  # bitwise
    record = json.loads((tmp_path / "stopped" / "config.json").read_text())
    assert Path(record["data_dir"]) == corpus_4k


@pytest.mark.slow
def test_a_large_corpus_is_read_all_over_while_memory_stays_flat(tmp_path):
    """600 MB of shards read at random for 80 M tokens: every part of the folder is mapped at
    some point, and without handing the pages back the process would hold most of it."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "large"
    out.mkdir()
    tokens, chunk = 300_000_000, 10_000_000
    meta = {"format": 2, "kind": "shards", "tokenizer": "gpt2",
            "vocab_hash": shards.vocabulary_hash("gpt2"), "vocab_size": 50257,
            "eot_token": 50256, "bos_token": None, "dtype": "uint16",
            "shard_tokens": 50_000_000, "splits": {}}
    rng = np.random.default_rng(0)
    for split, count in (("train", tokens), ("val", 100_000)):
        writer = shards.ShardWriter(out, split, shard_tokens=50_000_000, dtype=np.dtype("<u2"),
                                    tokenizer="gpt2", vocab_hash=meta["vocab_hash"])
        for first in range(0, count, chunk):
            where = (first + np.arange(min(chunk, count - first))) // 25_000_000  # 12 parts
            ids = (where * 4000 + rng.integers(0, 4000, len(where))).astype(np.uint16)
            starts = np.arange(0, len(ids), 500)
            ids[starts[1:] - 1] = 50256
            writer.append(ids, starts, first // 500 + np.arange(len(starts)), first)
        writer.finish()
        meta["splits"][split] = {"shards": sorted(p.name for p in out.glob(f"{split}-*.bin"))}
        meta[f"{split}_tokens"], meta[f"{split}_documents"] = count, -(-count // 500)
    (out / "meta.json").write_text(json.dumps(meta))
    assert sum(p.stat().st_size for p in out.glob("train-*.bin")) > 600e6

    process = psutil.Process()
    it = batch_iterator(out, "train", seq_len=512, batch_size=64, seed=0,
                        documents=(50256, 50256))
    next(it)
    before, peak, seen = process.memory_info().rss, 0, np.zeros(12, int)
    for k in range(2500):  # 2,500 x 64 x 512 = 82 M tokens, 160k windows
        batch = next(it)
        seen += np.bincount((batch["inputs"][:, 1] // 4000).clip(0, 11), minlength=12)
        if k % 50 == 0:
            peak = max(peak, process.memory_info().rss)
    assert seen.min() > 0  # windows from every part of the folder
    assert peak - before < 300e6, f"resident memory grew by {(peak - before) / 1e6:.0f} MB"


def test_a_changed_shard_or_corpus_is_refused_and_the_run_is_left_as_it_was(corpus_4k, tmp_path,
                                                                            capsys):
    from conftest import refused, snapshot
    from test_shards import documents, write_jsonl

    from minigpt.data.cli import main as data
    from minigpt.data.prepare_source import prepare_source
    from minigpt.data.token_files import DataError

    corpus = Path(shutil.copytree(corpus_4k, tmp_path / "corpus"))
    assert data(["verify", str(corpus)]) == 0
    assert "shards match their checksums" in capsys.readouterr().out
    config = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(corpus),),
                         out=str(tmp_path / "run"), steps=2, batch_size=8, seq_len=32,
                         eval_every=2, eval_batches=1, save_every=2)
    minigpt.train(MODEL, config, sample=False)
    capsys.readouterr()
    before = snapshot(tmp_path / "run")
    resume = dataclasses.replace(config, steps=4)
    # 16 bytes of a shard's tokens changed: verify names it, and so does a resumed run.
    shard = corpus / "train-000002.bin"
    raw = bytearray(shard.read_bytes())
    raw[2000:2016] = bytes(range(16))
    shard.write_bytes(bytes(raw))
    refused(capsys, data(["verify", str(corpus)]), "train-000002.bin is not the shard that was "
                                                   "prepared", "prepare")
    with pytest.raises(DataError, match="train-000002.bin is not the shard that was prepared"):
        minigpt.train(MODEL, resume, resume=True, sample=False)
    assert snapshot(tmp_path / "run") == before
    # The folder deleted and prepared again from other text under the same path.
    shutil.rmtree(corpus)
    prepare_source(str(write_jsonl(tmp_path / "other.jsonl", documents(700, seed=12))), corpus,
                   tokenizer="tinystories-4k", shard_tokens=2000, workers=1, progress=False)
    with pytest.raises(DataError, match="is not the corpus this run started on"):
        minigpt.train(MODEL, resume, resume=True, sample=False)
    assert snapshot(tmp_path / "run") == before
    # Ids past the vocabulary in shards that keep no checksums (prepared before they were
    # kept) never reach the model: the loader refuses the batch.
    meta = json.loads((corpus / "meta.json").read_text())
    del meta["checksums"]
    (corpus / "meta.json").write_text(json.dumps(meta))
    raw = bytearray((corpus / "train-000000.bin").read_bytes())
    raw[shards.HEADER_BYTES:shards.HEADER_BYTES + 4000] = b"\xff" * 4000  # ids 65535
    (corpus / "train-000000.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="holds token id 65535, past its tokenizer's 4096 ids"):
        for _ in batch_iterator(corpus, "train", seq_len=32, batch_size=64, seed=0,
                                shuffle=False, num_epochs=1):
            pass
