"""Training a new BPE vocabulary on story files: `python -m minigpt.data tokenizer`.

A vocabulary is tiktoken's mergeable ranks, trained with the optional `rustbpe` trainer
(`pip install -e ".[bpe]"`) on stories read as `minigpt.data.stories` reads them, split with
GPT-2's pattern, `<|endoftext|>` as the last id. It is written as a `.tiktoken` ranks file with a
JSON file beside it saying what it was trained on and how; `minigpt.tokenizer.load_tokenizer`
reads it back. The shipped `tinystories-4k` was made this way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib.metadata import version
from pathlib import Path

from minigpt.data.stories import StoryFile
from minigpt.files import sha256
from minigpt.ranks import write_ranks
from minigpt.tokenizer import EOT, PATTERN, TokenizerError


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
    """Train a BPE vocabulary on the stories of `files` (read as `minigpt.data.stories` reads
    them); write `out` (.tiktoken) and its provenance JSON beside it; return the provenance."""
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
