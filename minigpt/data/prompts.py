"""Prompts for GRPO: read, tokenized as TRL's `GRPOTrainer` tokenizes them, and kept.

`python -m minigpt.train --init-from RUN --objective grpo --data prompts.jsonl --reward
FILE.py:FUNC` reads one JSON object per line in TRL's prompt-only format: `{"prompt": str or
[messages], ...columns}`. A string prompt is tokenized as the tokenizer gives a prompt to the
model (its begin token first where it adds one; a zoo vocabulary's after its end token); a
conversation is rendered with the run's chat template and its generation prompt. The other
columns (an answer to check, say) reach the reward functions as TRL passes them.

A prompt must leave room for `train.max_completion_length` new tokens in the window of
`train.seq_len` tokens; one that does not, a line that is not JSON, a row without a prompt or
with an empty one is refused with its line number. Every `VAL_EVERY`-th prompt is held out for
evaluation (with fewer than `VAL_EVERY`, evaluation reads the training ones). Kept in
`<data_root>/prompts-<hash>/`: `train.npz` and `val.npz` (`ids` [N, seq_len], 0 past each
prompt, `length` [N], `row` [N], the row's index in `rows.json`), `rows.json` (the rows as they
came) and meta.json, written last.
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
from minigpt.files import replacing, sha256, write_text_atomic

FORMAT = "minigpt-prompts-1"
ARRAYS = ("ids", "length", "row")
# What reward functions are given besides a row's columns (TRL's names), and TRL's own.
RESERVED = frozenset({"prompts", "completions", "completion_ids", "completion",
                      "trainer_state", "log_extra", "log_metric"})


def read_prompts(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a .jsonl file, each (where, row), checked to hold a prompt."""
    rows = records(path)
    for where, row in rows:
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(m, dict) and m.get("role") in ROLES and
                                     isinstance(m.get("content"), str) for m in prompt):
                raise DataError(f"{where}: prompt must be messages {{\"role\": "
                                f"{'|'.join(ROLES)}, \"content\": text}}")
        elif not (isinstance(prompt, str) and prompt.strip()):
            raise DataError(f"{where} has no prompt: each line is {{\"prompt\": text or "
                            f"messages, ...other columns}}")
        taken = sorted(set(row) & RESERVED)
        if taken:
            raise DataError(f"{where}: the column {taken[0]!r} is a name reward functions are "
                            f"given by the trainer; rename it")
    if not rows:
        raise DataError(f"{path} holds no prompts")
    return rows


def encode(tokenizer, prompt: str | list[dict[str, str]], where: str, room: int) -> list[int]:
    """A prompt's tokens as TRL gives them to the model; refused where they leave no room."""
    if isinstance(prompt, str):
        ids = tokenizer.encode_prompt(prompt)
    else:
        try:
            ids = tokenizer.encode_ordinary(tokenizer.render_chat(
                prompt, add_generation_prompt=True,
                max_chars=room * chat_template.CHARS_PER_TOKEN * 2))
        except (chat_template.RenderError, RuntimeError) as error:
            raise DataError(f"{where}: {error}") from None
    if len(ids) > room:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than the {room} the "
                        f"window leaves beside train.max_completion_length: shorten it, or give "
                        f"a longer --seq-len or a shorter max_completion_length")
    return ids


def prepare_prompts(files: Sequence[str | Path], root: str | Path, tokenizer,
                    tokenizer_name: str, seq_len: int, max_completion: int) -> Path:
    """Prepare prompts into `root/prompts-<hash>/` once (see the module docstring)."""
    paths = [p for p in chat_files(files) if p.suffix == ".jsonl"]
    if not paths:
        raise DataError(f"--objective grpo reads prompts from .jsonl files, not "
                        f"{', '.join(map(str, files))}")
    settings = {"format": FORMAT, "tokenizer": tokenizer_name, "seq_len": seq_len,
                "max_completion_length": max_completion,
                "template": hashlib.sha256(
                    str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:16],
                "files": [sha256(p) for p in paths]}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(root) / f"prompts-{tag}"
    if (out / "meta.json").is_file() and load_meta(out).get("settings") == settings:
        return out
    room = seq_len - max_completion
    if room < 1:
        raise DataError(f"train.max_completion_length {max_completion} leaves no room for a "
                        f"prompt in train.seq_len {seq_len}")
    rows = [(where, row) for path in paths for where, row in read_prompts(path)]
    encoded = [encode(tokenizer, row["prompt"], where, room) for where, row in rows]
    held = [i for i in range(len(rows)) if (i + 1) % VAL_EVERY == 0]
    train = [i for i in range(len(rows)) if (i + 1) % VAL_EVERY]
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    write_text_atomic(out / "rows.json", json.dumps([row for _, row in rows]) + "\n")
    for split, chosen in (("train", train), ("val", held or train)):
        ids = np.zeros((len(chosen), seq_len), np.int32)
        for k, i in enumerate(chosen):
            ids[k, :len(encoded[i])] = encoded[i]
        arrays = {"ids": ids, "length": np.array([len(encoded[i]) for i in chosen], np.int32),
                  "row": np.array(chosen, np.int32)}
        with replacing(out / f"{split}.npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    write_meta(out, {"kind": "prompts", "tokenizer": tokenizer_name,
                     "vocab_size": tokenizer.n_vocab, "settings": settings,
                     "prompts": len(rows), "held_out": len(held),
                     "sources": [str(p.resolve()) for p in paths]})
    return out


def load_rows(data_dir: str | Path, split: str) -> dict[str, np.ndarray]:
    """A prepared split's prompts (`ARRAYS`)."""
    return load_split(data_dir, split, ARRAYS, "prompts")


def load_columns(data_dir: str | Path) -> list[dict[str, Any]]:
    """The prompts' rows as they came (their prompt and every other column)."""
    return json.loads((Path(data_dir) / "rows.json").read_text())
