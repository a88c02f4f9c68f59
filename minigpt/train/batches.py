"""What a run reads: its training batches and its held-out evaluation.

Each process reads its own rows of every global batch (`Layout.batch_share`). With
`train.document_mask` the batches say where each window's documents start
(`minigpt.data.documents`), from the tokenizer's begin and end tokens. Evaluation reads the first
`eval_batches` batches of the validation split in a fixed order and reports nats per token
(`eval_loss`) and bits per byte of the text (`eval_bits_per_byte`), which does not depend on the
tokenizer: the figure bench/bench_stories.py gives held-out stories and the README quotes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import minigpt.data.chats as chats
import minigpt.optim.steps as steps
from minigpt import chat_template, sharding
from minigpt.config import TrainConfig
from minigpt.data.corpus import fingerprint, open_corpus, verify
from minigpt.data.documents import text_targets
from minigpt.data.loader import batch_iterator
from minigpt.data.token_files import DataError, load_meta
from minigpt.runs import RunDir


def for_chats(tokenizer, cfg: TrainConfig, *, resume: bool, say) -> tuple[Any, dict[str, Any]]:
    """The tokenizer a run renders its conversations with, and what config.json records of it:
    for data that is not conversations, the tokenizer as it is and nothing. A vocabulary without
    a chat template (a zoo model's) takes the one the run (or the run it starts from) recorded,
    or ChatML, said in one line; the template is recorded, so `--chat` renders as training did."""
    if not chats.is_chats(cfg.data):
        return tokenizer, {}
    source = cfg.out if resume else cfg.init_from
    recorded = None
    if source and RunDir(source).config_file.is_file():
        recorded = RunDir(source).read().record.get("chat_template")
    rendering, defaulted = chat_template.with_template(tokenizer, recorded)
    if defaulted:
        what = "conversations" if cfg.objective == "lm" else "conversational rows (if any)"
        say(f"the model's vocabulary has no chat template: {what} are rendered as ChatML, its "
            f"end token closing each turn (recorded in config.json; --chat renders the same)")
    if isinstance(rendering, chat_template.Templated):
        return rendering, {"chat_template": rendering.chat_template}
    return rendering, {}


# Data prepared for a run (conversations, preference pairs) rather than a corpus of shards.
PREPARED = ("chats", "preferences", "prompts")


def corpus_fingerprint(data_dir: Path, say) -> str:
    """The corpus a run trains on, checked and known again: every shard's bytes against the
    checksums its preparation recorded (a changed shard is refused, naming it), and a
    fingerprint the run keeps in config.json, which its resumes compare."""
    if load_meta(data_dir).get("kind") in PREPARED:  # prepared for this run: its arrays
        digest = hashlib.sha256()
        for split in ("train", "val"):
            with np.load(data_dir / f"{split}.npz") as arrays:
                for name in sorted(arrays.files):
                    digest.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
        return digest.hexdigest()
    corpus = open_corpus(data_dir)
    began = time.monotonic()
    checked, problems = verify(corpus)
    if problems:
        raise DataError(f"{problems[0]}: prepare {data_dir} again (python -m minigpt.data "
                        f"verify {data_dir} checks every shard)")
    if checked:
        say(f"checked the {checked} shard{'s' * (checked != 1)} of {data_dir} against their "
            f"checksums in {time.monotonic() - began:.1f} s")
    return fingerprint(corpus)


def resumed_record(saved: dict[str, Any], current: dict[str, Any], data_dir: Path
                   ) -> dict[str, Any]:
    """What a resumed run records: the saved record (the time budget's decisions, and more)
    with this run's entries over it. A corpus other than the one the run started on is
    refused (DataError); a run from before fingerprints were kept goes on as it is."""
    before, now = saved.get("data_fingerprint"), current.get("data_fingerprint")
    meta = load_meta(data_dir)
    # Chats were known by their meta.json until its tokenizer's path was seen to change when a
    # run started from an imported one resumes (its own copy of the tokenizer, not the source's).
    earlier = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    if before is not None and now is not None and before not in (now, earlier):
        raise DataError(f"{data_dir} is not the corpus this run started on (it was prepared "
                        f"again from other text, or its files changed): resume with the corpus "
                        f"it started on, or start a new run (another --out)")
    return {**saved, **current}


def documents(tokenizer, cfg: TrainConfig) -> tuple[int, int | None] | None:
    """The begin and end tokens that mark documents apart in a run's data (its tokenizer's
    begin token, or without one the end token, starts each document), or None where the run
    trains on windows as they come (`train.document_mask` false)."""
    if not cfg.document_mask:
        return None
    begin = tokenizer.bos_token if tokenizer.bos_token is not None else tokenizer.eot_token
    return begin, tokenizer.eot_token


def split_batches(data_dir: Path, split: str, cfg: TrainConfig, seq_len: int,
                  layout: sharding.Layout, *, documents: tuple[int, int | None] | None,
                  shuffle: bool = True):
    """A split's batches, this process reading only its share of each (`layout.batch_share`):
    training batches in the run's shuffled order, validation ones (`shuffle=False`) in a
    fixed order."""
    share, shares = layout.batch_share(cfg.batch_size)
    return batch_iterator(data_dir, split, seq_len=seq_len, batch_size=cfg.batch_size,
                          seed=cfg.seed if shuffle else 0, shuffle=shuffle,
                          process_index=share, process_count=shares, documents=documents)


def evaluate(model, tokenizer, data_dir: Path, cfg: TrainConfig, seq_len: int,
             layout: sharding.Layout, *, documents: tuple[int, int | None] | None
             ) -> dict[str, Any]:
    """{"eval_loss", "eval_bits_per_byte"} over the first `eval_batches` batches of the
    validation split (fixed order)."""
    batches = split_batches(data_dir, "val", cfg, seq_len, layout, documents=documents,
                            shuffle=False)
    special = tuple(t for t in (tokenizer.bos_token, tokenizer.eot_token) if t is not None)

    def placed():
        for _ in range(cfg.eval_batches):
            host = next(batches)
            yield layout.put_batch({**host, **text_targets(host, tokenizer.decode, special)})

    return steps.evaluate(model, placed())
