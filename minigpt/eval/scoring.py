"""Scoring rows of tokens in batches: each position's log-probability of its target and whether
the target is the model's likeliest token.

Everything evaluation measures is a sum of these two per-position values: a harness request's
log-likelihood and greedy flag (over its continuation's positions), a rolling window's, the
nats of a text (over the tokens each window scores). A row is the ids the model reads, the id
each position should predict and, where several documents share a row, which document each
position belongs to (`segments`: each is scored as if alone, `DecoderLM`'s contract).

Rows are sorted by length, longest first (the first batch is the largest, so running out of
memory shows at once), cut into batches of `batch_size` and padded to a few lengths (`bucket`:
four per doubling from 64 tokens on, so at most a quarter of a row is padding): a compiled
program serves every batch of its length and number of scored positions (padded to a power of
two), so a task compiles a handful of programs, not one per length. A batch's rows are padded to a
multiple of the ways the preset splits the batch, and lengths to what it splits the sequence
into. The output head and its softmax run only at the positions whose predictions count (a
continuation's, a window's new ones), a slice at a time, so a batch never holds all its
[B, T, V] float32 logits: with a vocabulary of 50,257 they cost more than a small model's
layers. The compiled program is the decoding engine's (`minigpt.decoding.programs.token_scores`),
which computes as every door does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from minigpt.decoding.programs import token_scores
from minigpt.eval.loading import EvalError, Evaluated

SHORTEST = 16  # the shortest padded length: shorter rows cost no less to run


@dataclass(frozen=True)
class Row:
    """Ids the model reads (at most its context), the id each position should predict,
    optionally the document (1, 2, ...) each position belongs to, and the positions whose
    predictions count (`scored`, in order; None: all of them)."""

    inputs: Sequence[int]
    targets: Sequence[int]
    segments: Sequence[int] | None = None
    scored: Sequence[int] | None = None

    def places(self) -> Sequence[int]:
        return range(len(self.inputs)) if self.scored is None else self.scored


def bucket(length: int, context: int, multiple: int = 1, *, steps: int = 4) -> int:
    """The length a row of `length` tokens is padded to: from 64 on, the next of `steps`
    equal steps between two powers of two (64, 80, 96, 112, 128, 160, ... for 4; up to a
    quarter of the row is padding), below 64 16, 24, 32 or 48; a multiple of `multiple`, at
    most the context. `steps=1`: powers of two (the scored positions, whose padding costs
    only the head)."""
    size = SHORTEST
    while size < length:
        power = 1 << (size.bit_length() - 1)  # the power of two at or below size
        size += power // (steps if power >= 64 else 2) if steps > 1 else size
    size = min(size, context)
    return -(-size // multiple) * multiple


class Scorer:
    """Scores rows with a run's model, `batch_size` rows at a time."""

    def __init__(self, evaluated: Evaluated, batch_size: int):
        if batch_size < 1:
            raise EvalError(f"the batch size must be 1 or more, got {batch_size}")
        self.evaluated = evaluated
        rows = evaluated.ways("batch")
        self.batch_size = -(-batch_size // rows) * rows  # every device gets its share
        # Attention over a sequence split across devices takes 2 chunks per device (causal load
        # balancing); a pipeline shares the head's positions among its stages.
        seq = evaluated.ways("seq")
        self.multiple = math.lcm(2 * seq if seq > 1 else 1, evaluated.ways("layers"))
        if evaluated.context % self.multiple:
            raise EvalError(f"the preset splits each sequence into pieces of {self.multiple}, "
                            f"which the model's context of {evaluated.context} does not divide "
                            f"into: choose a preset that splits it fewer ways")

    def score(self, rows: Sequence[Row], *, desc: str = "scoring",
              progress: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each row, in the order given: the log-probability of the target at each of
        its scored positions (float32 [n]) and whether it is the likeliest token (bool [n])."""
        context = self.evaluated.context
        for row in rows:
            if len(row.inputs) > context or len(row.inputs) != len(row.targets):
                raise ValueError(f"a row of {len(row.inputs)} inputs and {len(row.targets)} "
                                 f"targets for a context of {context}")
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].inputs))
        results: list = [None] * len(rows)
        pending = None  # the batch on the devices while the next is made on the host
        with tqdm(total=len(rows), desc=desc, disable=not progress, unit="row") as bar, \
                self.evaluated.active():
            for start in range(0, len(order), self.batch_size):
                chosen = order[start:start + self.batch_size]
                scored = token_scores(self.evaluated.model,
                                       *self._batch([rows[i] for i in chosen]))
                if pending is not None:
                    self._collect(pending, rows, results, bar)
                pending = (chosen, scored)
            if pending is not None:
                self._collect(pending, rows, results, bar)
        return results

    def _batch(self, rows: list[Row]) -> tuple[jax.Array | None, ...]:
        """A batch's inputs and (where rows pack documents) segments [B, T], padded with 0
        (segment 0: padding); the positions scored and their targets [B, C], padded with
        position 0 (whose scores are dropped)."""
        context = self.evaluated.context
        T = bucket(max(len(r.inputs) for r in rows), context, self.multiple)
        C = bucket(max(len(r.places()) for r in rows), context, self.multiple, steps=1)
        inputs = np.zeros((self.batch_size, T), np.int32)
        places = np.zeros((self.batch_size, C), np.int32)
        wanted = np.zeros((self.batch_size, C), np.int32)
        packed = any(r.segments is not None for r in rows)
        segments = np.zeros((self.batch_size, T), np.int32) if packed else None
        for b, row in enumerate(rows):
            n, at = len(row.inputs), np.asarray(row.places(), np.int32)
            inputs[b, :n] = row.inputs
            places[b, :len(at)] = at
            wanted[b, :len(at)] = np.asarray(row.targets, np.int32)[at]
            if packed:
                segments[b, :n] = row.segments if row.segments is not None else 1
        return (jnp.asarray(inputs), None if segments is None else jnp.asarray(segments),
                jnp.asarray(places), jnp.asarray(wanted))

    @staticmethod
    def _collect(pending, rows, results, bar) -> None:
        chosen, (scores, hits) = pending
        scores, hits = np.asarray(scores), np.asarray(hits)
        for b, i in enumerate(chosen):
            n = len(rows[i].places())
            results[i] = (scores[b, :n], hits[b, :n])
        bar.update(len(chosen))
