"""Conversations for chat fine-tuning: read, rendered, masked and packed into windows.

`python -m minigpt.train --init-from RUN --data chats.jsonl` trains on conversations, one JSON
object per line, `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."},
...]}` (the format of TRL and of most chat datasets on the Hub; also a folder of such files).
Each conversation is rendered with the run's own chat template (`minigpt.chat_template`: the
sandbox `--chat` renders in) and tokenized with its own tokenizer, exactly as transformers'
`apply_chat_template(..., tokenize=True)` does. A folder may hold `.jsonl` files and `.json`
files, each of the latter one conversation (`{"messages": [...]}`) or a list of them. The loss
is on the assistant's tokens alone:
each reply and the end-of-turn tokens that close it. A template that marks replies with
`{% generation %}` says where they are; for one that does not, each reply is what rendering the
conversation up to it adds to rendering the conversation before it with the generation prompt
(the way TRL finds replies): the tokens from the end of the one to the end of the other.

Conversations are packed into windows whole, each its own document (`minigpt.data.documents`:
attention within it, positions from its start), the rest of a window padding (document id 0,
never attended to or trained); a conversation longer than the window is refused with its line
number, or cut at the window with `--set data.truncate=true`. A zoo model, whose vocabulary has
no template, gets ChatML with its end token closing each turn (`default_template`).

Every problem with the file (a line that is not JSON, a message without a role or content, an
unknown role, no assistant turn, a template that fails) is one `DataError` naming the file and
line. The prepared windows are kept in `<data_root>/chats-<hash>/` (`train.npz`, `val.npz` and
meta.json, written last), named for the files, the tokenizer, the template and the window.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minigpt import chat_template
from minigpt.data.token_files import DataError, load_meta, write_meta
from minigpt.files import replacing, sha256

ROLES = ("system", "user", "assistant")
ARRAYS = ("inputs", "targets", "segment_ids", "loss_mask")
FORMAT = "minigpt-chats-1"
# Every VAL_EVERY-th conversation is held out for evaluation (with at least VAL_EVERY of them).
VAL_EVERY = 10

# The files that hold conversations: one per line (.jsonl), or one (or a list) per file (.json).
SUFFIXES = (".jsonl", ".json")


def _names_chats(item: str) -> bool:
    """A file of conversations, or a folder of them (not a prepared data folder, whose
    meta.json is no conversation)."""
    path = Path(item)
    if path.is_dir():
        return not (path / "meta.json").exists() and any(
            p.suffix in SUFFIXES for p in path.iterdir())
    return path.suffix in SUFFIXES


def is_chats(data: Sequence[str]) -> bool:
    """Whether training data names conversations: .jsonl or .json files, or folders of them.
    Conversations and plain text in one run are refused (DataError): the chats' JSON would be
    trained as if it were text."""
    chats = [d for d in data if _names_chats(d)]
    if chats and len(chats) < len(data):
        text = [d for d in data if d not in chats]
        raise DataError(f"--data mixes conversations ({', '.join(chats[:2])}) with text "
                        f"({', '.join(text[:2])}): a run trains on one kind; train on the "
                        f"text first, then --init-from that run on the conversations")
    return bool(chats)


def chat_files(data: Sequence[str]) -> list[Path]:
    """The files `data` names (a folder: its .jsonl and .json files, in name order)."""
    files = []
    for item in map(Path, data):
        found = sorted(p for p in item.iterdir() if p.suffix in SUFFIXES) if item.is_dir() \
            else [item]
        missing = [str(f) for f in found if not f.is_file()]
        if missing:
            raise DataError(f"no such file: {', '.join(missing)}")
        files += found
    return files


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation as the model reads it: `ids` (begin token included where the template
    renders one) and `mask` (1 where the token at that position is trained), and where it is."""

    ids: list[int]
    mask: list[int]
    where: str


def records(path: Path) -> list[tuple[str, Any]]:
    """(where, the JSON value) of each record a file holds (a conversation; DPO's pairs and
    GRPO's prompts read them too): each line of a .jsonl file, or a .json file's one object
    (or each item of its list)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start})") from None
    if path.suffix == ".json":
        record = _parsed(text, str(path))
        if isinstance(record, list):
            return [(f"{path}, item {i}", r) for i, r in enumerate(record)]
        return [(str(path), record)]
    return [(f"{path}, line {number}", _parsed(line, f"{path}, line {number}"))
            for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _parsed(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not JSON ({error.msg})") from None
    except RecursionError:  # a line of thousands of nested brackets
        raise DataError(f"{where}: JSON nested too deeply to be a conversation") from None


def read_conversations(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """Each conversation's messages, checked, as (where: "FILE, line N", messages)."""
    conversations = []
    for where, record in records(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, '
                            f'...]}}')
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{where}: message {i} needs a role and a content (text)")
            if message["role"] not in ROLES:
                raise DataError(f"{where}: message {i} has role {message['role']!r}; roles are "
                                f"{', '.join(ROLES)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant turn, so nothing to train on")
        conversations.append((where, [{"role": m["role"], "content": m["content"]}
                                      for m in messages]))
    if not conversations:
        raise DataError(f"{path} holds no conversation")
    return conversations


def encode(tokenizer, messages: list[dict[str, str]], where: str, max_chars: int
           ) -> Conversation:
    """A conversation's ids and loss mask (see the module docstring)."""
    try:
        whole = tokenizer.render_chat_with_spans(messages, add_generation_prompt=False,
                                                 max_chars=max_chars)
        ids = tokenizer.encode_ordinary(whole.text)
        mask = np.zeros(len(ids), np.int32)
        if whole.spans:
            for start, end in _token_spans(tokenizer, whole.text, whole.spans):
                mask[start:end] = 1
        else:
            for turn in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
                before = tokenizer.encode_ordinary(tokenizer.render_chat(
                    messages[:turn], add_generation_prompt=True, max_chars=max_chars)) \
                    if turn else []
                through = tokenizer.encode_ordinary(tokenizer.render_chat(
                    messages[:turn + 1], add_generation_prompt=False, max_chars=max_chars))
                if ids[:len(through)] != through or through[:len(before)] != before:
                    raise DataError(f"{where}: the chat template does not render the "
                                    f"conversation as a sequence of its turns, so the replies "
                                    f"cannot be found; mark them with {{% generation %}}")
                mask[len(before):len(through)] = 1
    except (chat_template.RenderError, RuntimeError) as error:  # TokenizerError: a template
        raise DataError(f"{where}: {error}") from None
    return Conversation(list(ids), mask.tolist(), where)


def _token_spans(tokenizer, text: str, spans) -> list[tuple[int, int]]:
    """Character spans of `text` as token index spans [start, end), as transformers maps the
    `{% generation %}` spans of `return_assistant_tokens_mask` (first token to last token)."""
    offsets = _offsets(tokenizer, text)
    out = []
    for begin, end in spans:
        covered = [i for i, (a, b) in enumerate(offsets) if a < end and b > begin]
        if covered:
            out.append((covered[0], covered[-1] + 1))
    return out


def _offsets(tokenizer, text: str) -> list[tuple[int, int]]:
    """Each token's [start, end) characters in `text`, as its tokenizer encodes it."""
    inner = getattr(tokenizer, "inner", None)  # a Hugging Face tokenizer's own
    if inner is not None:
        return list(inner.encode(text, add_special_tokens=False).offsets)
    ids = tokenizer.encode_ordinary(text)
    starts = tokenizer.decode_with_offsets(ids)[1]
    return list(zip(starts, [*starts[1:], len(text)]))


def pack(conversations: list[Conversation], seq_len: int, *, truncate: bool
         ) -> dict[str, np.ndarray]:
    """Windows [N, seq_len] of whole conversations, in order: "inputs", "targets",
    "segment_ids" (one id per conversation in a window, 0 padding) and "loss_mask" (of the
    targets)."""
    rows: list[list[tuple[int, Conversation]]] = [[]]
    used = 0
    for conversation in conversations:
        pairs = len(conversation.ids) - 1  # (input, target) pairs it gives
        if pairs > seq_len:
            if not truncate:
                raise DataError(f"{conversation.where}: {len(conversation.ids):,} tokens, longer "
                                f"than a window of {seq_len + 1:,}: shorten it, give a longer "
                                f"--seq-len, or --set data.truncate=true to cut it")
            conversation = dataclasses.replace(conversation, ids=conversation.ids[:seq_len + 1],
                                               mask=conversation.mask[:seq_len + 1])
            pairs = seq_len
        if pairs < 1:
            continue
        if used + pairs > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((pairs, conversation))
        used += pairs
    out = {name: np.zeros((len(rows), seq_len), np.int32) for name in ARRAYS}
    for r, row in enumerate(rows):
        at = 0
        for segment, (pairs, conversation) in enumerate(row, 1):
            ids, mask = conversation.ids, conversation.mask
            span = slice(at, at + pairs)
            out["inputs"][r, span], out["targets"][r, span] = ids[:-1][:pairs], ids[1:][:pairs]
            out["segment_ids"][r, span], out["loss_mask"][r, span] = segment, mask[1:][:pairs]
            at += pairs
    return out


def prepare_chats(files: Sequence[str | Path], root: str | Path, tokenizer, tokenizer_name: str,
                  seq_len: int, *, truncate: bool = False) -> Path:
    """Prepare conversations for training into `root/chats-<hash>/` once (see the module
    docstring); `tokenizer` renders and tokenizes (`with_template`). Returns the directory."""
    paths = chat_files(files)
    settings = {"format": FORMAT, "tokenizer": tokenizer_name, "seq_len": seq_len,
                "truncate": truncate, "template": hashlib.sha256(
                    str(tokenizer.chat_template).encode()).hexdigest()[:16],
                "files": [sha256(p) for p in paths]}
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(root) / f"chats-{tag}"
    if (out / "meta.json").is_file() and load_meta(out).get("settings") == settings:
        return out
    max_chars = (seq_len + 1) * chat_template.CHARS_PER_TOKEN
    conversations = [encode(tokenizer, messages, where, max_chars)
                     for path in paths for where, messages in read_conversations(path)]
    held = [c for i, c in enumerate(conversations) if (i + 1) % VAL_EVERY == 0]
    train = [c for i, c in enumerate(conversations) if (i + 1) % VAL_EVERY]
    splits = {"train": pack(train, seq_len, truncate=truncate),
              # Too few conversations to hold any out: evaluation reads the training ones.
              "val": pack(held or train, seq_len, truncate=truncate)}
    if not splits["train"]["loss_mask"].any():  # a run would train on nothing, loss 0
        raise DataError(f"the conversations of {', '.join(map(str, paths[:2]))} leave no reply "
                        f"token to train on (the chat template renders none, or data.truncate "
                        f"cut every reply): check what trains with python -m minigpt.data sft, "
                        f"or give a longer --seq-len")
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for split, arrays in splits.items():
        with replacing(out / f"{split}.npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    write_meta(out, {"kind": "chats", "tokenizer": tokenizer_name,
                     "vocab_size": tokenizer.n_vocab, "settings": settings,
                     "conversations": len(conversations), "held_out": len(held),
                     "train_rows": len(splits["train"]["inputs"]),
                     "val_rows": len(splits["val"]["inputs"]),
                     "trained_tokens": int(splits["train"]["loss_mask"].sum()),
                     "sources": [str(p.resolve()) for p in paths]})
    return out


def load_rows(data_dir: str | Path, split: str) -> dict[str, Any]:
    """A prepared split's windows (`pack`'s arrays)."""
    return load_split(data_dir, split, ARRAYS, "conversations")


def load_split(data_dir: str | Path, split: str, names: Sequence[str], what: str
               ) -> dict[str, np.ndarray]:
    """The arrays `names` of a prepared split's `<split>.npz` (conversations, DPO's pairs,
    GRPO's prompts: `what`); DataError saying to prepare them anew where it cannot be read."""
    path = Path(data_dir) / f"{split}.npz"
    try:
        with np.load(path) as arrays:
            return {name: arrays[name] for name in names}
    except (OSError, KeyError, ValueError) as error:
        raise DataError(f"{path} cannot be read ({error}): delete {data_dir} and train again "
                        f"to prepare the {what} anew") from None
