"""The Grain batch iterator: packed windows, seeded shuffles, per-process rows, exact restore."""

import json
from pathlib import Path

import numpy as np
import pytest

import minigpt.data.corpus
from minigpt.data.loader import batch_iterator
from minigpt.data.token_files import DataError

# ---------------------------------------------------------------------------------------------
# The batch iterator, over a token file whose token at position i is i (so every row names its
# window).

@pytest.fixture(scope="module")
def counting(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("counting")
    n = {"train": 64 * 16 + 1, "val": 100}  # train: exactly 64 windows of 16 + 1 tokens
    for split, count in n.items():
        np.arange(count, dtype=np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.json").write_text(json.dumps(
        {"dtype": "uint16", "tokenizer": "gpt2", "train_tokens": n["train"],
         "val_tokens": n["val"]}))
    return out


def take(it, n):
    return [next(it) for _ in range(n)]


def window_starts(batches) -> list[int]:
    return [int(row[0]) for b in batches for row in b["inputs"]]


def test_windows_cover_the_stream_with_one_token_overlap(counting):
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0, shuffle=False,
                        num_epochs=1)
    batches = list(it)
    assert len(batches) == 8
    inputs = np.concatenate([b["inputs"] for b in batches])    # [64, 16]
    targets = np.concatenate([b["targets"] for b in batches])  # [64, 16]
    assert inputs.dtype == targets.dtype == np.int32
    stream = np.arange(64 * 16 + 1)
    for i in range(64):
        assert np.array_equal(inputs[i], stream[i * 16:i * 16 + 16])
        assert np.array_equal(targets[i], stream[i * 16 + 1:i * 16 + 17])
    assert np.array_equal(inputs[1:, 0], targets[:-1, -1])  # next window starts at last target


def test_shuffle_is_seeded_per_epoch_permutation(counting):
    def epochs(seed, n=2):
        it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=seed, num_epochs=n)
        starts = window_starts(list(it))
        return [starts[64 * e:64 * (e + 1)] for e in range(n)]

    first, second = epochs(seed=1)
    assert sorted(first) == sorted(second) == list(range(0, 64 * 16, 16))
    assert first != second  # a new order each epoch
    assert epochs(seed=1) == [first, second]
    other = epochs(seed=2)[0]
    assert sorted(other) == sorted(first) and other != first


def test_processes_read_their_rows_of_the_same_global_batches(counting):
    whole = take(batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3), 12)
    for count in (2, 4):
        for p in range(count):
            part = take(batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3,
                                       process_index=p, process_count=count), 12)
            rows = slice(p * 8 // count, (p + 1) * 8 // count)
            for mine, full in zip(part, whole):
                assert mine["inputs"].shape == (8 // count, 16)
                assert np.array_equal(mine["inputs"], full["inputs"][rows])
                assert np.array_equal(mine["targets"], full["targets"][rows])
    with pytest.raises(DataError, match="must split evenly over 3 processes"):
        batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=3, process_count=3)


def test_a_process_gathers_only_its_own_rows(counting, monkeypatch):
    reads = []
    real_windows = minigpt.data.corpus.TokenStream.windows

    def spy(self, starts, length):  # records every gather from the memory-mapped stream
        reads.append((len(starts), length))
        return real_windows(self, starts, length)

    monkeypatch.setattr(minigpt.data.corpus.TokenStream, "windows", spy)
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0, process_index=3,
                        process_count=4)
    take(it, 3)
    assert reads and set(reads) == {(2, 17)}  # 2 of the 8 rows, 16 + 1 tokens each


def test_each_batch_is_asked_of_the_disk_a_batch_before_it_is_read(counting, monkeypatch):
    stream = minigpt.data.corpus.TokenStream
    calls = {}  # each stream this test opens -> the rows each method was called with, in order

    def opened(self, *args, real=stream.__init__):
        real(self, *args)
        calls[self] = []  # (streams of other tests' iterators, still prefetching, are left out)

    monkeypatch.setattr(stream, "__init__", opened)
    def spying(name, real):
        def spy(self, starts, length):
            if self in calls:
                calls[self].append((name, [int(s) for s in starts]))
            return real(self, starts, length)
        return spy

    for name in ("will_need", "windows"):
        monkeypatch.setattr(stream, name, spying(name, getattr(stream, name)))
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0)
    b0, b1, b2 = (window_starts([b]) for b in take(it, 3))
    (first,) = calls.values()
    assert first[:5] == [("will_need", b0), ("will_need", b1), ("windows", b0),
                         ("will_need", b2), ("windows", b1)]
    resumed = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=0)
    resumed.set_state(it.get_state())  # a jump: its first batch is asked for, then read
    b3 = window_starts([next(resumed)])
    (second,) = [c for c in calls.values() if c is not first]
    assert second[0] == ("will_need", b3) and second[2] == ("windows", b3)


def test_restored_iterator_continues_with_identical_batches(counting):
    it = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=5)
    take(it, 6)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    expected = take(it, 5)  # crosses into the second epoch
    resumed = batch_iterator(counting, "train", seq_len=16, batch_size=8, seed=5)
    resumed.set_state(state)
    for a, b in zip(take(resumed, 5), expected):
        assert np.array_equal(a["inputs"], b["inputs"])
        assert np.array_equal(a["targets"], b["targets"])


def test_iterator_refuses_unusable_requests(counting, tmp_path):
    with pytest.raises(DataError, match=r"has 100 tokens, fewer than one batch of 8 windows"):
        batch_iterator(counting, "val", seq_len=16, batch_size=8, seed=0)
    with pytest.raises(DataError, match="unknown split 'test'"):
        batch_iterator(counting, "test", seq_len=16, batch_size=8, seed=0)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text((counting / "meta.json").read_text())
    (broken / "train.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="prepare the data again"):
        batch_iterator(broken, "train", seq_len=16, batch_size=8, seed=0)


def test_batches_from_prepared_stories(data_dir):
    batch = next(batch_iterator(data_dir, "train", seq_len=64, batch_size=4, seed=0))
    assert batch["inputs"].shape == batch["targets"].shape == (4, 64)
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].max() < 50257
