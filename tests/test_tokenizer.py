"""Tokenizer loading: the GPT-2 default, its separator id, and the messages when loading fails."""

import socket

import pytest
import tiktoken

from minigpt.tokenizer import DEFAULT_TOKENIZER, TokenizerError, load_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    try:
        return load_tokenizer()
    except TokenizerError as error:
        pytest.skip(f"GPT-2 tokenizer unavailable here: {error}")


def test_default_is_gpt2_with_endoftext_separator(gpt2):
    assert DEFAULT_TOKENIZER == "gpt2"
    assert gpt2.name == "gpt2"
    assert gpt2.n_vocab == 50257
    assert gpt2.eot_token == 50256
    assert gpt2.encode("<|endoftext|>", allowed_special="all") == [50256]
    # Ids from the GPT-2 vocabulary itself, so a different encoding cannot pass.
    assert gpt2.encode_ordinary("Hello world") == [15496, 995]
    text = "Once upon a time, Lily found a shiny stone. “Wow!” she said."
    assert gpt2.decode(gpt2.encode_ordinary(text)) == text


def test_loaded_once_per_process(gpt2):
    assert load_tokenizer("gpt2") is gpt2


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(TokenizerError, match="unknown tokenizer 'gpt-5'") as error:
        load_tokenizer("gpt-5")
    assert "gpt2" in str(error.value) and "cl100k_base" in str(error.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_without_cache_explains_tiktoken_cache_dir(tmp_path, monkeypatch):
    # An empty cache and a proxy that refuses connections: exactly "offline, no cache", fast.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    proxy = f"http://127.0.0.1:{_closed_port()}"
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, proxy)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # tiktoken's own in-process cache
    load_tokenizer.cache_clear()
    try:
        with pytest.raises(TokenizerError) as error:
            load_tokenizer("gpt2")
    finally:
        load_tokenizer.cache_clear()
    message = str(error.value)
    assert "TIKTOKEN_CACHE_DIR" in message
    assert str(tmp_path) in message
    assert "\n" not in message
    assert isinstance(error.value.__cause__, OSError)  # the connection failure, kept as cause
