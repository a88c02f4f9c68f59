"""Where documents start and end inside a packed window of tokens (host NumPy, beside the loader).

Prepared data is one stream of documents, each after its begin token where the tokenizer has one
(Llama's `<s>`) and before its end token (`<|endoftext|>`). A window cut from the stream holds
the end of one document, some whole ones and the start of another. `window_documents` says, for
the inputs and targets of each window, which document each position belongs to, where it sits
in it, and which targets are trained, from the begin and end tokens the data already holds
(prepared data needs no rewrite):

- a document starts at each begin token; a tokenizer without one (GPT-2's) starts each document
  at the end token that closes the one before, which then serves both: it ends one document and
  begins the next, as `<|endoftext|>` does in GPT-2's own training stream;
- a target in the next document is not trained (it cannot be predicted from this one), except
  the end token: predicting where a document ends is what lets generation stop.

The model's side of the same rules (positions from ids, which keys a query sees) is
`minigpt.models.masks`.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=8)
def _index(size: int) -> np.ndarray:
    """0 .. size - 1 (int32, read-only), kept: every batch of a run has the same size."""
    index = np.arange(size, dtype=np.int32)
    index.flags.writeable = False
    return index


def _runs(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of a document's positions begins in the flattened [b, n] `starts` (True
    at each document's first position, and at every row's first), and how long it is."""
    first = np.flatnonzero(starts)
    return first, np.diff(first, append=starts.size)


def _positions(first: np.ndarray, lengths: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Each position's place in its run [b, n]: its index less its run's first index."""
    at = np.repeat(first.astype(np.int32), lengths)
    return (_index(at.size) - at).reshape(shape)


def positions_in_documents(ids: np.ndarray) -> np.ndarray:
    """Each position's place in its document [b, n] for document ids [b, n]."""
    starts = np.ones(ids.shape, bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return _positions(*_runs(starts), ids.shape)


def window_documents(window: np.ndarray, begin: int, end: int | None) -> dict[str, np.ndarray]:
    """For windows [b, T + 1] (inputs are the first T tokens, targets the last T): the
    inputs' document ids (from 1 in each row, counting begin tokens) and positions in their
    documents, and the loss mask of the targets (1 trained: in the input's document, or the end
    token that closes it), each int32 [b, T].

    A loader marks every batch, so this works on the few places documents start rather than on
    every token: one pass finds them, and the ids and positions are filled in runs from there
    (a running count or maximum over every token is several times slower in NumPy)."""
    T = window.shape[1] - 1
    is_begin = window == begin  # [b, T + 1]
    starts = is_begin[:, :-1].copy()  # [b, T]: where an input's document starts
    starts[:, 0] = True
    first, lengths = _runs(starts)  # [K] each
    begins = is_begin[:, :-1].ravel()[first]  # [K]: which of the starts are begin tokens
    counted = np.cumsum(begins, dtype=np.int32)
    row_first = np.flatnonzero(first % T == 0)  # [b]: each row's first start
    before = (counted - begins)[row_first]  # [b]: begin tokens in the rows before
    ids = np.repeat(1 + counted - before[first // T], lengths).reshape(starts.shape)
    if end == begin:  # GPT-2's end token begins the next document: every target is trained
        mask = np.ones(starts.shape, np.int32)
    else:
        same = ~is_begin[:, 1:]  # the target is in the input's document
        if end is not None:
            same |= window[:, 1:] == end
        mask = same.astype(np.int32)
    return {"segment_ids": ids, "positions": _positions(first, lengths, starts.shape),
            "loss_mask": mask}


def text_targets(batch: dict[str, np.ndarray], decode, special: tuple[int, ...]
                 ) -> dict[str, np.ndarray]:
    """What bits per byte are measured on, for a host batch: "text_mask" [b, T] (the trained
    targets that are text, not one of the `special` begin and end tokens) and "text_bytes"
    [b, T] (each row's text as UTF-8 bytes, `decode(ids) -> str` of its text targets, at the
    row's first position; zeros elsewhere, so that summing gives the batch's bytes)."""
    targets = batch["targets"]
    text = ~np.isin(targets, special)
    if "loss_mask" in batch:
        text &= batch["loss_mask"].astype(bool)
    counts = np.zeros(targets.shape, np.int32)
    counts[:, 0] = [len(decode(row[keep].tolist()).encode("utf-8"))
                    for row, keep in zip(targets, text)]
    return {"text_mask": text.astype(np.int32), "text_bytes": counts}
