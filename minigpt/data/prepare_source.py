"""`python -m minigpt.data prepare --source ...`: any corpus tokenized once, on every core, into a
folder of shards that training streams from disk; a killed preparation goes on from its last
finished shard.

Documents come from `minigpt.data.readers` in source order, are encoded by worker processes
(`minigpt.data.encoding`: the split of each document chosen by a hash of its text), and are
written in that order by one `ShardWriter` per split (`minigpt.data.shards`). After each finished
shard, `progress.json` records where a new run must begin: for each split, its finished shards
and the last document wholly inside them, and the source task holding the earliest of those
documents. Running the same command again reads from that task, hashes the documents it already
wrote without encoding them again, and continues every split exactly where its last shard
ended, so the shards are the ones an uninterrupted run writes. meta.json, written last, records
the settings, the source's files (sizes and times), the counts and the shards; the same command
on a finished folder reuses it. A folder holding another preparation is refused, never
overwritten; a source the preparation refuses (a record without the text field, text that is
not UTF-8) leaves nothing of this preparation behind.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from minigpt.data import encoding, readers
from minigpt.data.corpus import SHARDS, open_corpus
from minigpt.data.prepare import separating_tokenizer
from minigpt.data.shards import (
    ShardWriter,
    pack_header,
    read_header,
    token_dtype,
    tokens_checksum,
    vocabulary_hash,
)
from minigpt.data.token_files import SPLITS, DataError, load_meta, write_meta
from minigpt.files import write_text_atomic
from minigpt.tokenizer import DEFAULT_TOKENIZER

FORMAT = 2
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's and nanoGPT's: 200 MB of uint16 a shard
DEFAULT_VAL_FRACTION = 0.1  # as `prepare --text`; a large corpus needs far less (0.001)
PROGRESS = "progress.json"
_OURS = re.compile(r"^(train|val)-\d{6}\.bin(\.tmp)?$")


def prepare_source(source: str | readers.Source, out: str | Path, *,
                   tokenizer: str = DEFAULT_TOKENIZER, text_field: str = "text",
                   shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   val_fraction: float = DEFAULT_VAL_FRACTION, workers: int | None = None,
                   dataset: dict[str, Any] | None = None, progress: bool = True
                   ) -> dict[str, Any]:
    """Tokenize `source` (a `--source` spec, see `minigpt.data.readers`, or a `Source` built by
    a caller: TinyStories' files with their own splits) into shards in `out`; return meta.json.
    `dataset`: where a named dataset came from, for meta.json (a changed one is another
    preparation)."""
    out = Path(out)
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be positive, got {shard_tokens}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be at least 1 (or left out: every core), got "
                        f"{workers}")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file: give a folder for the shards")
    spec = (source if isinstance(source, readers.Source)
            else readers.parse_source(source, exclude=out))
    enc = separating_tokenizer(tokenizer)
    settings = {"format": FORMAT, "kind": SHARDS, "source": spec.spec,
                "sources": spec.identity(), "dataset": dataset,
                "text_field": text_field, "tokenizer": tokenizer,
                "vocab_hash": vocabulary_hash(tokenizer), "shard_tokens": shard_tokens,
                "val_fraction": val_fraction,
                "tasks": [readers.JSONL_BYTES, readers.PARQUET_ROWS, readers.DATASET_ROWS]}
    pack_header(dtype=token_dtype(enc.n_vocab), first=0, tokens=0, documents=0,
                vocab_hash=settings["vocab_hash"], tokenizer=tokenizer)  # a name that fits
    saved = _previous(out, settings)
    if saved == "done":
        return load_meta(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        remove_shards(out, progress_too=True)
    run = _Run(out, settings, spec, enc, saved)
    try:
        run.tokenize(workers, progress)
        return run.finish(enc)
    except DataError:
        run.discard()
        remove_shards(out, progress_too=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    except BaseException:
        run.discard()  # the finished shards and progress.json stay: run again to go on
        raise


def _previous(out: Path, settings: dict[str, Any]) -> str | dict[str, Any] | None:
    """"done" when `out` holds this preparation finished, its progress when it holds this one
    interrupted, None when it holds neither; a folder holding another is refused."""
    if (out / "meta.json").is_file():
        meta = load_meta(out)
        differ = [k for k, v in settings.items() if meta.get(k) != v]
        if not differ:
            return "done"
        raise DataError(f"{out} already holds a prepared corpus, made with other settings "
                        f"({', '.join(differ)} differ): choose another --out, or delete {out} "
                        f"to prepare it again")
    path = out / PROGRESS
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            differ = [k for k, v in settings.items() if saved["settings"].get(k) != v]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DataError(f"{path} is damaged: delete {out} to prepare it again") from None
        if differ:
            raise DataError(f"{out} holds an interrupted preparation with other settings "
                            f"({', '.join(differ)} differ): run that command again to finish "
                            f"it, or delete {out} to start this one")
        return saved
    return None


def remove_shards(out: Path, *, progress_too: bool) -> None:
    """Delete the shards (finished or not) a preparation wrote in `out` (with `progress_too`,
    its progress.json too)."""
    for path in out.iterdir() if out.is_dir() else ():
        if _OURS.match(path.name) or (progress_too and path.name == PROGRESS):
            path.unlink()


class _Run:
    """One preparation, fresh or resumed: the writers, where each split's stream stands, and
    which task a later run would restart from."""

    def __init__(self, out: Path, settings: dict[str, Any], spec: readers.Source, enc,
                 saved: dict[str, Any] | None):
        self.out, self.settings, self.spec = out, settings, spec
        self.dtype = token_dtype(enc.n_vocab)
        saved = saved or {"restart": {"seq": 0, "position": None, "ordinal": 0, "empty": 0},
                          "splits": {s: {"shards": 0, "through": None, "end": 0} for s in SPLITS}}
        self.restart = saved["restart"]
        n = settings["shard_tokens"]
        self.writers, self.cursor, self.skip = {}, {}, {}
        for split, state in saved["splits"].items():
            through = state["through"]
            self.writers[split] = ShardWriter(
                out, split, shard_tokens=n, dtype=self.dtype, tokenizer=settings["tokenizer"],
                vocab_hash=settings["vocab_hash"], position=state["shards"] * n,
                done=None if through is None else (through[0], state["end"]),
                on_shard=self._shard_done)
            self.cursor[split] = state["end"]
            self.skip[split] = None if through is None else (through[1], through[2])
        # (task, its first document's number, empty documents before it, its position)
        self.history: list[tuple[int, int, int, dict | None]] = []

    def tokenize(self, workers: int | None, progress: bool) -> None:
        job = encoding.Job(self.settings["tokenizer"], self.dtype.name,
                           self.settings["text_field"], self.settings["val_fraction"], self.skip)
        count = encoding.worker_count(workers)
        tasks = readers.tasks(self.spec, self.settings["text_field"],
                              self.restart["position"], self.restart["seq"])
        ordinal, empty = self.restart["ordinal"], self.restart["empty"]
        # On a terminal only (tqdm's disable=None), and cleared when done or refused, so a
        # refusal is the one line left; the rate is said once at the end instead.
        bar = tqdm(total=self.spec.total_bytes(), unit="B", unit_scale=True, unit_divisor=1000,
                   desc=f"tokenizing ({count} worker{'s' * (count > 1)})", leave=False,
                   disable=None if progress else True)
        tokens, began, read = 0, time.monotonic(), 0
        with bar:
            for result in encoding.encoded(tasks, job, count):
                self.history.append((result.seq, ordinal, empty, result.position))
                for split in SPLITS:
                    numbers, lengths, ids = result.splits[split]
                    if len(numbers):
                        starts = np.cumsum(lengths) - lengths
                        self.writers[split].append(ids, starts, ordinal + numbers,
                                                   self.cursor[split])
                        self.cursor[split] += len(ids)
                        tokens += len(ids)
                ordinal, empty = ordinal + result.documents, empty + result.empty
                bar.update(result.nbytes)
                read += result.nbytes
                bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9) / 1e6:.2f}"
                                    f" M tokens/s", refresh=False)
        self.empty = empty
        seconds = max(time.monotonic() - began, 1e-9)
        if progress:
            print(f"tokenized {read / 1e6:,.1f} MB in {seconds:.1f} s with {count} worker"
                  f"{'s' * (count > 1)}: {read / 1e6 / seconds:.1f} MB/s, "
                  f"{tokens / 1e6 / seconds:.2f} M tokens/s", file=sys.stderr)
        for writer in self.writers.values():
            writer.finish()

    def _shard_done(self, _writer: ShardWriter) -> None:
        """Record where a later run restarts: the task holding the earliest document that some
        split has not wholly written, or this run's first task while a split has none."""
        firsts = [entry[1] for entry in self.history]
        splits, earliest = {}, None
        for split, writer in self.writers.items():
            through = None
            if writer.complete is not None:
                number, end = writer.complete
                at = bisect.bisect_right(firsts, number) - 1
                through = [number, self.history[at][0], number - firsts[at]]
                earliest = at if earliest is None else min(earliest, at)
            splits[split] = {"shards": writer.shards, "through": through,
                             "end": 0 if through is None else writer.complete[1]}
        if any(s["through"] is None for s in splits.values()) or earliest is None:
            earliest = 0
        seq, first, empty, position = self.history[earliest]
        self.restart = {"seq": seq, "position": position, "ordinal": first, "empty": empty}
        del self.history[:earliest]
        write_text_atomic(self.out / PROGRESS, json.dumps(
            {"settings": self.settings, "restart": self.restart, "splits": splits}) + "\n")

    def finish(self, enc) -> dict[str, Any]:
        """Check both splits have documents, write meta.json, and open the result once."""
        names = {s: sorted(p.name for p in self.out.glob(f"{s}-*.bin")) for s in SPLITS}
        if not names["train"] or not names["val"]:
            empty = "val" if names["train"] else "train"
            raise DataError(f"no document of {self.spec.spec} went to the {empty} split "
                            f"(--val-fraction {self.settings['val_fraction']}): give more "
                            f"documents" + (" or a larger --val-fraction" if empty == "val"
                                            else " or a smaller --val-fraction"))
        meta = {**self.settings, "vocab_size": enc.n_vocab, "eot_token": enc.eot_token,
                "bos_token": enc.bos_token, "dtype": self.dtype.name,
                "splits": {s: {"shards": names[s]} for s in SPLITS},
                "split_rule": ("each file's own split" if self.spec.splits else
                               "a document is held out when the first 8 bytes of the BLAKE2b "
                               "hash of its text, little-endian, fall below val_fraction * "
                               "2^64"),
                "empty_documents": self.empty,
                "created": datetime.now(UTC).isoformat(timespec="seconds")}
        for split in SPLITS:  # the shards' own headers are the counts
            headers = [read_header(self.out / name) for name in names[split]]
            meta[f"{split}_tokens"] = sum(h.tokens for h in headers)
            meta[f"{split}_documents"] = sum(h.documents for h in headers)
        # Each shard's tokens' sha256, which `verify` and every training run check them against.
        meta["checksums"] = {name: tokens_checksum(self.out / name)
                             for split in SPLITS for name in names[split]}
        write_meta(self.out, meta)
        (self.out / PROGRESS).unlink(missing_ok=True)
        open_corpus(self.out)
        return meta

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.discard()
