"""Text to token ids as the harness's reference backend (its `hf` model) makes them.

lm-evaluation-harness gives a model text; how text becomes ids decides the scores as much as
the weights do, so a run's tokenizer is used here with the rules of the harness's `hf` model on
the same files, quirks included:

- a string is encoded with the tokenizer's own added tokens (a Llama's begin token; GPT-2 adds
  none), unless it already starts with the text of the prefix token (a rendered chat template
  that writes its begin token itself); special tokens' names in the text are those tokens;
- the prefix token, which an empty context or a rolling window is conditioned on, is the begin
  token transformers names (tokenizer_config.json's `bos_token`), else the end token
  (`eos_token`): `<|endoftext|>` for GPT-2, for zoo vocabularies too (documents start after it
  in their training stream);
- a generated continuation is decoded without special tokens and cut at the first of its stop
  strings (the request's `until` and the end token's text); where it stops is the decoding
  engine's text stream's to find (`minigpt.decoding.text`).
"""

from __future__ import annotations

from collections.abc import Sequence

from minigpt.eval.loading import EvalError
from minigpt.files import read_json_object
from minigpt.tokenizer import HFTokenizer


class HarnessTokenizer:
    """A run's tokenizer (`minigpt.tokenizer`: a tiktoken `Encoding` or an `HFTokenizer`,
    possibly given a chat template) with the harness's rules."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        base = getattr(tokenizer, "tokenizer", tokenizer)  # under a recorded chat template
        self.hf = base if isinstance(base, HFTokenizer) else None
        bos, eos = _named(self.hf) if self.hf is not None else (None, None)
        self.bos = bos if bos is not None else tokenizer.bos_token
        self.eos = eos if eos is not None else tokenizer.eot_token
        if self.eos is None:
            raise EvalError(f"the tokenizer {getattr(tokenizer, 'name', '')} names no end token: "
                            f"the harness conditions empty contexts on one")
        self.prefix = self.bos if self.bos is not None else self.eos
        # Generation stops at the end tokens the run's files name (generation_config.json's,
        # as transformers' generate does) and at the harness's end token.
        self.stop_ids = tuple(dict.fromkeys((*tokenizer.stop_tokens, self.eos)))

    @property
    def name(self) -> str:
        return str(getattr(self.hf, "folder", None) or getattr(self.tokenizer, "name", ""))

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        """The ids of `text`; `special` None: with the tokenizer's own added tokens unless the
        text already starts with the prefix token's text (True / False: with or without)."""
        if special is None:
            special = not text.startswith(self.decode([self.prefix], skip_special=False))
        return self.encode_as(text, special)

    def encode_for_generation(self, text: str) -> list[int]:
        """A generation prompt's ids: as `encode`, but the check is for the begin token's text
        (the `hf` model encodes generation prompts in batches, by that rule)."""
        begin = None if self.bos is None else self.decode([self.bos], skip_special=False)
        return self.encode_as(text, not (begin is not None and text.startswith(begin)))

    def encode_as(self, text: str, special: bool) -> list[int]:
        if self.hf is not None:
            return self.hf.encode_prompt(text) if special else self.hf.encode_ordinary(text)
        # tiktoken's vocabularies add nothing of their own, as GPT-2's tokenizer does not;
        # transformers reads special tokens' names in the text as those tokens.
        base = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        return base.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def _named(tokenizer: HFTokenizer) -> tuple[int | None, int | None]:
    """The begin and end tokens transformers' tokenizer has for these files: the ones
    tokenizer_config.json names (text, or an object with its content)."""
    config = read_json_object(tokenizer.folder / "tokenizer_config.json", EvalError)
    ids = []
    for role in ("bos_token", "eos_token"):
        name = config.get(role)
        name = name.get("content") if isinstance(name, dict) else name
        ids.append(tokenizer.inner.token_to_id(name) if isinstance(name, str) else None)
    return ids[0], ids[1]
