"""Tokenizers: tiktoken encodings by name (GPT-2 by default) and the messages when they fail.

Two kinds of name work: tiktoken's own encodings (`gpt2`), and byte-level BPE vocabularies
trained on TinyStories that ship with minigpt as ranks files (`tinystories-4k`, in
`minigpt/vocabularies/`, each beside a JSON file saying how it was made); a path to such a
`.tiktoken` file works too. Either way the runtime tokenizer is an `Encoding`: a
`tiktoken.Encoding` that keeps what it was made of at hand (`ranks`, `pattern`,
`special_tokens`), which exporting it needs and tiktoken keeps private. The shipped vocabularies
are their mergeable ranks, GPT-2's split pattern and `<|endoftext|>` as the last id; a ranks file
converted from a Hugging Face tokenizer by earlier versions has its own split regex and special
tokens, recorded as `pat_str` and `special_tokens` in its JSON. Training a new vocabulary is
`minigpt.data.vocabulary`.

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
import tempfile
from collections.abc import Iterable
from pathlib import Path

import tiktoken
from tiktoken_ext import openai_public

from minigpt.files import write_text_atomic

DEFAULT_TOKENIZER = "gpt2"
SHIPPED_DIR = Path(__file__).resolve().parent / "vocabularies"
EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation, whitespace. A BPE
# merge never crosses these pieces.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(RuntimeError):
    """A tokenizer cannot be loaded; the message says what to do about it."""


class Encoding(tiktoken.Encoding):
    """A tiktoken encoding with what it is made of at hand: `ranks` (token bytes -> id, the id
    also the merge priority), the split regex `pattern` and `special_tokens` (name -> id)."""

    def __init__(self, name: str, *, pattern: str, ranks: dict[bytes, int],
                 special_tokens: dict[str, int], explicit_n_vocab: int | None = None):
        super().__init__(name, pat_str=pattern, mergeable_ranks=ranks,
                         special_tokens=special_tokens, explicit_n_vocab=explicit_n_vocab)
        self.ranks, self.pattern, self.special_tokens = ranks, pattern, dict(special_tokens)


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


def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Encoding:
    """The encoding called `name` (or read from the ranks file `name`), loaded once per process.

    Raises TokenizerError for an unknown name (listing the known ones), an unreadable ranks file,
    and when tiktoken's files can be neither read from the cache nor downloaded.
    """
    return _load(name)


@functools.cache
def _load(name: str) -> Encoding:
    path = ranks_file(name)
    if path is not None:
        return _from_ranks(name, path)
    known = openai_public.ENCODING_CONSTRUCTORS
    if name not in known:
        raise TokenizerError(
            f"unknown tokenizer {name!r}: minigpt ships {', '.join(shipped_tokenizers())}; "
            f"tiktoken {tiktoken.__version__} knows {', '.join(sorted(known))}; or give the "
            f"path of a .tiktoken ranks file")
    try:
        # tiktoken's plugin table says what each encoding is made of; reading it ourselves
        # keeps the ranks at hand.
        made_of = known[name]()
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
    return Encoding(made_of["name"], pattern=made_of["pat_str"],
                    ranks=made_of["mergeable_ranks"], special_tokens=made_of["special_tokens"],
                    explicit_n_vocab=made_of.get("explicit_n_vocab"))


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


def _from_ranks(name: str, path: Path) -> Encoding:
    """A ranks file as an encoding: the split regex (`pat_str`) and special tokens come from its
    provenance JSON (converted vocabularies have both); else GPT-2's pattern and
    `<|endoftext|>` after the last rank."""
    provenance = read_provenance(path)
    specials = provenance.get("special_tokens")
    ranks = read_ranks(path, specials.values() if specials else ())
    pat_str = provenance.get("pat_str", PATTERN)
    try:
        return Encoding(path.stem, pattern=pat_str, ranks=ranks,
                        special_tokens=specials or {EOT: len(ranks)})
    except ValueError as error:  # a pat_str that tiktoken's regex engine does not compile
        raise TokenizerError(f"{path.with_suffix('.json')}: tiktoken refuses its pat_str: "
                             f"{error}") from error


load_tokenizer.cache_clear = _load.cache_clear  # forget what was loaded (tests)


def write_ranks(ranks: dict[bytes, int], path: str | Path, provenance: dict) -> None:
    """Write a ranks file and, beside it, `<name>.json` saying how it was made."""
    path = Path(path)
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    write_text_atomic(path, "\n".join(lines) + "\n")
    write_text_atomic(path.with_suffix(".json"), json.dumps(provenance, indent=2) + "\n")
