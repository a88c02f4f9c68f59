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

import numpy as np


def document_ids(tokens: np.ndarray, begin: int) -> np.ndarray:
    """Document ids [b, n] (from 1) for token rows [b, n]: a new id at every begin token."""
    return (1 + np.cumsum(tokens == begin, axis=1)).astype(np.int32)


def positions_in_documents(ids: np.ndarray) -> np.ndarray:
    """Each position's place in its document [b, n] for document ids [b, n]."""
    n = ids.shape[1]
    index = np.arange(n, dtype=np.int32)
    starts = np.ones(ids.shape, bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def window_documents(window: np.ndarray, begin: int, end: int | None) -> dict[str, np.ndarray]:
    """For windows [b, T + 1] (inputs are the first T tokens, targets the last T): the
    inputs' document ids and positions in their documents, and the loss mask of the targets
    (1 trained: in the input's document, or the end token that closes it), each [b, T]."""
    ids = document_ids(window, begin)  # [b, T + 1]
    same = ids[:, 1:] == ids[:, :-1]
    if end is not None:
        same |= window[:, 1:] == end
    inputs = ids[:, :-1]
    return {"segment_ids": inputs, "positions": positions_in_documents(inputs),
            "loss_mask": same.astype(np.int32)}


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
