"""The zoo's own tokenizers as Hugging Face tokenizer files, for export.

A tiktoken encoding (`gpt2`, `tinystories-4k`) becomes a `tokenizers.Tokenizer`, built with that
library's own classes and saved by it as `tokenizer.json`, that encodes as the encoding does
(so what is written is validated as it is written): the merges are recovered from the
ranks (for each token, BPE run on its bytes with only lower ranks stops at the two pieces whose
merge makes it), the split regex becomes a `Split` pre-tokenizer before a ByteLevel one without
its own regex, and `ignore_merges` mirrors tiktoken's use of a whole piece that is itself a
token. `write_hf_tokenizer` adds the files `transformers.AutoTokenizer` reads. (An imported
checkpoint's own tokenizer files go back out as they came in: `minigpt.hub.tokenizer_files`.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from minigpt.files import replacing, write_text_atomic
from minigpt.tokenizer import EOT, Encoding, TokenizerError


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes (controls, space, soft hyphen...) for chr(256), chr(257)... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def token_str(token: bytes) -> str:
    """Token bytes as a byte-level vocabulary string."""
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


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


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges list of tiktoken ranks, in rank order: for each token longer than a byte, the
    two pieces that BPE with only lower ranks leaves of its bytes."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        pieces = bpe([bytes([b]) for b in token], functools.partial(_rank_below, ranks, rank))
        if len(pieces) != 2:
            raise TokenizerError(f"token {token!r} (rank {rank}) is not a merge of two "
                                 f"lower-ranked tokens; it has no BPE merges list")
        merges.append((pieces[0], pieces[1]))
    return merges


def _rank_below(ranks: dict[bytes, int], limit: int, left: bytes, right: bytes) -> int | None:
    rank = ranks.get(left + right, limit)
    return rank if rank < limit else None


def hf_tokenizer(enc: Encoding) -> Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer`, built by that library, that encodes and decodes as
    `enc` does (with every special token allowed): built through its own classes, so what is
    written is what the library accepts."""
    ranks, specials = enc.ranks, enc.special_tokens
    vocab = {token_str(token): rank for token, rank in ranks.items()}
    clash = [s for s in specials if s in vocab]
    if clash:
        raise TokenizerError(f"special token {clash[0]!r} of {enc.name} is also an ordinary "
                             f"token's byte-level spelling; tokenizer.json cannot hold both")
    vocab.update(specials)  # so that Hugging Face keeps their ids
    merges = [(token_str(a), token_str(b)) for a, b in recover_merges(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True,
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                  for s, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    moved = {s: tokenizer.token_to_id(s) for s, i in specials.items()
             if tokenizer.token_to_id(s) != i}
    if moved:
        raise TokenizerError(f"the special tokens of {enc.name} would change ids in "
                             f"tokenizer.json: {moved}")
    return tokenizer


def tokenizer_json_from_encoding(enc: Encoding) -> dict:
    """`hf_tokenizer(enc)` as the JSON object of a `tokenizer.json`."""
    return json.loads(hf_tokenizer(enc).to_str())


def write_hf_tokenizer(enc: Encoding, directory: str | Path, *, model_max_length: int,
                       eos_token: str | None = None, bos_token: str | None = None) -> Path:
    """Write the Hugging Face tokenizer files of `enc` into `directory`: tokenizer.json,
    tokenizer_config.json, special_tokens_map.json, and GPT-2's vocab.json and merges.txt.
    eos and bos default to `<|endoftext|>` where the encoding has it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    default = EOT if EOT in enc.special_tokens else None
    roles = {"bos_token": bos_token or default, "eos_token": eos_token or default}
    for role, token in roles.items():
        if token is not None and token not in enc.special_tokens:
            raise TokenizerError(f"{role} {token!r} is not a special token of {enc.name} "
                                 f"({', '.join(enc.special_tokens) or 'it has none'})")
    roles = {role: token for role, token in roles.items() if token is not None}
    tokenizer = hf_tokenizer(enc)
    # PreTrainedTokenizerFast builds everything from tokenizer.json; GPT2Tokenizer would
    # replace the split regex with GPT-2's own. No clean-up: it would change decoded spaces.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **roles}
    with replacing(directory / "tokenizer.json") as tmp:
        tokenizer.save(str(tmp), pretty=True)
    for file_name, content in {"tokenizer_config.json": config,
                               "special_tokens_map.json": roles}.items():
        write_text_atomic(directory / file_name,
                          json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    tokenizer.model.save(str(directory))  # GPT-2's vocab.json and merges.txt, as BPE writes them
    return directory
