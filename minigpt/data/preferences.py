"""Preference pairs for DPO: read, tokenized as TRL's `DPOTrainer` tokenizes them, and kept.

`python -m minigpt.train --init-from RUN --objective dpo --data prefs.jsonl` reads one JSON
object per line in either of TRL's preference formats:

- standard: `{"prompt": str, "chosen": str, "rejected": str}`. Each reply gets the tokenizer's
  end token (its `eos_token`, as TRL appends it) unless it ends with it, and is tokenized with
  its prompt as one string (`prompt + reply`, the tokenizer's begin token first where it adds
  one; a zoo vocabulary's prompt starts after its end token, as its documents do);
- conversational: `prompt` a list of messages, `chosen` and `rejected` lists of (assistant)
  messages. The prompt is rendered with the run's chat template and its generation prompt, each
  whole conversation (prompt + reply) without it, and both tokenized as the template spells
  them (TRL appends no end token here: the template closes the turn).

Where the reply starts is where the two token lists part: the prompt's tokens that both
conversations (chosen and rejected) begin with. A merge across the boundary (a prompt ending
in a space) moves that token into the replies, as TRL moves it. Each sequence is cut at the
run's window of `seq_len + 1` tokens (TRL's `max_length`, `truncation_mode="keep_start"`); a
prompt that leaves no room for a reply is refused with its line number, as are rows missing a
field, replies that are empty and lines that are not JSON.

The pairs are kept in `<data_root>/prefs-<hash>/` (`train.npz`, `val.npz` and meta.json, written
last): every `VAL_EVERY`-th pair is held out (with fewer than `VAL_EVERY` pairs, evaluation reads
the training ones). Arrays per pair: `ids` [N, 2, seq_len + 1] (chosen, then rejected; 0 past
the end), `completion` (1 on reply tokens) and `pair` (the pair's index in its split).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minigpt import chat_template
from minigpt.data.chats import ROLES, VAL_EVERY, chat_files, load_split, records
from minigpt.data.token_files import DataError, load_meta, write_meta
from minigpt.files import replacing, sha256

FORMAT = "minigpt-preferences-1"
ARRAYS = ("ids", "completion", "pair")
FIELDS = ("prompt", "chosen", "rejected")


def read_pairs(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The pairs of a .jsonl file, each (where, row), checked to hold the three fields of one
    format; DataError naming the line for any that does not."""
    rows = [(where, _checked(row, where)) for where, row in records(path)]
    if not rows:
        raise DataError(f"{path} holds no preference pairs")
    return rows


def _checked(row: Any, where: str) -> dict[str, Any]:
    missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
    if missing:
        raise DataError(f"{where} has no {' or '.join(missing)}: a pair is {{\"prompt\", "
                        f"\"chosen\", \"rejected\"}} (strings, or lists of messages)")
    kinds = {type(row[f]) for f in FIELDS}
    if kinds == {str}:
        for f in ("chosen", "rejected"):
            if not row[f].strip():
                raise DataError(f"{where}: the {f} reply is empty: a pair compares two replies")
        return row
    if kinds != {list}:
        raise DataError(f"{where}: prompt, chosen and rejected must all be strings (standard "
                        f"pairs) or all lists of messages (conversational ones)")
    for f in FIELDS:
        for message in row[f]:
            if not (isinstance(message, dict) and message.get("role") in ROLES
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{where}: {f} holds a message that is not {{\"role\": "
                                f"{'|'.join(ROLES)}, \"content\": text}}")
    for f in ("chosen", "rejected"):
        if not any(m["content"].strip() for m in row[f]):
            raise DataError(f"{where}: the {f} reply is empty: a pair compares two replies")
    return row


def end_token(tokenizer) -> int:
    """The token TRL appends to a standard pair's replies: the tokenizer's `eos_token` (as
    tokenizer_config.json names it), else its first end token."""
    name = getattr(tokenizer, "_config", {}).get("eos_token")
    name = name.get("content") if isinstance(name, dict) else name
    token = tokenizer.inner.token_to_id(name) if isinstance(name, str) else None
    return tokenizer.eot_token if token is None else token


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def encode(tokenizer, row: dict[str, Any], where: str, window: int
           ) -> tuple[list[list[int]], int]:
    """A pair's two sequences (prompt and reply, whole) and where their replies start."""
    if isinstance(row["prompt"], str):
        end = end_token(tokenizer)
        prompt = tokenizer.encode_prompt(row["prompt"])
        whole = []
        for reply in (row["chosen"], row["rejected"]):
            ids = tokenizer.encode_prompt(row["prompt"] + reply)
            whole.append(ids if ids[-1:] == [end] else [*ids, end])
    else:
        max_chars = window * chat_template.CHARS_PER_TOKEN * 2
        try:
            prompt = tokenizer.encode_ordinary(tokenizer.render_chat(
                row["prompt"], add_generation_prompt=True, max_chars=max_chars))
            whole = [tokenizer.encode_ordinary(tokenizer.render_chat(
                row["prompt"] + row[f], add_generation_prompt=False, max_chars=max_chars))
                for f in ("chosen", "rejected")]
        except (chat_template.RenderError, RuntimeError) as error:  # RuntimeError: a
            raise DataError(f"{where}: {error}") from None  # TokenizerError of the template
    start = min(_common(prompt, ids) for ids in whole)
    if start >= window:
        raise DataError(f"{where}: the prompt is {start} tokens, leaving no room for a reply "
                        f"in the window of {window} (train.seq_len + 1): shorten it or give a "
                        f"longer --seq-len")
    return [ids[:window] for ids in whole], start


def prepare_preferences(files: Sequence[str | Path], root: str | Path, tokenizer,
                        tokenizer_name: str, seq_len: int) -> Path:
    """Prepare preference pairs into `root/prefs-<hash>/` once (see the module docstring);
    returns the directory."""
    paths = [p for p in chat_files(files) if p.suffix == ".jsonl"]
    if not paths:
        raise DataError(f"--objective dpo reads pairs from .jsonl files, not "
                        f"{', '.join(map(str, files))}")
    settings = {"format": FORMAT, "tokenizer": tokenizer_name, "seq_len": seq_len,
                "template": hashlib.sha256(
                    str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:16],
                "files": [sha256(p) for p in paths]}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(root) / f"prefs-{tag}"
    if (out / "meta.json").is_file() and load_meta(out).get("settings") == settings:
        return out
    window = seq_len + 1
    pairs = [encode(tokenizer, row, where, window)
             for path in paths for where, row in read_pairs(path)]
    held = [p for i, p in enumerate(pairs) if (i + 1) % VAL_EVERY == 0]
    train = [p for i, p in enumerate(pairs) if (i + 1) % VAL_EVERY]
    splits = {"train": _arrays(train, window), "val": _arrays(held or train, window)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for split, arrays in splits.items():
        with replacing(out / f"{split}.npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    write_meta(out, {"kind": "preferences", "tokenizer": tokenizer_name,
                     "vocab_size": tokenizer.n_vocab, "settings": settings,
                     "pairs": len(pairs), "held_out": len(held),
                     "truncated": sum(len(ids) == window for seqs, _ in pairs for ids in seqs),
                     "sources": [str(p.resolve()) for p in paths]})
    return out


def _arrays(pairs: list[tuple[list[list[int]], int]], window: int) -> dict[str, np.ndarray]:
    ids = np.zeros((len(pairs), 2, window), np.int32)
    completion = np.zeros((len(pairs), 2, window), np.uint8)
    for i, (seqs, start) in enumerate(pairs):
        for j, seq in enumerate(seqs):
            ids[i, j, :len(seq)] = seq
            completion[i, j, start:len(seq)] = 1
    return {"ids": ids, "completion": completion, "pair": np.arange(len(pairs), dtype=np.int32)}


def load_rows(data_dir: str | Path, split: str) -> dict[str, np.ndarray]:
    """A prepared split's pairs (`ARRAYS`)."""
    return load_split(data_dir, split, ARRAYS, "pairs")
