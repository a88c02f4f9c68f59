"""Tokenizers: tiktoken encodings by name (GPT-2 by default) and the messages when they fail.

tiktoken fetches an encoding's BPE files from OpenAI's blob store on first use and keeps them in
a cache directory. Without a network and without that cache it fails deep inside `requests`
with a connection traceback; `load_tokenizer` turns that into one message that says how to
point `TIKTOKEN_CACHE_DIR` at a copy of the files. The document separator of the GPT-2
encoding is `<|endoftext|>`, id 50256 (`enc.eot_token`).
"""

from __future__ import annotations

import functools
import os
import tempfile

import tiktoken

DEFAULT_TOKENIZER = "gpt2"


class TokenizerError(RuntimeError):
    """A tokenizer cannot be loaded; the message says what to do about it."""


def _cache_dir() -> str:
    """Where tiktoken looks for its files, resolved the way tiktoken.load resolves it."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


@functools.cache
def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> tiktoken.Encoding:
    """The tiktoken encoding called `name`, loaded once per process.

    Raises TokenizerError for an unknown name (listing the known ones) and when the encoding's
    files can be neither read from the cache nor downloaded.
    """
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise TokenizerError(
            f"unknown tokenizer {name!r}: tiktoken {tiktoken.__version__} knows "
            f"{', '.join(sorted(known))}")
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
            f"cache names (copy the cache directory of a machine where "
            f"`tiktoken.get_encoding({name!r})` ran), e.g. "
            f"`export TIKTOKEN_CACHE_DIR=../shared/assets/tiktoken_cache`."
        ) from error
