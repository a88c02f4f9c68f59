"""Tokenizer loading: the GPT-2 default, its separator id, and the messages when loading fails."""

import socket

import pytest
import tiktoken

from minigpt.tokenizer import DEFAULT_TOKENIZER, TokenizerError, load_tokenizer


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


# The TinyStories vocabulary that ships with minigpt ------------------------------------------

import base64  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

from minigpt import data  # noqa: E402
from minigpt.ranks import read_ranks  # noqa: E402
from minigpt.tokenizer import SHIPPED_DIR, shipped_tokenizers  # noqa: E402


def test_the_tinystories_vocabulary_is_tiktoken_with_endoftext_last():
    assert "tinystories-4k" in shipped_tokenizers()
    enc = load_tokenizer("tinystories-4k")
    assert isinstance(enc, tiktoken.Encoding)
    assert enc.n_vocab == 4096 and enc.eot_token == 4095
    assert enc.encode("<|endoftext|>", allowed_special="all") == [4095]
    assert enc.encode_ordinary("<|endoftext|>") != [4095]  # ordinary text never makes it
    provenance = json.loads((SHIPPED_DIR / "tinystories-4k.json").read_text())
    assert provenance["vocab_size"] == 4096 and provenance["trainer"].startswith("rustbpe")
    assert [s["file"] for s in provenance["trained_on"]] == [
        "TinyStories-train-head.txt", "TinyStoriesV2-GPT4-train-head.txt"]


def random_text(rng: random.Random, length: int) -> str:
    """Text from every kind of code point: ASCII, accents, CJK, emoji, controls, combining marks."""
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x4E00, 0x4FFF),
              (0x1F300, 0x1F64F), (0x10000, 0x10FFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(length))


def test_any_text_round_trips_exactly(assets_dir):
    enc = load_tokenizer("tinystories-4k")
    rng = random.Random(0)
    for _ in range(300):
        text = random_text(rng, rng.randint(0, 200))
        assert enc.decode(enc.encode_ordinary(text)) == text
    files = sorted((assets_dir / "tinystories").glob("*.txt"))
    if not files:
        pytest.skip("the shared TinyStories files are not here (MINIGPT_ASSETS)")
    for path in files:
        text = path.read_text(encoding="utf-8")
        tokens = enc.encode_ordinary(text)
        assert enc.decode(tokens) == text, path.name
        # As dense as GPT-2 on these stories with 1/12 of its vocabulary.
        assert len(text.encode()) / len(tokens) > 3.7, path.name


def test_a_vocabulary_is_trained_and_read_back(tmp_path, stories_file):
    pytest.importorskip("rustbpe", reason="the optional BPE trainer (.[bpe]) is not installed")
    out = tmp_path / "small.tiktoken"
    assert data.main(["tokenizer", "--vocab-size", "300", "--text", str(stories_file),
                      "--out", str(out)]) == 0
    ranks = read_ranks(out)
    assert len(ranks) == 299 and all(bytes([b]) in ranks for b in range(256))
    enc = load_tokenizer(str(out))
    assert enc.n_vocab == 300 and enc.eot_token == 299
    assert enc.decode(enc.encode_ordinary("Once upon a time")) == "Once upon a time"
    provenance = json.loads(out.with_suffix(".json").read_text())
    assert provenance["trained_on"][0]["file"] == stories_file.name


def test_a_damaged_ranks_file_is_refused_with_its_path(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text(f"{base64.b64encode(b'a').decode()} 0\nnot-base64! 1\n")
    with pytest.raises(TokenizerError, match=r"bad.tiktoken \(line 2\)"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="unknown tokenizer 'nope': minigpt ships "
                                             "tinystories-4k"):
        load_tokenizer("nope")


def test_text_is_prepared_per_tokenizer(tmp_path, stories_file):
    small = tmp_path / "stories.txt"
    small.write_bytes(stories_file.read_bytes()[:200_000].rsplit(b"<|endoftext|>", 1)[0])
    gpt2_dir = data.prepare_text([small], tmp_path / "data", progress=False)
    ours = data.prepare_text([small], tmp_path / "data", tokenizer="tinystories-4k",
                             progress=False)
    assert ours == gpt2_dir.with_name(gpt2_dir.name + "-tinystories-4k")
    meta = data.load_meta(ours)
    assert meta["tokenizer"] == "tinystories-4k" and meta["vocab_size"] == 4096
    assert meta["dtype"] == "uint16"
    assert data.resolve_data(str(ours), tokenizer="tinystories-4k") == ours
    with pytest.raises(data.DataError, match="was tokenized with 'gpt2', not 'tinystories-4k'"):
        data.resolve_data(str(gpt2_dir), tokenizer="tinystories-4k")


def test_training_refuses_data_from_another_vocabulary(tmp_path, stories_file, capsys):
    from minigpt import train

    small = tmp_path / "stories.txt"
    small.write_bytes(stories_file.read_bytes()[:200_000].rsplit(b"<|endoftext|>", 1)[0])
    ours = data.prepare_text([small], tmp_path / "data", tokenizer="tinystories-4k",
                             progress=False)
    code = train.main(["--data", str(ours), "--model", "minigpt-tiny", "--preset", "dp",
                       "--steps", "1", "--batch-size", "8", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "was tokenized with 'tinystories-4k', not 'gpt2'" in err
    assert "--tokenizer tinystories-4k" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
