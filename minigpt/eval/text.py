"""Loss and bits per byte of any text: `python -m minigpt.eval --run RUN --text FILE...`.

Bits per byte is the figure this project reports (`minigpt.train.batches`): the text's nats
over ln 2 over its UTF-8 bytes, which does not depend on the tokenizer, so runs with different
vocabularies and imported checkpoints compare on the same text. Here it is measured on any
files:

- Documents: each file is one, or several where it holds `<|endoftext|>` separators (the
  TinyStories layout); each is stripped of surrounding whitespace, and an empty one skipped.
  A document is read as the model's training stream holds one: after the tokenizer's begin
  token, or without one after the end token that closes the document before; every token of
  its text is scored (not the begin token, which is not text) and its bytes counted.
- Windows: a document longer than the context is scored in overlapping windows of the whole
  context, `stride` tokens apart; the first window scores all of its tokens, each later one
  only the tokens after the window before, so every token is scored once, with at least
  context - stride tokens before it (all of them in a shorter document).
- Documents are kept apart: a window never crosses into another document. Short documents
  and windows share rows, each in a segment of its own that it alone attends to
  (`DecoderLM`'s documents), which computes what running each alone would.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minigpt.eval.loading import EvalError, Evaluated
from minigpt.eval.scoring import Row, Scorer

SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class TextScore:
    """What a text scored: nats over its tokens and bytes."""

    name: str
    documents: int
    tokens: int
    bytes: int
    nats: float

    @property
    def loss(self) -> float:
        """Nats per token."""
        return self.nats / max(self.tokens, 1)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / max(self.bytes, 1)

    def as_dict(self) -> dict:
        return {"file": self.name, "documents": self.documents, "tokens": self.tokens,
                "bytes": self.bytes, "loss": self.loss, "bits_per_byte": self.bits_per_byte}


def read_documents(path: str | Path) -> list[str]:
    """A file's documents (see the module docstring); EvalError for a file that is missing,
    not UTF-8 text, or empty."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"--text {path}: no such file" + (" (it is a folder: give the files in "
                                                          "it)" if path.is_dir() else ""))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EvalError(f"{path} is not UTF-8 text (byte {error.start:,}): re-encode it, e.g. "
                        f"`iconv -f latin1 -t utf-8`") from None
    documents = [d.strip() for d in text.removeprefix("\ufeff").split(SEPARATOR)]
    documents = [d for d in documents if d]
    if not documents:
        raise EvalError(f"{path} holds no text to score")
    return documents


def windows(length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """For a document of `length` tokens (its begin token first): (start, end, scored from)
    of each window, inputs tokens[start:end] predicting tokens[start + 1:end + 1], the
    predictions from index `scored from` of the window on counted."""
    last = length - 1  # predictions: tokens 1 .. length - 1
    end = min(context, last)
    pieces = [(0, end, 0)]
    while end < last:
        new_end = min(end + stride, last)
        start = new_end - context
        pieces.append((start, new_end, end - start))
        end = new_end
    return pieces


def score_texts(evaluated: Evaluated, files: Sequence[str | Path], *, stride: int | None = None,
                batch_size: int = 8, progress: bool = True) -> tuple[list[TextScore], TextScore]:
    """Each file's score and all of them together."""
    context = evaluated.context
    stride = stride or max(1, context // 2)
    if not 1 <= stride <= context:
        raise EvalError(f"--stride must be 1 to the model's context, {context}; got {stride}")
    texts = [read_documents(f) for f in files]  # every file checked before anything runs
    tokenizer = evaluated.tokenizer
    begin = tokenizer.bos_token if tokenizer.bos_token is not None else tokenizer.eot_token
    pieces = []  # (file, tokens, start, end, scored from)
    counts = np.zeros(len(files), np.int64)
    for number, documents in enumerate(texts):
        for document in documents:
            tokens = [begin, *tokenizer.encode_ordinary(document)]
            counts[number] += len(tokens) - 1
            pieces += [(number, tokens, *w) for w in windows(len(tokens), context, stride)]
    rows, spans = _packed(pieces, context)
    scored = Scorer(evaluated, batch_size).score(rows, desc="minigpt: text", progress=progress)
    nats = np.zeros(len(files))
    for (scores, _), row_spans in zip(scored, spans):
        at = 0  # the scores come span after span
        for number, a, b in row_spans:
            nats[number] -= float(np.sum(scores[at:at + b - a], dtype=np.float64))
            at += b - a
    results = [TextScore(str(f), len(docs), int(n_tokens),
                         sum(len(d.encode("utf-8")) for d in docs), float(n))
               for f, docs, n_tokens, n in zip(files, texts, counts, nats)]
    total = TextScore("all", sum(r.documents for r in results), sum(r.tokens for r in results),
                      sum(r.bytes for r in results), float(np.sum(nats)))
    return results, total


def _packed(pieces, context: int):
    """Rows of at most `context` tokens holding the pieces, longest first, each in the row
    with the least room that still fits it (a segment of its own); for each row, the
    (file, from, to) positions whose predictions count."""
    order = sorted(range(len(pieces)), key=lambda i: -(pieces[i][3] - pieces[i][2]))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        size = pieces[i][3] - pieces[i][2]
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([])
            room, row = context, len(bins) - 1
        else:
            room, row = free.pop(at)
        bins[row].append(i)
        if room > size:
            bisect.insort(free, (room - size, row))
    rows, places = [], []
    for members in bins:
        inputs, targets, segments, spans, scored = [], [], [], [], []
        for segment, i in enumerate(members, 1):
            number, tokens, start, end, first = pieces[i]
            offset = len(inputs)
            inputs += tokens[start:end]
            targets += tokens[start + 1:end + 1]
            segments += [segment] * (end - start)
            spans.append((number, offset + first, offset + end - start))
            scored += range(offset + first, offset + end - start)
        rows.append(Row(inputs, targets, segments, scored))
        places.append(spans)
    return rows, places
