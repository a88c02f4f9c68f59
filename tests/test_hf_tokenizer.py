"""Hugging Face tokenizer.json <-> tiktoken: ids, splits, files and refusals, with Hugging Face
`tokenizers` itself as the ground truth.

The tokenizers under test are trained here by `tokenizers`' own BpeTrainer on a few KB of text,
with the pre-tokenizers of GPT-2 (ByteLevel), SmolLM2 (Digits then ByteLevel) and Llama 3 (a
Split regex then ByteLevel); GPT-2's real files come from the tiktoken cache.
"""

import hashlib
import json
import os
import random
from pathlib import Path

import pytest
import regex

pytest.importorskip("tokenizers", reason="Hugging Face `tokenizers` is the ground truth of "
                                         "these tests: pip install tokenizers")
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    trainers,
)
from tokenizers import pre_tokenizers as pt  # noqa: E402

from minigpt.hub import tokenizer_export as hf_export  # noqa: E402
from minigpt.hub import tokenizer_files as hf  # noqa: E402
from minigpt.tokenizer import PATTERN, Encoding, TokenizerError, load_tokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3's split regex (the same as tiktoken's cl100k_base).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = """\
Once upon a time, in a small café near Zürich, a naïve robot named Zoë counted 12345 stars.
On 2026-11-24 at 07:45 she wrote: "It's late, we'll go home; they've left, I'm tired, you'd agree."
The   quick brown fox   jumps over the lazy dog.    The quick brown fox jumps again!
Prices: $3.99, €12,50, ¥1000, ₹2,500.75 and 50% off -- 1/2 price, 3/4 of 100 = 75.
Ümlaut, façade, jalapeño, smörgåsbord, crème brûlée, São Paulo, Kraków, İstanbul, Ελλάδα.
Emoji: 🙂👍🏽🚀🎉 and flags 🇨🇭🇯🇵; faces 😀😃😄😁 repeated 🙂🙂🙂 three times.
日本語のテキストも少しあります。東京は大きな都市です。中文也有一点：你好！한국어도 있어요.
Numbers in other scripts: ٠١٢٣٤٥٦٧٨٩, ०१२३, ½ ¾ ² ³, Ⅻ, and 9876543210 again.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])  # 1, 1, 2, 3, 5, 8, 13, 21
    return values[:n]

\tif (x >= 10 && y != 0) { printf("%d\\n", x / y); }    // C-like, tabs and braces
for i in range(100):\r\n    print(f"{i:03d}: {i ** 2}")\r\n

Lily and Ben went to the park. Lily saw a big red ball. "Can I play?" she asked.
Ben said, "Yes! Let's play together." They played all day, until the sun went down.
The end.\n\n\n   Another story, with trailing spaces   \n  and indented lines\n\t\ttabs too.
Mr. O'Neil's dog--a terrier--barked 3 times at 3:33 a.m.; the neighbours' cat didn't care.
Email: someone@example.com, URL: https://example.org/path?q=1&r=2#frag, path C:\\Users\\zoe.
"""
TEXTS = [
    "12345 and 2026-11-24", "a  b   c\n\n\n  d", "café naïve Zürich", "🙂👍🏽", "日本語と中文",
    "x 1 2  3   4\t5\n6", "  12 ab12cd 3.14 1,000 ½²٣", "hello\r\n\r\n  world  ", "",
    " ", "   ", "\n", "'s 'll 'VE", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|endoftext|>",
    "a<|endoftext|>b <|im_end|> 7<|im_start|>", CORPUS,
]
NO_REGEX = pt.ByteLevel(add_prefix_space=False, use_regex=False)
STYLES = {
    "gpt2": pt.ByteLevel(add_prefix_space=False),
    "smollm2": pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False)]),
    "digit-runs": pt.Sequence([pt.Digits(individual_digits=False),
                               pt.ByteLevel(add_prefix_space=False)]),
    "llama3": pt.Sequence([pt.Split(Regex(LLAMA3_SPLIT), "isolated"), NO_REGEX]),
    # A regex that matches only words and digits: the text between its matches is kept too.
    "split-gaps": pt.Sequence([pt.Split(Regex(r"\p{L}+|\p{N}"), "isolated"), NO_REGEX]),
}


def train(pre_tokenizer, vocab_size: int = 1200) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pt.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def mixed_texts(seed: int, count: int) -> list[str]:
    """Corpus words and numbers recombined with random whitespace, and random code points:
    merges fire, and every split rule meets every neighbour."""
    rng = random.Random(seed)
    words = regex.findall(r"\S+", CORPUS)
    gaps = [" ", "  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "", " 7", "42 ", "\u3000"]
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x4E00, 0x4FFF),
              (0x1F300, 0x1F64F), (0x660, 0x669), (0x2000, 0x206F), (0x30, 0x39)]
    texts = []
    for _ in range(count):
        parts = [rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(1, 12))]
        noise = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 9)))
        texts.append("".join(parts) + noise)
    return texts


def assert_same_ids(tokenizer: Tokenizer, enc, texts: list[str]) -> None:
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert enc.encode(text, allowed_special="all") == ids, text
        assert enc.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    return {style: train(pre) for style, pre in STYLES.items()}


# Import: a trained tokenizer.json becomes a tiktoken encoding with the same ids ------------


@pytest.mark.parametrize("style", STYLES)
def test_converted_encoding_gives_the_ids_of_tokenizers(trained, style):
    tokenizer = trained[style]
    assert tokenizer.get_vocab_size() > 800  # merges enough that the texts exercise them
    vocab = hf.ranks_from_tokenizer_json(json.loads(tokenizer.to_str()), name=style)
    enc = vocab.encoding()
    assert vocab.special_tokens == {s: tokenizer.token_to_id(s) for s in SPECIALS}
    assert enc.n_vocab == vocab.vocab_size == tokenizer.get_vocab_size()
    assert_same_ids(tokenizer, enc, TEXTS + mixed_texts(0, 400))
    if style == "gpt2":
        assert vocab.pat_str == PATTERN
    if style == "smollm2":  # one token per digit, and a space before a digit on its own
        assert len(enc.encode("2026")) == 4
        assert enc.encode(" 7") == [enc.encode(" ")[0], enc.encode("7")[0]]


@pytest.mark.parametrize("style", STYLES)
def test_split_regex_cuts_text_where_the_pre_tokenizer_does(trained, style):
    pre_tokenizer = STYLES[style]
    pat_str = hf.ranks_from_tokenizer_json(json.loads(trained[style].to_str())).pat_str
    for text in TEXTS + mixed_texts(1, 300):
        expected = [hf.token_bytes(piece) for piece, _ in pre_tokenizer.pre_tokenize_str(text)]
        assert [p.encode() for p in regex.findall(pat_str, text)] == expected, text


@pytest.mark.parametrize("style", ["gpt2", "smollm2", "llama3"])
def test_saved_ranks_load_through_load_tokenizer(trained, style, tmp_path):
    tokenizer = trained[style]
    vocab = hf.ranks_from_tokenizer_json(json.loads(tokenizer.to_str()), name=style)
    path = tmp_path / f"{style}.tiktoken"
    source = {"repo": f"example/{style}", "revision": "abc123"}
    hf.save_as_tiktoken(vocab, path, source)
    provenance = json.loads(path.with_suffix(".json").read_text())
    assert provenance["source"] == source and provenance["pat_str"] == vocab.pat_str
    assert provenance["special_tokens"] == vocab.special_tokens
    assert provenance["vocab_size"] == tokenizer.get_vocab_size()
    enc = load_tokenizer(str(path))
    assert enc.name == style and enc.eot_token == tokenizer.token_to_id("<|endoftext|>")
    assert_same_ids(tokenizer, enc, TEXTS + mixed_texts(2, 100))


def test_added_tokens_outside_the_vocabulary_become_special_tokens():
    tokenizer = train(STYLES["smollm2"], vocab_size=500)
    tokenizer.add_tokens(["<tool>", "  "])  # not special, not in the vocabulary
    tokenizer.add_special_tokens(["<|pad|>"])
    vocab = hf.ranks_from_tokenizer_json(json.loads(tokenizer.to_str()))
    assert vocab.special_tokens == {
        s: tokenizer.token_to_id(s) for s in [*SPECIALS, "<tool>", "  ", "<|pad|>"]}
    texts = ["a<tool>b", "call <tool>(12)  then   wait", "x<|pad|><|pad|> <|im_end|>"]
    assert_same_ids(tokenizer, vocab.encoding(), TEXTS + texts + mixed_texts(7, 100))


def test_a_tokenizer_directory_loads_as_an_encoding(trained, tmp_path):
    (tmp_path / "SmolLM2-tiny").mkdir()
    trained["smollm2"].save(str(tmp_path / "SmolLM2-tiny" / "tokenizer.json"))
    enc = hf.load_hf_encoding(tmp_path / "SmolLM2-tiny")
    assert enc.name == "SmolLM2-tiny"
    assert_same_ids(trained["smollm2"], enc, TEXTS)


# GPT-2's real files (encoder.json and vocab.bpe are Hugging Face's vocab.json and merges.txt)


def gpt2_files() -> tuple[Path, Path]:
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    cache = Path(os.environ.get("TIKTOKEN_CACHE_DIR", "/nonexistent"))
    paths = tuple(cache / hashlib.sha1((base + name).encode()).hexdigest()
                  for name in ("encoder.json", "vocab.bpe"))
    if not all(p.is_file() for p in paths):
        pytest.skip("GPT-2's BPE files are not in the tiktoken cache (TIKTOKEN_CACHE_DIR)")
    return paths


@pytest.fixture(scope="module")
def gpt2_export(gpt2, tmp_path_factory) -> Path:  # gpt2: conftest's, skipped where absent
    return hf_export.write_hf_tokenizer(gpt2, tmp_path_factory.mktemp("gpt2-hf"),
                                 model_max_length=1024)


def test_gpt2_tokenizer_json_converts_to_tiktoken_gpt2(gpt2):
    vocab_json, merges_txt = gpt2_files()
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab_json), str(merges_txt)))
    tokenizer.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    vocab = hf.ranks_from_tokenizer_json(json.loads(tokenizer.to_str()))
    assert vocab.ranks == gpt2._mergeable_ranks
    assert vocab.special_tokens == {"<|endoftext|>": 50256} and vocab.pat_str == PATTERN
    assert_same_ids(tokenizer, vocab.encoding(), TEXTS + mixed_texts(3, 100))


def test_gpt2_exported_from_tiktoken_is_hugging_faces_gpt2(gpt2, gpt2_export, assets_dir):
    tokenizer = Tokenizer.from_file(str(gpt2_export / "tokenizer.json"))
    stories = sorted((assets_dir / "tinystories").glob("*.txt"))
    sample = [stories[0].read_text(encoding="utf-8")[:100_000]] if stories else []
    assert_same_ids(tokenizer, gpt2, TEXTS + mixed_texts(4, 300) + sample)
    vocab_json, merges_txt = gpt2_files()
    assert json.loads((gpt2_export / "vocab.json").read_text()) == json.loads(
        vocab_json.read_text(encoding="utf-8"))
    lines = [(gpt2_export / "merges.txt").read_text(encoding="utf-8").splitlines(),
             merges_txt.read_text(encoding="utf-8").splitlines()]
    assert lines[0] == [line for line in lines[1] if line] and len(lines[0]) == 50001
    config = json.loads((gpt2_export / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 1024 and config["eos_token"] == "<|endoftext|>"
    assert config["bos_token"] == "<|endoftext|>" and not config["clean_up_tokenization_spaces"]
    assert json.loads((gpt2_export / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


# Export: any converted encoding goes back to a tokenizer.json with the same ids -------------


@pytest.mark.parametrize("style", STYLES)
def test_export_of_a_converted_encoding_round_trips(trained, style):
    vocab = hf.ranks_from_tokenizer_json(json.loads(trained[style].to_str()))
    exported = hf_export.tokenizer_json_from_encoding(vocab.encoding())
    tokenizer = Tokenizer.from_str(json.dumps(exported))
    assert_same_ids(tokenizer, vocab.encoding(), TEXTS + mixed_texts(5, 300))
    again = hf.ranks_from_tokenizer_json(exported)
    assert (again.ranks, again.special_tokens) == (vocab.ranks, vocab.special_tokens)


def test_the_shipped_vocabulary_exports_with_its_gpt2_files(tmp_path):
    enc = load_tokenizer("tinystories-4k")
    out = hf_export.write_hf_tokenizer(enc, tmp_path / "hf", model_max_length=256)
    texts = TEXTS + mixed_texts(6, 200)
    assert_same_ids(Tokenizer.from_file(str(out / "tokenizer.json")), enc, texts)
    # GPT2Tokenizer's files: vocab.json, merges.txt and GPT-2's own split.
    gpt2_style = Tokenizer(models.BPE.from_file(str(out / "vocab.json"), str(out / "merges.txt")))
    gpt2_style.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    gpt2_style.decoder = decoders.ByteLevel()
    gpt2_style.add_special_tokens(["<|endoftext|>"])
    assert_same_ids(gpt2_style, enc, texts)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256
    with pytest.raises(TokenizerError, match="eos_token '<eos>' is not a special token"):
        hf_export.write_hf_tokenizer(enc, tmp_path / "bad", model_max_length=256, eos_token="<eos>")


@pytest.mark.parametrize("first, split", [(b"ab", (b"ab", b"c")), (b"bc", (b"a", b"bc"))])
def test_merges_are_the_last_bpe_step_when_a_token_splits_two_ways(first, split):
    # "abc" is both "ab"+"c" and "a"+"bc"; BPE makes whichever pair is ranked first.
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({first: 256, ({b"ab", b"bc"} - {first}).pop(): 257, b"abc": 258})
    assert hf_export.recover_merges(ranks)[-1] == split
    enc = Encoding("abc", pattern=PATTERN, ranks=ranks, special_tokens={"<|endoftext|>": 259})
    tokenizer = Tokenizer.from_str(json.dumps(hf_export.tokenizer_json_from_encoding(enc)))
    assert_same_ids(tokenizer, enc, ["abc", "abcabc", "xabc", "zabcd", "ab bc abcbc", "cab"])


# Refusals: one line that names what was found ----------------------------------------------


def trained_json(**model_fields) -> dict:
    data = json.loads(train(STYLES["gpt2"], vocab_size=400).to_str())
    data["model"].update(model_fields)
    return data


def sentencepiece_llama2() -> dict:
    # Llama 2 / TinyLlama: BPE over '▁'-joined words with byte fallback, no pre-tokenizer.
    tokenizer = Tokenizer(models.BPE({"<unk>": 0, "<0x41>": 1, "▁": 2, "a": 3, "▁a": 4},
                                     [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                 normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return json.loads(tokenizer.to_str())


def unigram() -> dict:
    tokenizer = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁a", -1.0), ("a", -2.0)], 0))
    tokenizer.pre_tokenizer = pt.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return json.loads(tokenizer.to_str())


def wordpiece() -> dict:
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pt.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return json.loads(tokenizer.to_str())


def with_part(part: str, value) -> dict:
    data = trained_json()
    data[part] = value
    return data


def added_vocabulary_token() -> dict:
    data = trained_json()
    assert "he" in data["model"]["vocab"]
    data["added_tokens"].append({"id": data["model"]["vocab"]["he"], "content": "he",
                                 "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": True, "special": False})
    return data


def with_pre_tokenizer(pre_tokenizer) -> dict:
    return with_part("pre_tokenizer", json.loads(pre_tokenizer.__getstate__()))


def swapped_ids() -> dict:
    data = trained_json()
    vocab, (left, right) = data["model"]["vocab"], data["model"]["merges"][3]
    a, b = left + right, "".join(data["model"]["merges"][4])
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return data


def unmade_token() -> dict:
    data = trained_json()
    data["model"]["vocab"]["ĠZürichsee"] = len(data["model"]["vocab"])
    return data


REFUSALS = {
    "llama2": (sentencepiece_llama2, r"is a SentencePiece \(Metaspace\) tokenizer \(.*"
                                     r"normalizer Prepend.*decoder ByteFallback.*\); minigpt's "
                                     r"runtime tokenizer is tiktoken, which needs byte-level BPE"),
    "unigram": (unigram, r"SentencePiece \(Metaspace\) tokenizer \(model Unigram, "
                         r"pre_tokenizer Metaspace"),
    "wordpiece": (wordpiece, r"model.type is 'WordPiece', not 'BPE'"),
    "nfc": (lambda: with_part("normalizer", {"type": "NFC"}), "normalizer NFC changes the text"),
    "lowercase": (lambda: with_part("normalizer", {"type": "Lowercase"}), "normalizer Lowercase"),
    "dropout": (lambda: trained_json(dropout=0.1), r"model.dropout is 0.1"),
    "prefix": (lambda: trained_json(continuing_subword_prefix="##"),
               "model.continuing_subword_prefix is '##'"),
    "suffix": (lambda: trained_json(end_of_word_suffix="</w>"),
               "model.end_of_word_suffix is '</w>'"),
    "add_prefix_space": (lambda: with_pre_tokenizer(pt.ByteLevel(add_prefix_space=True)),
                         "ByteLevel.add_prefix_space is true"),
    "split_removed": (
        lambda: with_pre_tokenizer(pt.Sequence([pt.Split(Regex(r"\s+"), "removed"), NO_REGEX])),
        "Split must have a Regex pattern, behavior 'Isolated'"),
    "two_splits": (
        lambda: with_pre_tokenizer(pt.Sequence([pt.Split(Regex(r"\d"), "isolated"),
                                                pt.Split(Regex(r"\s"), "isolated"), NO_REGEX])),
        r"pre_tokenizer Sequence\[Split, Split, ByteLevel\] .* has no tiktoken regex"),
    "decoder": (lambda: with_part("decoder", None), "decoder is null, not ByteLevel"),
    "order": (swapped_ids, "the vocabulary ids are not in merge order"),
    "unmade": (unmade_token, "1 vocabulary tokens are made by no merge"),
    "added": (added_vocabulary_token, "added token 'he' is not special but is a vocabulary"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_tiktoken_cannot_express_is_refused_in_one_line(case, tmp_path):
    make, message = REFUSALS[case]
    path = tmp_path / "some-model" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(make()), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message) as error:
        hf.ranks_from_tokenizer_json(path.parent)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


def test_a_vocabulary_without_every_byte_is_refused():
    data = trained_json(byte_fallback=True)
    vocab = data["model"]["vocab"]
    del vocab[hf.token_str(b"\x00")]
    with pytest.raises(TokenizerError, match="model.byte_fallback is true and the vocabulary "
                                             "lacks 1 of the 256 single bytes"):
        hf.ranks_from_tokenizer_json(data)


def test_merges_that_tiktoken_would_not_follow_are_refused():
    # "bc" is merged before "ab", so Hugging Face leaves "abc" as a + bc (no such merge), where
    # tiktoken, seeing that "abc" is a token, would make it whole.
    vocab = {hf.token_str(bytes([b])): b for b in range(256)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    tokenizer = Tokenizer(models.BPE(vocab, [("b", "c"), ("a", "b"), ("ab", "c")]))
    tokenizer.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    assert tokenizer.encode("abc").ids == [ord("a"), 256]
    with pytest.raises(TokenizerError, match="Hugging Face's BPE does not turn 'abc' into one"):
        hf.ranks_from_tokenizer_json(json.loads(tokenizer.to_str()))


def test_a_converted_vocabulary_with_a_damaged_provenance_is_refused(trained, tmp_path):
    vocab = hf.ranks_from_tokenizer_json(json.loads(trained["smollm2"].to_str()))
    path = tmp_path / "smol.tiktoken"
    hf.save_as_tiktoken(vocab, path, {"repo": "example/smol"})
    path.with_suffix(".json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot read .*smol.json, the provenance"):
        load_tokenizer(str(path))
    # Without the JSON, the ranks (with the special tokens' ids missing) are not dense.
    path.with_suffix(".json").unlink()
    with pytest.raises(TokenizerError, match="is not a BPE ranks file"):
        load_tokenizer(str(path))
