"""Token ids to text as they arrive, and the text stop strings cut.

A token alone is not always text: byte-level BPE splits a character over several tokens, and a
SentencePiece token's leading space shows only after another token. So `TextStream` decodes a
short window of the latest tokens (the tokens since the last complete piece, after the one
before them, as vLLM does) and passes on what the window adds once it no longer ends in half a
character: linear in the length of the reply, and the concatenation of what it passes on is the
reply decoded whole. Stop strings are found in the text, not in tokens: what might still
become a stop string is held back until the next token settles it, and the text is cut where
one begins. Special tokens are left out of the text, as `minigpt.generate` leaves them out,
and ids the tokenizer does not have (a model's vocabulary padded past its tokenizer's) too.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_TOKENS = 4  # prompt tokens decoded before the first new one: its leading space shows


def decode(tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids`, special tokens and ids past the vocabulary left out."""
    return tokenizer.decode([t for t in ids if 0 <= t < tokenizer.n_vocab],
                            skip_special_tokens=True)


def token_text(tokenizer, token: int) -> str:
    """One token as text for a logprobs entry (special tokens by name)."""
    if not 0 <= token < tokenizer.n_vocab:
        return ""
    return tokenizer.decode([token])


class TextStream:
    """The text of tokens added as they come (`add`), with stop strings cut; `finish` passes
    on what was held back. `context` (the prompt's ids, for a continuation) is decoded before the
    first new token and not passed on."""

    def __init__(self, tokenizer, *, context: Sequence[int] = (), stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids = list(context[-CONTEXT_TOKENS:])
        self.start, self.read = 0, len(self.ids)  # the window: ids[start:] after ids[start:read]
        self.text, self.sent, self.stopped = "", 0, False

    def add(self, tokens: list[int]) -> str:
        """New text to pass on after `tokens` ("" while a character or a stop string is
        unfinished, or after a stop string)."""
        if self.stopped:
            return ""
        self.ids += tokens
        before = decode(self.tokenizer, self.ids[self.start:self.read])
        after = decode(self.tokenizer, self.ids[self.start:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.start, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Whatever is still held back: a reply may end inside a character or a possible stop
        string, and the text passed on must be the whole reply."""
        if not self.stopped:
            before = decode(self.tokenizer, self.ids[self.start:self.read])
            after = decode(self.tokenizer, self.ids[self.start:])
            self.text += after[len(before):] if after.startswith(before) else ""
            self.start = self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        found = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1))
                             for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            end = len(self.text)
        else:
            end = len(self.text) - (0 if final else self._held())
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
