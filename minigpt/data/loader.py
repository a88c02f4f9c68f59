"""Batches for training: a Grain pipeline of packed windows over a prepared split, one path for
every prepared folder (shards, the one-file layout, packed conversations).

`batch_iterator` reads a split as one stream of tokens (`minigpt.data.corpus`: memory-mapped,
never read whole), documents joined by their end token, cut into windows of `seq_len + 1` tokens
that overlap by one (inputs are a window's first `seq_len` tokens, targets its last), so nothing
is padded and no token is wasted. The windows are a random-access source (`Windows`: Grain's
`RandomAccessDataSource` protocol) read in a seeded order, a new one each epoch
(`minigpt.data.order`): for a sharded corpus a keyed shuffle that needs no table, for a folder
prepared before shards the permutation its runs were trained with. Each JAX process reads only
its own rows of every global batch, so the processes' windows are disjoint and together cover
each epoch. The iterator's state is one batch index, so a checkpoint restores it exactly, in
the middle of an epoch or a shard, and batches do not depend on how many processes read them.
The pipeline yields host NumPy arrays and knows nothing about devices: placing a batch on the
mesh is the trainer's job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grain
import numpy as np

import minigpt.data.preferences as preferences
import minigpt.data.prompts as prompts
from minigpt.data.chats import load_rows
from minigpt.data.corpus import TokenStream, open_corpus
from minigpt.data.documents import positions_in_documents, window_documents
from minigpt.data.order import IndexShuffle, Permutation, epoch_orders
from minigpt.data.token_files import DataError, load_meta


class _ReadRows:
    """Global batch k -> this process's rows of it, as one gather: windows of a token stream
    (`Windows`) or prepared rows (`stored_rows`), by index, in the epoch's `order`.

    With `will_need` (a stream's read-ahead), reading batch k first asks for batch k + 1's
    pages, so that from a folder larger than memory the disk reads the next batch while this
    one is copied (twice the reads in flight, at no extra cost)."""

    def __init__(self, gather, num_windows: int, *, batch_size: int, rows: int, first_row: int,
                 seed: int, shuffle: bool, order: type = IndexShuffle, will_need=None):
        self.gather, self.num_windows, self.shuffle = gather, num_windows, shuffle
        self.batch_size, self.rows, self.first_row = batch_size, rows, first_row
        self.will_need = will_need
        self._order = epoch_orders(order, num_windows, seed)
        self._next: tuple[int, np.ndarray] | None = None  # the batch asked for ahead

    def windows(self, k: int) -> np.ndarray:
        first = k * self.batch_size + self.first_row
        epoch, windows = np.divmod(np.arange(first, first + self.rows), self.num_windows)
        if self.shuffle:
            for e in np.unique(epoch):
                windows[epoch == e] = self._order(int(e))(windows[epoch == e])
        return windows

    def __call__(self, k: int) -> dict[str, np.ndarray]:
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == k:
            windows = ahead[1]
        else:  # the first batch, or the first after a restore
            windows = self.windows(k)
            if self.will_need is not None:
                self.will_need(windows)
        if self.will_need is not None:
            upcoming = self.windows(k + 1)
            self.will_need(upcoming)
            self._next = (k + 1, upcoming)
        return self.gather(windows)


class Windows:
    """Window i of a token stream is tokens[i*seq_len : i*seq_len + seq_len + 1], as
    {"inputs", "targets"} [T] (and with `documents`, the begin and end tokens, where the
    window's documents lie: `minigpt.data.documents`). A random-access source in Grain's sense
    (`len`, `[i]`); `gather` reads many windows at once into [b, T] arrays."""

    def __init__(self, tokens: TokenStream, seq_len: int,
                 documents: tuple[int, int | None] | None, vocab_size: int | None = None,
                 where: str = "the corpus"):
        self.tokens, self.seq_len, self.documents = tokens, seq_len, documents
        self.vocab_size, self.where = vocab_size, where

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {name: row[0] for name, row in self.gather(np.array([i])).items()}

    def will_need(self, windows: np.ndarray) -> None:
        """Ask the kernel to start reading these windows' pages (`TokenStream.will_need`)."""
        self.tokens.will_need(windows * self.seq_len, self.seq_len + 1)

    def gather(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        chunk = self.tokens.windows(windows * self.seq_len, self.seq_len + 1)  # [b, T+1]
        if self.vocab_size is not None and chunk.size and int(chunk.max()) >= self.vocab_size:
            raise DataError(f"{self.where} holds token id {int(chunk.max())}, past its "
                            f"tokenizer's {self.vocab_size} ids: it was changed after it was "
                            f"prepared (python -m minigpt.data verify says which shard); "
                            f"prepare it again")
        batch = {"inputs": np.ascontiguousarray(chunk[:, :-1]),   # [b, T]
                 "targets": np.ascontiguousarray(chunk[:, 1:])}   # [b, T]
        if self.documents is not None:
            batch.update(window_documents(chunk, *self.documents))
        return batch


def stored_rows(arrays: dict[str, np.ndarray]):
    """A function gathering prepared rows (packed conversations, `minigpt.data.chats`) by
    index, with each position's place in its conversation."""
    def gather(rows: np.ndarray) -> dict[str, np.ndarray]:
        batch = {name: np.ascontiguousarray(a[rows]) for name, a in arrays.items()}
        batch["positions"] = positions_in_documents(batch["segment_ids"])
        return batch

    return gather


def _stored(data_dir: str | Path, kind: str, split: str, seq_len: int, batch_size: int):
    """A function gathering prepared preference pairs (seq_len + 1 tokens each) or prompts
    (windows of seq_len) by index, and how many there are."""
    arrays = (preferences if kind == "preferences" else prompts).load_rows(data_dir, split)
    count, width = len(arrays["row" if kind == "prompts" else "pair"]), arrays["ids"].shape[-1]
    if width != seq_len + (kind == "preferences"):
        raise DataError(f"{data_dir} holds {kind} of {width} tokens, not for windows of "
                        f"{seq_len}")
    if count < batch_size:
        raise DataError(f"the {split} split of {data_dir} has {count} {kind}, fewer than one "
                        f"batch of {batch_size}: give a smaller --batch-size or more {kind}")
    return (lambda rows: {k: a[rows] for k, a in arrays.items()}), count


def batch_iterator(data_dir: str | Path, split: str, *, seq_len: int, batch_size: int, seed: int,
                   shuffle: bool = True, num_epochs: int | None = None, process_index: int = 0,
                   process_count: int = 1, documents: tuple[int, int | None] | None = None,
                   repeat: int = 1) -> grain.DatasetIterator:
    """Batches `{"inputs", "targets"}` (int32 [batch_size // process_count, seq_len]) of a split;
    with `documents` (the begin and end tokens: `minigpt.data.documents`) also the windows'
    "segment_ids", "positions" and "loss_mask", so that documents stay apart.

    Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]. Global batch k holds windows
    order[k*batch_size : (k+1)*batch_size] of the (shuffled, repeated) window order, and process
    p yields its rows p*b .. (p+1)*b - 1. `num_epochs=None` repeats forever; a last partial batch
    is dropped. `get_state()` / `set_state()` save and restore the position. With `repeat`,
    each batch comes that many times in a row (GRPO's `num_iterations` on one batch).
    """
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")
    if not 0 <= process_index < process_count or batch_size % process_count:
        raise DataError(f"global batch size {batch_size} must split evenly over "
                        f"{process_count} processes (process index {process_index})")
    if seed < 0:
        raise DataError(f"seed must be non-negative, got {seed}")
    if num_epochs is not None and num_epochs < 1:
        raise DataError(f"num_epochs must be positive or None (forever), got {num_epochs}")
    order = Permutation  # conversations and folders prepared before shards keep their order
    kind = load_meta(data_dir).get("kind")
    if kind in ("preferences", "prompts"):  # DPO's pairs, GRPO's prompts
        (gather, num_windows), will_need = _stored(data_dir, kind, split, seq_len,
                                                   batch_size), None
    elif kind == "chats":  # whole windows of conversations
        arrays = load_rows(data_dir, split)
        num_windows = len(arrays["inputs"])
        if arrays["inputs"].shape[1] != seq_len:
            raise DataError(f"{data_dir} holds windows of {arrays['inputs'].shape[1]} tokens, "
                            f"not {seq_len}")
        gather, will_need = stored_rows(arrays), None
    else:
        corpus = open_corpus(data_dir)
        order = IndexShuffle if corpus.sharded else order
        windows = Windows(corpus.stream(split), seq_len, documents,
                          vocab_size=corpus.meta.get("vocab_size"), where=str(data_dir))
        num_windows = len(windows)
        if num_windows < batch_size:
            raise DataError(
                f"the {split} split of {data_dir} has {len(windows.tokens):,} tokens, fewer "
                f"than one batch of {batch_size} windows of {seq_len} + 1 tokens needs "
                f"({batch_size * seq_len + 1:,}): use a smaller batch size or sequence "
                f"length, or more text")
        gather, will_need = windows.gather, windows.will_need
    rows = batch_size // process_count
    read = _ReadRows(gather, num_windows, batch_size=batch_size, rows=rows,
                     first_row=process_index * rows, seed=seed, shuffle=shuffle, order=order,
                     will_need=will_need)
    num_batches = (sys.maxsize if num_epochs is None else num_epochs * num_windows) // batch_size
    if repeat > 1:  # (forever is forever with or without it)
        num_batches *= 1 if num_epochs is None else repeat
    batches = grain.MapDataset.range(num_batches).map(lambda i: read(i // repeat))
    # Batches are cheap to gather from the page cache; a small prefetch overlaps them with the
    # train step without holding hundreds of them in memory (Grain's default buffer is 500).
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
    return iter(batches.to_iter_dataset(options))
