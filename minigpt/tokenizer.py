"""Tokenizers: tiktoken encodings by name (GPT-2 by default) and the messages when they fail.

Two kinds of name work: tiktoken's own encodings (`gpt2`), and byte-level BPE vocabularies
trained on TinyStories that ship with minigpt as ranks files (`tinystories-4k`, in
`minigpt/vocabularies/`, each beside a JSON file saying how it was made); a path to such a
`.tiktoken` file works too. Either way the runtime tokenizer is a `tiktoken.Encoding`: the
shipped vocabularies are their mergeable ranks, GPT-2's split pattern and `<|endoftext|>` as the
last id. `train_tokenizer` makes a new one from story files (with the optional `rustbpe`
trainer). A ranks file converted from a Hugging Face tokenizer (`minigpt.hf_tokenizer`) has its
own split regex and special tokens, recorded as `pat_str` and `special_tokens` in its JSON.

tiktoken fetches an encoding's BPE files from OpenAI's blob store on first use and keeps them in
a cache directory. Without a network and without that cache it fails deep inside `requests`
with a connection traceback; `load_tokenizer` turns that into one message that says how to
point `TIKTOKEN_CACHE_DIR` at a copy of the files. The document separator of the GPT-2
encoding is `<|endoftext|>`, id 50256 (`enc.eot_token`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from importlib.metadata import version
from pathlib import Path

import tiktoken

from minigpt.files import sha256, write_text_atomic
from minigpt.stories import StoryFile

DEFAULT_TOKENIZER = "gpt2"
SHIPPED_DIR = Path(__file__).resolve().parent / "vocabularies"
EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation, whitespace. A BPE
# merge never crosses these pieces.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(RuntimeError):
    """A tokenizer cannot be loaded; the message says what to do about it."""


def _cache_dir() -> str:
    """Where tiktoken looks for its files, resolved the way tiktoken.load resolves it."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def shipped_tokenizers() -> list[str]:
    """Names of the vocabularies that ship with minigpt (`tinystories-4k`, ...)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.tiktoken"))


def ranks_file(name: str) -> Path | None:
    """The ranks file a tokenizer name means, or None for tiktoken's own encodings."""
    if name in shipped_tokenizers():
        return SHIPPED_DIR / f"{name}.tiktoken"
    if name.endswith(".tiktoken") or os.sep in name:
        return Path(name)
    return None


@functools.cache
def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> tiktoken.Encoding:
    """The tiktoken encoding called `name` (or read from the ranks file `name`), loaded once per
    process.

    Raises TokenizerError for an unknown name (listing the known ones), an unreadable ranks file,
    and when tiktoken's files can be neither read from the cache nor downloaded.
    """
    path = ranks_file(name)
    if path is not None:
        return _from_ranks(name, path)
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise TokenizerError(
            f"unknown tokenizer {name!r}: minigpt ships {', '.join(shipped_tokenizers())}; "
            f"tiktoken {tiktoken.__version__} knows {', '.join(sorted(known))}; or give the "
            f"path of a .tiktoken ranks file")
    try:
        return tiktoken.get_encoding(name)
    except (OSError, ValueError) as error:
        # requests' connection errors are OSErrors; a download that fails tiktoken's sha256
        # check is a ValueError. Both mean the files are not usable from here.
        detail = (str(error).splitlines() or ["no details"])[0][:160]
        raise TokenizerError(
            f"cannot load the {name!r} tokenizer: its BPE files are not in the tiktoken cache "
            f"({_cache_dir()}) and downloading them failed ({type(error).__name__}: {detail}). "
            f"Offline, set TIKTOKEN_CACHE_DIR to a directory holding the files under tiktoken's "
            f"cache names: copy the cache directory of a machine where "
            f"`tiktoken.get_encoding({name!r})` ran, then `export TIKTOKEN_CACHE_DIR=<that "
            f"directory>`."
        ) from error


def read_ranks(path: Path, special_ids: Iterable[int] = ()) -> dict[bytes, int]:
    """A ranks file: one `<base64 token> <rank>` per line (tiktoken's format); with the ids of
    the special tokens, the ranks number 0..n-1 once each."""
    ranks, number = {}, 0
    try:
        lines = path.read_text(encoding="ascii").splitlines()
        for number, line in enumerate(lines, 1):  # noqa: B007 - the error names the line
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (OSError, ValueError, binascii.Error) as error:
        where = f" (line {number})" if number else ""
        raise TokenizerError(f"cannot read the tokenizer ranks file {path}{where}: "
                             f"{type(error).__name__}: {error}") from error
    ids = sorted([*ranks.values(), *special_ids])
    if ids != list(range(len(ids))) or len(ranks) < 256:
        specials = " with its special tokens" if special_ids else ""
        raise TokenizerError(f"{path} is not a BPE ranks file: it must rank every byte and "
                             f"each merge once, 0..n-1{specials} ({len(ranks)} entries)")
    return ranks


def read_provenance(path: Path) -> dict:
    """The JSON beside a ranks file (`<name>.json`), or {} where there is none."""
    beside = path.with_suffix(".json")
    try:
        provenance = json.loads(beside.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot read {beside}, the provenance of {path.name}: "
                             f"{type(error).__name__}: {error}") from error
    if not isinstance(provenance, dict):
        raise TokenizerError(f"{beside}: the provenance of {path.name} must be a JSON object")
    specials = provenance.get("special_tokens", {})
    pat_str = provenance.get("pat_str", PATTERN)
    if not (isinstance(specials, dict) and isinstance(pat_str, str)
            and all(isinstance(i, int) for i in specials.values())):
        raise TokenizerError(f"{beside}: special_tokens must map names to ids and pat_str must "
                             f"be a regex string")
    return provenance


def _from_ranks(name: str, path: Path) -> tiktoken.Encoding:
    """A ranks file as an encoding: the split regex (`pat_str`) and special tokens come from its
    provenance JSON (converted vocabularies have both); else GPT-2's pattern and
    `<|endoftext|>` after the last rank."""
    provenance = read_provenance(path)
    specials = provenance.get("special_tokens")
    ranks = read_ranks(path, specials.values() if specials else ())
    pat_str = provenance.get("pat_str", PATTERN)
    try:
        return tiktoken.Encoding(name=path.stem, pat_str=pat_str, mergeable_ranks=ranks,
                                 special_tokens=specials or {EOT: len(ranks)})
    except ValueError as error:  # a pat_str that tiktoken's regex engine does not compile
        raise TokenizerError(f"{path.with_suffix('.json')}: tiktoken refuses its pat_str: "
                             f"{error}") from error


def keep_vocabulary(name: str, source_run: Path, run: Path) -> str:
    """A run that starts from the weights of `source_run` keeps its own copy of the vocabulary
    file that run holds (an imported tokenizer), so it does not depend on that directory; the
    tokenizer name to use from now on (`name` itself for any other tokenizer)."""
    path = Path(name)
    if path.suffix != ".tiktoken" or path.parent != source_run.absolute():
        return name
    run.mkdir(parents=True, exist_ok=True)
    for file in (path, path.with_suffix(".json")):
        if file.is_file():
            shutil.copy2(file, run / file.name)
    return str((run / path.name).absolute())


def write_ranks(ranks: dict[bytes, int], path: str | Path, provenance: dict) -> None:
    """Write a ranks file and, beside it, `<name>.json` saying how it was made."""
    path = Path(path)
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    write_text_atomic(path, "\n".join(lines) + "\n")
    write_text_atomic(path.with_suffix(".json"), json.dumps(provenance, indent=2) + "\n")


def train_ranks(texts: Iterable[str], vocab_size: int) -> dict[bytes, int]:
    """Train a byte-level BPE of `vocab_size` tokens in all (the last is `<|endoftext|>`) with
    rustbpe, splitting text with GPT-2's pattern; returns the mergeable ranks."""
    try:
        import rustbpe  # an optional extra: only retraining a vocabulary needs it
    except ImportError as error:
        raise TokenizerError("training a tokenizer needs the BPE trainer: "
                             "pip install -e \".[bpe]\" (or pip install rustbpe)") from error
    if vocab_size < 257 + 1:
        raise TokenizerError(f"vocab size {vocab_size} leaves no room for merges: the 256 "
                             f"bytes and <|endoftext|> take 257")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=PATTERN)
    return {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}


def train_tokenizer(files: Sequence[str | Path], vocab_size: int, out: str | Path) -> dict:
    """Train a BPE vocabulary on the stories of `files` (read as `minigpt.stories` reads them);
    write `out` (.tiktoken) and its provenance JSON beside it; return the provenance."""
    story_files = [StoryFile(path) for path in files]

    def stories():
        for story_file in story_files:
            for batch, _ in story_file.batches():
                yield from batch

    ranks = train_ranks(stories(), vocab_size)
    sources = [{"file": f.path.name, "bytes": f.size, "sha256": sha256(f.path)}
               for f in story_files]
    provenance = {"vocab_size": len(ranks) + 1, "special_tokens": {EOT: len(ranks)},
                  "trained_on": sources, "trainer": f"rustbpe {version('rustbpe')}",
                  "pattern": "GPT-2's (minigpt.tokenizer.PATTERN)",
                  "command": "python -m minigpt.data tokenizer --vocab-size "
                             f"{vocab_size} --text {' '.join(f.path.name for f in story_files)}"}
    write_ranks(ranks, out, provenance)
    return provenance
