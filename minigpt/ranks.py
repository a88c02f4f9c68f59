"""Ranks files, tiktoken's vocabulary format (one `<base64 token> <rank>` per line): read and
checked, with the JSON beside each saying how it was made, and written. The shipped
vocabularies (`minigpt/vocabularies/`) and trained ones are such files; `minigpt.tokenizer`
loads them as encodings."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from pathlib import Path

from minigpt.errors import TokenizerError
from minigpt.files import read_json_object, write_text_atomic


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
    provenance = read_json_object(beside, TokenizerError)
    specials = provenance.get("special_tokens", {})
    pat_str = provenance.get("pat_str", "")
    if not (isinstance(specials, dict) and isinstance(pat_str, str)
            and all(isinstance(i, int) for i in specials.values())):
        raise TokenizerError(f"{beside}: special_tokens must map names to ids and pat_str must "
                             f"be a regex string")
    return provenance


def write_ranks(ranks: dict[bytes, int], path: str | Path, provenance: dict) -> None:
    """Write a ranks file and, beside it, `<name>.json` saying how it was made."""
    path = Path(path)
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    write_text_atomic(path, "\n".join(lines) + "\n")
    write_text_atomic(path.with_suffix(".json"), json.dumps(provenance, indent=2) + "\n")
