"""Tokenizing a corpus on every core: tasks of documents go to worker processes, which parse,
split and encode them; their results come back in source order, a bounded number in flight.

Each worker holds the tokenizer once and takes whole tasks (`minigpt.data.readers`): it parses
the task's records, decides each document's split from a hash of its text (`held_out`; unless
its file's split is fixed: a dataset's own validation file), and
encodes it with the tokenizer's own `encode_ordinary`, one document at a time on its one core
(tiktoken's and the `tokenizers` library's thread pools are kept out of it, so N workers use N
cores), after the tokenizer's begin token where it has one and before its end token. A resumed
preparation names, for each split, the last document already written (`skip`): documents up to
it are hashed but not encoded again. Workers ignore Ctrl-C, which the main process handles.
Processes start from a fork server that has imported only this module (not JAX, not the
caller's `__main__`), so starting them is cheap and safe inside a process that runs JAX.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from minigpt.data.readers import Task, texts

SPLITS = ("train", "val")
_HASH_SPAN = 1 << 64


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split: the first 8 bytes of its text's
    BLAKE2b hash, read as a number, fall below `val_fraction` of their range. It depends on the
    text alone, so a document keeps its split as the corpus grows or is reordered, and copies
    of one text never straddle the two splits."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * _HASH_SPAN


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker needs besides the task: how to split, encode and what to skip."""

    tokenizer: str
    dtype: str
    text_field: str
    val_fraction: float
    skip: dict[str, tuple[int, int] | None]  # split -> (task, document) written up to


@dataclasses.dataclass
class Encoded:
    """A task's documents: how many (empty ones left out), and per split the documents'
    numbers within the task, their lengths in tokens and their tokens, end to end."""

    seq: int
    position: dict[str, int] | None  # the task's, to begin again at it
    documents: int
    empty: int
    nbytes: int
    splits: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


_loaded: tuple[str, Any] | None = None  # this process's tokenizer: (name asked for, it)


def _start_worker() -> None:
    """Nothing here may fail: a pool starts a worker again each time its initializer fails,
    forever. The tokenizer loads with the first task, where an error reaches the caller."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker


def _tokenizer(name: str):
    global _loaded
    if _loaded is None or _loaded[0] != name:
        from minigpt.tokenizer import load_tokenizer

        _loaded = (name, load_tokenizer(name))
    return _loaded[1]


def _ids(enc):
    """text -> its ids as an array: tiktoken's straight from its buffer (no Python list of
    ints, whose conversion cost a tenth of the encoding), the same ids as `encode_ordinary`
    (no special token is allowed, so their names are text); others' through their lists."""
    if hasattr(enc, "encode_to_numpy"):
        return lambda text: enc.encode_to_numpy(text, allowed_special=frozenset(),
                                                disallowed_special=())
    return lambda text: np.array(enc.encode_ordinary(text), np.uint32)


def encode(task: Task, job: Job) -> Encoded:
    """Parse, split and encode one task (in a worker, or in the calling process)."""
    enc = _tokenizer(job.tokenizer)
    ids_of = _ids(enc)
    begin = np.array([] if enc.bos_token is None else [enc.bos_token], np.uint32)
    end = np.array([] if enc.eot_token is None else [enc.eot_token], np.uint32)
    found = texts(task.kind, task.payload, task.where, job.text_field)
    numbers: dict[str, list[int]] = {s: [] for s in SPLITS}
    lengths: dict[str, list[int]] = {s: [] for s in SPLITS}
    pieces: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    documents = 0
    for text in found:
        if not text:
            continue
        split = task.split or ("val" if held_out(text, job.val_fraction) else "train")
        last = job.skip.get(split)
        if last is None or (task.seq, documents) > tuple(last):
            ids = ids_of(text)
            numbers[split].append(documents)
            lengths[split].append(len(ids) + len(begin) + len(end))
            pieces[split] += [begin, ids, end]
        documents += 1
    splits = {s: (np.array(numbers[s], np.int64), np.array(lengths[s], np.int64),
                  np.concatenate(pieces[s] or [end[:0]]).astype(job.dtype)) for s in SPLITS}
    return Encoded(task.seq, task.position, documents, len(found) - documents, task.nbytes,
                   splits)


def encoded(tasks: Iterable[Task], job: Job, workers: int) -> Iterator[Encoded]:
    """Every task encoded, in order, by `workers` processes, at most a few tasks per worker
    in flight so memory stays bounded however large the corpus; one worker is this process
    (no pool to start: a small text is tokenized in less time than a pool takes to start)."""
    if workers <= 1:
        for task in tasks:
            yield encode(task, job)
        return
    context = _context()
    with _main_hidden():
        pool = context.Pool(max(1, workers), initializer=_start_worker)
    pending: collections.deque = collections.deque()
    try:
        for task in tasks:
            pending.append(pool.apply_async(encode, (task, job)))
            if len(pending) >= 2 * workers + 1:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Start processes without the caller's `__main__`: multiprocessing would import it again in
    each worker, running a script that lacks an `if __name__ == "__main__":` guard once more (and
    failing for code read from stdin, which the pool then restarts forever). Workers need
    nothing of it; the pool starts them all while it is hidden."""
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        main.__spec__ = None
        if "__file__" in saved:
            del main.__file__
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _context() -> multiprocessing.context.BaseContext:
    """A fork server with only this module imported where there is one (Linux, macOS); else
    fresh interpreters."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        return context
    return multiprocessing.get_context("spawn")


def worker_count(requested: int | None) -> int:
    """--workers: all the cores this process may use by default."""
    if requested is not None:
        return max(1, requested)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
