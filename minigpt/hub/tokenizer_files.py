"""Hugging Face `tokenizer.json` (byte-level BPE) to tiktoken and back.

minigpt's runtime tokenizer is always a `tiktoken.Encoding`: mergeable ranks (token bytes ->
id, where the id is also the merge priority), a split regex (`pat_str`) and special tokens.
A byte-level BPE `tokenizer.json` (GPT-2, SmolLM2, Llama 3) holds the same thing in another
shape, and this module converts between the two:

- **Import** (`ranks_from_tokenizer_json`). Vocabulary strings are GPT-2's byte-level alphabet
  (each byte drawn as one printable character, a space as `Ġ`); the inverse of that map gives the
  token bytes. The vocabulary id is kept as the tiktoken rank, which is only right when the ids
  follow the merges list (each merge makes a token with a higher id than the merges before it
  and than its own two parts, as trained files are): anything else is refused, as are tokens
  that no merge makes. tiktoken merges any adjacent pair whose concatenation is a token,
  Hugging Face only the listed pairs, so every token is also checked to come out whole under
  both rules. Added tokens become special tokens with their ids unchanged: Hugging Face cuts them
  out of the text before splitting it, as tiktoken does with allowed specials. The pre-tokenizer
  becomes one regex: ByteLevel's own is GPT-2's (`minigpt.tokenizer.PATTERN`); a `Split`
  regex (Llama 3) is used as it is, with an alternative that keeps the text between its matches,
  which Hugging Face keeps and tiktoken would drop; `Digits` before ByteLevel (SmolLM2) makes
  GPT-2's pattern emit digits alone and end whitespace before a digit, as the digit split does.
- **Export** is `minigpt.hub.tokenizer_export`, which shares the alphabet and `bpe` above.

What tiktoken cannot express is refused with one line that names it: SentencePiece tokenizers
(Llama 2, TinyLlama), WordPiece and Unigram models, normalizers, dropout, subword prefixes and
suffixes, `add_prefix_space`, added tokens that strip spaces or that are ordinary vocabulary
tokens without being special. A post-processor (a BOS token added by Llama 3's) is not part of
the encoding: callers add such tokens themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

from minigpt.tokenizer import PATTERN, Encoding, TokenizerError, write_ranks

BYTE_LEVEL_HINT = ("minigpt's runtime tokenizer is tiktoken, which needs byte-level BPE "
                   "(a ByteLevel pre-tokenizer, as GPT-2, SmolLM2 and Llama 3 have)")
# tiktoken's gpt2 pattern and minigpt's PATTERN split alike; a digit split changes two
# alternatives of it (see _digits_pattern).
_GPT2_DIGITS = r" ?\p{N}+"
_GPT2_TRAILING_SPACE = r"\s+(?!\S)"


@dataclasses.dataclass(frozen=True)
class HFVocab:
    """A byte-level BPE vocabulary in tiktoken's terms."""

    name: str
    ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    pat_str: str

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + len(self.special_tokens)

    def encoding(self) -> Encoding:
        try:
            return Encoding(self.name, pattern=self.pat_str, ranks=self.ranks,
                            special_tokens=self.special_tokens)
        except ValueError as error:  # the regex does not compile in tiktoken's engine
            raise TokenizerError(f"{self.name}: tiktoken refuses the split pattern "
                                 f"{self.pat_str!r}: {error}") from error


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes (controls, space, soft hyphen...) for chr(256), chr(257)... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    return {char: b for b, char in byte_to_unicode().items()}


def token_str(token: bytes) -> str:
    """Token bytes as a byte-level vocabulary string."""
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def token_bytes(token: str) -> bytes | None:
    """A byte-level vocabulary string as bytes; None if it is not one."""
    table = unicode_to_byte()
    if not all(char in table for char in token):
        return None
    return bytes(table[char] for char in token)


def bpe(parts: list, priority: Callable) -> list:
    """Merge adjacent parts, lowest priority first (leftmost on ties), until no pair has one."""
    parts = list(parts)
    found = [priority(left, right) for left, right in zip(parts, parts[1:])]  # pair i: i, i+1
    while candidates := [(p, i) for i, p in enumerate(found) if p is not None]:
        _, i = min(candidates)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del found[i]
        if i > 0:
            found[i - 1] = priority(parts[i - 1], parts[i])
        if i < len(found):
            found[i] = priority(parts[i], parts[i + 1])
    return parts


# Import ------------------------------------------------------------------------------------


def ranks_from_tokenizer_json(path_or_dict: str | Path | dict, *,
                              name: str | None = None) -> HFVocab:
    """The tiktoken ranks, specials and split regex of a byte-level BPE `tokenizer.json` (a file,
    a directory holding one, or its parsed dict). Raises TokenizerError naming what it refuses."""
    data, where = _read_tokenizer_json(path_or_dict, name)
    name = name or (where if isinstance(path_or_dict, dict) else _name_of(Path(path_or_dict)))
    _refuse_sentencepiece(data, where)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"{where}: model.type is {model.get('type')!r}, not 'BPE'; "
                             f"{BYTE_LEVEL_HINT}")
    _refuse_model_fields(model, where)
    if data.get("normalizer") not in (None, {"type": "Sequence", "normalizers": []}):
        raise TokenizerError(f"{where}: normalizer {_describe(data['normalizer'])} changes the "
                             f"text before it is split; tiktoken has no normalizer")
    pat_str = pattern_of(data.get("pre_tokenizer"), where)
    if (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise TokenizerError(f"{where}: decoder is {_describe(data.get('decoder'))}, not "
                             f"ByteLevel; {BYTE_LEVEL_HINT}")
    vocab, merges = model.get("vocab") or {}, [_pair(m) for m in model.get("merges") or []]
    specials = _special_tokens(data.get("added_tokens") or [], vocab, where)
    ordinary = {token: i for token, i in vocab.items() if token not in specials}
    ranks = _mergeable_ranks(ordinary, model, where)
    _check_ids(ranks, specials, where)
    _check_merge_order(ordinary, merges, where)
    _check_tokens_come_out_whole(ordinary, merges, where)
    return HFVocab(name=name, ranks=ranks, special_tokens=specials, pat_str=pat_str)


def load_hf_encoding(path: str | Path) -> Encoding:
    """The tiktoken encoding of a byte-level BPE `tokenizer.json` (or a directory holding one)."""
    return ranks_from_tokenizer_json(path).encoding()


def save_as_tiktoken(vocab: HFVocab, path: str | Path, source: dict) -> dict:
    """Write `path` (.tiktoken ranks) and its provenance JSON beside it, with the split regex
    and special tokens that `minigpt.tokenizer.load_tokenizer` reads back; returns that JSON."""
    provenance = {"vocab_size": vocab.vocab_size, "special_tokens": vocab.special_tokens,
                  "pat_str": vocab.pat_str, "source": source,
                  "converted_by": "minigpt.hf_tokenizer.save_as_tiktoken"}
    write_ranks(vocab.ranks, path, provenance)
    return provenance


def _read_tokenizer_json(path_or_dict: str | Path | dict,
                         name: str | None) -> tuple[dict, str]:
    """The parsed file and what messages call it (its path; for a dict, the name given)."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, name or "tokenizer"
    path = Path(path_or_dict)
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text(encoding="utf-8")), str(path)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot read {path}: {type(error).__name__}: {error}") from error


def _name_of(path: Path) -> str:
    return path.name if path.is_dir() else (path.parent.name or path.stem)


def _components(node) -> list[dict]:
    """A normalizer / pre-tokenizer / decoder and, for a Sequence, everything in it."""
    if not isinstance(node, dict):
        return []
    inner = [c for key in ("normalizers", "pretokenizers", "decoders")
             for c in node.get(key) or []]
    return [node, *[c for child in inner for c in _components(child)]]


def _describe(node) -> str:
    if not isinstance(node, dict):
        return "null"
    parts = _components(node)[1:]
    if node.get("type") == "Sequence":
        return f"Sequence[{', '.join(c.get('type', '?') for c in parts)}]"
    return str(node.get("type"))


def _refuse_sentencepiece(data: dict, where: str) -> None:
    signs = [f"model {t}" for t in [(data.get("model") or {}).get("type")] if t == "Unigram"]
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        for c in _components(data.get(part)):
            # Llama 2's has no Metaspace: its normalizer writes spaces as '▁' itself.
            marker = c.get("type") != "Sequence" and "▁" in json.dumps(c, ensure_ascii=False)
            if c.get("type") in ("Metaspace", "ByteFallback") or marker:
                signs.append(f"{part} {c.get('type')}")
    if signs:
        raise TokenizerError(f"{where} is a SentencePiece (Metaspace) tokenizer "
                             f"({', '.join(dict.fromkeys(signs))}); {BYTE_LEVEL_HINT}")


def _refuse_model_fields(model: dict, where: str) -> None:
    for field in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(field):
            raise TokenizerError(f"{where}: model.{field} is {model[field]!r}; tiktoken's BPE "
                                 f"has no {field.replace('_', ' ')}")


def pattern_of(pre_tokenizer: dict | None, where: str = "tokenizer.json") -> str:
    """The tiktoken split regex that reproduces a byte-level pre-tokenizer."""
    steps = _components(pre_tokenizer)
    steps = steps[1:] if steps and steps[0].get("type") == "Sequence" else steps
    kinds = [s.get("type") for s in steps]
    if not kinds or kinds[-1] != "ByteLevel":
        raise TokenizerError(f"{where}: pre_tokenizer is {_describe(pre_tokenizer)}, which does "
                             f"not end with ByteLevel; {BYTE_LEVEL_HINT}")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise TokenizerError(f"{where}: pre_tokenizer ByteLevel.add_prefix_space is true; "
                             f"tiktoken adds no space, so convert a tokenizer without it")
    regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and regex:
        return PATTERN
    if kinds == ["Digits", "ByteLevel"] and regex:
        return _digits_pattern(PATTERN, steps[0].get("individual_digits", False))
    if kinds == ["Split", "ByteLevel"] and not regex:
        return _split_pattern(steps[0], where)
    raise TokenizerError(f"{where}: pre_tokenizer {_describe(pre_tokenizer)} (ByteLevel "
                         f"use_regex={regex}) has no tiktoken regex here: minigpt converts "
                         f"ByteLevel, Digits then ByteLevel, or Split then ByteLevel without "
                         f"its regex")


def _digits_pattern(pattern: str, individual: bool) -> str:
    """GPT-2's pattern after a Digits split: digits come alone (or as runs) without the space
    before them, and whitespace before a digit ends its piece as it would at the end of text."""
    assert _GPT2_DIGITS in pattern and _GPT2_TRAILING_SPACE in pattern
    digits = r"\p{N}" if individual else r"\p{N}+"
    return (pattern.replace(_GPT2_DIGITS, digits)
            .replace(_GPT2_TRAILING_SPACE, r"\s+(?![^\s\p{N}])"))


def _split_pattern(split: dict, where: str) -> str:
    regex = (split.get("pattern") or {}).get("Regex")
    if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise TokenizerError(f"{where}: pre_tokenizer Split must have a Regex pattern, behavior "
                             f"'Isolated' and invert false for tiktoken (found "
                             f"{split.get('pattern')}, {split.get('behavior')!r}, invert="
                             f"{split.get('invert')})")
    # tiktoken drops text its regex does not match; an Isolated split keeps it as a piece.
    return f"(?:{regex})|(?:(?!(?:{regex}))[\\s\\S])+"


def _pair(merge: str | list) -> tuple[str, str]:
    """A merge as written by tokenizers >= 0.20 (a pair) or before (one string, "a b")."""
    left, right = merge.split(" ") if isinstance(merge, str) else merge
    return left, right


def _special_tokens(added: list[dict], vocab: dict[str, int], where: str) -> dict[str, int]:
    """Added tokens, as tiktoken special tokens with their ids. Hugging Face matches every
    added token in the raw text before splitting it, which tiktoken does for specials only, so
    one that is not special must not be an ordinary vocabulary token as well."""
    specials = {}
    for token in added:
        content, token_id = token["content"], token["id"]
        if vocab.get(content, token_id) != token_id:
            raise TokenizerError(f"{where}: added token {content!r} has id {token_id} but "
                                 f"{vocab[content]} in the vocabulary")
        if not token.get("special") and content in vocab:
            raise TokenizerError(f"{where}: added token {content!r} is not special but is a "
                                 f"vocabulary token; Hugging Face cuts it out of any text, "
                                 f"which tiktoken does only for special tokens")
        flags = [f for f in ("lstrip", "rstrip", "single_word") if token.get(f)]
        if flags:
            raise TokenizerError(f"{where}: added token {content!r} has {flags[0]} true; "
                                 f"tiktoken matches special tokens exactly as written")
        specials[content] = token_id
    return specials


def _mergeable_ranks(ordinary: dict[str, int], model: dict, where: str) -> dict[bytes, int]:
    ranks = {}
    for token, token_id in ordinary.items():
        as_bytes = token_bytes(token)
        if as_bytes is None:
            raise TokenizerError(f"{where}: vocabulary token {token!r} is not in GPT-2's "
                                 f"byte-level alphabet; {BYTE_LEVEL_HINT}")
        ranks[as_bytes] = token_id
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        fallback = "model.byte_fallback is true and " if model.get("byte_fallback") else ""
        raise TokenizerError(f"{where}: {fallback}the vocabulary lacks {len(missing)} of the 256 "
                             f"single bytes (first {missing[0]:#04x}); tiktoken needs them all")
    return ranks


def _check_ids(ranks: dict[bytes, int], specials: dict[str, int], where: str) -> None:
    ids = sorted([*ranks.values(), *specials.values()])
    if ids != list(range(len(ids))):
        raise TokenizerError(f"{where}: the ids of the vocabulary and added tokens are not "
                             f"0..{len(ids) - 1} once each (a gap or a repeat)")


def _check_merge_order(ordinary: dict[str, int], merges: list[tuple[str, str]],
                       where: str) -> None:
    """The vocabulary ids must be a BPE rank order: ascending along the merges, each above its
    parts, each token made once; every token longer than a byte is made by some merge."""
    last, made = -1, set()
    for number, (left, right) in enumerate(merges):
        token = left + right
        ids = [ordinary.get(t) for t in (left, right, token)]
        if None in ids:
            raise TokenizerError(f"{where}: merge {number} ({left!r} {right!r}) uses or makes a "
                                 f"token that is not an ordinary vocabulary token")
        if token in made:
            raise TokenizerError(f"{where}: merge {number} makes {token!r} a second time; "
                                 f"tiktoken ranks each token once")
        if not max(ids[0], ids[1], last) < ids[2]:
            raise TokenizerError(f"{where}: the vocabulary ids are not in merge order (merge "
                                 f"{number} {left!r} {right!r} makes id {ids[2]}); tiktoken "
                                 f"needs ids that are merge ranks")
        last = ids[2]
        made.add(token)
    unmade = [t for t in ordinary if len(t) > 1 and t not in made]
    if unmade:
        raise TokenizerError(f"{where}: {len(unmade)} vocabulary tokens are made by no merge "
                             f"(first {unmade[0]!r}); tiktoken would still produce them")


def _check_tokens_come_out_whole(ordinary: dict[str, int], merges: list[tuple[str, str]],
                                 where: str) -> None:
    """BPE by the merges list (Hugging Face) and by the ranks of concatenations (tiktoken)
    must both turn each token's bytes into that one token."""
    priority = {pair: number for number, pair in enumerate(merges)}

    def hf_rule(left: str, right: str) -> int | None:
        return priority.get((left, right))

    def tiktoken_rule(left: str, right: str) -> int | None:
        return ordinary.get(left + right)

    for left, right in merges:
        token = left + right
        for rule, who in ((hf_rule, "Hugging Face"), (tiktoken_rule, "tiktoken")):
            if bpe(list(token), rule) != [token]:
                raise TokenizerError(f"{where}: {who}'s BPE does not turn {token!r} into one "
                                     f"token; these merges have no tiktoken equivalent")
