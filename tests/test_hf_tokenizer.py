"""Hugging Face tokenizers: an imported checkpoint's `tokenizer.json` read as its own library
reads it (`minigpt.tokenizer.HFTokenizer`), and the zoo's tiktoken vocabularies written as
`tokenizer.json` (`minigpt.hub.tokenizer_export`), with the `tokenizers` library as the ground
truth.

The imported tokenizers are made here with `tokenizers` alone, in the layouts the real files
have: SmolLM2's (Digits then ByteLevel), Qwen's (NFC, a Split regex, ByteLevel, its specials
after the vocabulary), Llama 3's (tiktoken ranks with every split a merge and `ignore_merges`, a
post-processor adding the begin token) and Llama 2's (SentencePiece-style BPE over `▁`, byte
fallback, `<s>` added; both the Hub's normalizer spelling and transformers 5's Metaspace one).
transformers' own converters and classes are test_families.py's (the [hf] extra).
"""

import hashlib
import json
import os
import random
import unicodedata
from pathlib import Path

import jinja2
import pytest
from tokenizer_texts import TORTURE, texts, training_stories
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, processors, trainers
from tokenizers import pre_tokenizers as pt

from minigpt.hub import tokenizer_export as hf_export
from minigpt.tokenizer import (
    END_NAMES,
    PATTERN,
    Encoding,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
BYTE_LEVEL = pt.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level_bpe(pre_tokenizer, *, specials=(), vocab_size=800) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_stories(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials),
        initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False))
    return tok


def smollm2() -> Tokenizer:
    """SmolLM2's layout: each digit alone, then ByteLevel; its specials first (ids 0...)."""
    tok = _byte_level_bpe(pt.Sequence([pt.Digits(individual_digits=True),
                                       pt.ByteLevel(add_prefix_space=False)]), specials=CHATML)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def qwen() -> Tokenizer:
    """Qwen's layout: NFC, its split regex, ByteLevel; its specials after the vocabulary."""
    tok = _byte_level_bpe(pt.Sequence([pt.Split(Regex(QWEN_SPLIT), "isolated"), BYTE_LEVEL]))
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens(CHATML)
    return tok


def llama3() -> Tokenizer:
    """Llama 3's layout, as transformers' TikTokenConverter writes it from tiktoken ranks (the
    shipped tinystories-4k): every split of a token into two tokens is a merge,
    `ignore_merges` (a piece that is a token is that token), <|begin_of_text|> added."""
    ranks = load_tokenizer("tinystories-4k").ranks
    vocab = {hf_export.token_str(t): r for t, r in ranks.items()}
    merges = [(hf_export.token_str(t[:i]), hf_export.token_str(t[i:]))
              for t, _ in sorted(ranks.items(), key=lambda item: item[1])
              for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(LLAMA3_SPLIT), "isolated"), BYTE_LEVEL])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    return tok


def llama2(*, metaspace: bool = False) -> Tokenizer:
    """Llama 2's layout: BPE over `▁`-joined words, the 256 byte tokens <0x00>... for what the
    vocabulary lacks, <unk> <s> </s> as ids 0 1 2, <s> added. Spaces become `▁` by the Hub
    files' normalizer (Prepend, Replace), or by transformers 5's Metaspace pre-tokenizer."""
    trainer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer.pre_tokenizer = pt.Metaspace()
    trainer.train_from_iterator(training_stories(), trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=80,
        show_progress=False))
    trained = json.loads(trainer.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in trained["merges"]], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    if metaspace:
        tok.pre_tokenizer = pt.Metaspace(prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


STYLES = {"smollm2": smollm2, "qwen": qwen, "llama3": llama3, "llama2": llama2,
          "llama2-metaspace": lambda: llama2(metaspace=True)}


@pytest.fixture(scope="module")
def made() -> dict[str, Tokenizer]:
    return {}


def folder_of(tmp_path: Path, tok: Tokenizer, files: dict | None = None) -> Path:
    """A tokenizer folder as a run holds it: tokenizer.json and the config files given
    (a dict is written as JSON)."""
    folder = tmp_path / "tokenizer"
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    for name, content in (files or {}).items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content),
                                   encoding="utf-8")
    return folder


def specials_of(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values() if t.special]


@pytest.mark.parametrize("style", STYLES)
def test_an_imported_tokenizer_gives_its_own_librarys_ids(style, made, tmp_path):
    reference = made.setdefault(style, STYLES[style]())
    ours = HFTokenizer(folder_of(tmp_path, reference))
    specials = specials_of(reference)
    assert ours.special_tokens == {s: reference.token_to_id(s) for s in specials}
    assert ours.n_vocab == reference.get_vocab_size()
    cases = texts(specials)
    assert ours.encode_ordinary_batch(cases) == [
        e.ids for e in reference.encode_batch(cases, add_special_tokens=False)]
    for text in cases:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode_ordinary(text) == ids
        assert ours.encode_prompt(text) == reference.encode(text).ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False)
        # back to the text (Qwen's normalizer composes accents); the Hub's Llama 2 files prepend
        # `▁` to each stretch of text, so a space appears after each special token written in it
        expected = unicodedata.normalize("NFC", text) if style == "qwen" else text
        if style != "llama2" or not any(s in text for s in specials):
            assert ours.decode(ids) == expected
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids)
    for special in specials:  # written in the text, a special token is that token
        assert ours.encode_ordinary(f"a{special}b")[1:2] == [reference.token_to_id(special)]


def test_what_each_layout_does_shows_in_the_ids(made, tmp_path):
    """The layouts' own rules, so the cases above are known to exercise them."""
    smol = HFTokenizer(folder_of(tmp_path / "smol", made.setdefault("smollm2", smollm2())))
    assert len(smol.encode_ordinary("2024")) == 4  # one token per digit
    qwen_tok = HFTokenizer(folder_of(tmp_path / "qwen", made.setdefault("qwen", qwen())))
    assert qwen_tok.encode_ordinary("cafe\u0301") == qwen_tok.encode_ordinary("café")  # NFC
    assert qwen_tok.special_tokens == {"<|endoftext|>": 800, "<|im_start|>": 801,
                                       "<|im_end|>": 802}
    llama = HFTokenizer(folder_of(tmp_path / "llama2", made.setdefault("llama2", llama2())))
    emoji = llama.encode_ordinary("🙂")  # not in the vocabulary: its four bytes
    assert [llama.token_name(i) for i in emoji][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert llama.encode_prompt("Once")[0] == 1 and llama.bos_token is None  # no config names it
    # Llama 3: tiktoken's ids for the same ranks and split regex (what ignore_merges is for)
    enc = load_tokenizer("tinystories-4k")
    tiktoken_llama3 = Encoding("llama3-like", pattern=LLAMA3_SPLIT, ranks=enc.ranks,
                               special_tokens={"<|endoftext|>": len(enc.ranks)})
    l3 = HFTokenizer(folder_of(tmp_path / "llama3", made.setdefault("llama3", llama3())))
    for text in texts([]):
        assert l3.encode_ordinary(text) == tiktoken_llama3.encode_ordinary(text)


# --- begin and end tokens --------------------------------------------------------------------

ENDS = {  # files beside the ChatML tokenizer (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2)
    "generation int": ({"generation_config.json": {"eos_token_id": 2}}, (2,)),
    "generation list": ({"generation_config.json": {"eos_token_id": [2, 0]}}, (2, 0)),
    "config.json": ({"config.json": {"eos_token_id": 0}}, (0,)),
    "generation first": ({"generation_config.json": {"eos_token_id": [2]},
                          "config.json": {"eos_token_id": 0},
                          "tokenizer_config.json": {"eos_token": "<|im_start|>"}}, (2,)),
    "config before tokenizer_config": ({"config.json": {"eos_token_id": 0},
                                        "tokenizer_config.json": {"eos_token": "<|im_end|>"}},
                                       (0,)),
    "tokenizer_config string": ({"tokenizer_config.json": {"eos_token": "<|im_end|>"}}, (2,)),
    "tokenizer_config content": ({"tokenizer_config.json": {"eos_token": {
        "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True}}}, (2,)),
    "usual names": ({}, (0,)),  # END_NAMES: <|endoftext|> before <|im_end|>
}


@pytest.mark.parametrize("case", ENDS)
def test_end_tokens_come_from_the_configs(case, made, tmp_path):
    files, stops = ENDS[case]
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2()), files))
    assert ours.stop_tokens == stops and ours.eot_token == stops[0]
    assert ours.bos_token is None  # the post-processor adds none


def test_the_usual_end_names_are_in_order():
    assert END_NAMES.index("<|endoftext|>") < END_NAMES.index("<|im_end|>")


@pytest.mark.parametrize("files, bos", [
    ({"generation_config.json": {"bos_token_id": 1}}, 1),
    ({"config.json": {"bos_token_id": 1}}, 1),
    ({"tokenizer_config.json": {"bos_token": "<s>"}}, 1),
    ({"tokenizer_config.json": {"bos_token": {"content": "<s>"}}}, 1),
    # a begin id the post-processor does not add is not added before each document
    ({"generation_config.json": {"bos_token_id": 2}}, None),
])
def test_the_begin_token_is_the_one_the_post_processor_adds(files, bos, made, tmp_path):
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("llama2", llama2()), files))
    assert ours.bos_token == bos
    assert ours.encode_prompt("Once")[0] == 1


def test_a_begin_token_without_a_post_processor_adding_it_is_not_the_bos(made, tmp_path):
    files = {"generation_config.json": {"bos_token_id": 1, "eos_token_id": 2}}
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2()), files))
    assert ours.bos_token is None and ours.encode_prompt("a") == ours.encode_ordinary("a")


def test_a_tokenizer_without_added_tokens_loads_and_data_preparation_refuses_it(tmp_path):
    from minigpt.data import prepare_text
    from minigpt.data.token_files import DataError

    bare = _byte_level_bpe(pt.ByteLevel(add_prefix_space=False), vocab_size=400)
    folder = folder_of(tmp_path, bare)
    ours = HFTokenizer(folder)
    assert (ours.special_tokens, ours.stop_tokens, ours.eot_token, ours.bos_token) == (
        {}, (), None, None)
    assert ours.decode(ours.encode_ordinary(TORTURE)) == TORTURE
    stories = tmp_path / "stories.txt"
    stories.write_text("Once upon a time.\n<|endoftext|>\nThe end.\n<|endoftext|>\n")
    with pytest.raises(DataError, match="neither an end nor a begin token") as error:
        prepare_text([stories], tmp_path / "data", tokenizer=str(folder), progress=False)
    assert "\n" not in str(error.value)


def test_data_preparation_writes_begin_story_end_with_the_models_own_tokens(made, tmp_path):
    from conftest import tokens_of

    from minigpt.data import prepare_text

    files = {"generation_config.json": {"bos_token_id": 4095, "eos_token_id": [4096, 4099]}}
    folder = folder_of(tmp_path, made.setdefault("llama3", llama3()), files)
    ours = HFTokenizer(folder)
    assert (ours.bos_token, ours.eot_token, ours.stop_tokens) == (4095, 4096, (4096, 4099))
    stories = texts([])[:12]
    (tmp_path / "stories.txt").write_text("\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n")
    data = prepare_text([tmp_path / "stories.txt"], tmp_path / "data", tokenizer=str(folder),
                        val_fraction=0.25, progress=False)
    written = [tokens_of(data, split).tolist() for split in ("train", "val")]
    expected = {tuple([4095, *ours.encode_ordinary(s.strip()), 4096]) for s in stories}
    documents = [d for tokens in written for d in _split_before(tokens, 4095)]
    assert len(documents) == len(stories) and set(documents) == expected


def _split_before(tokens: list[int], bos: int) -> list[tuple[int, ...]]:
    starts = [i for i, t in enumerate(tokens) if t == bos] + [len(tokens)]
    assert starts[0] == 0
    return [tuple(tokens[a:b]) for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("damage, message", [
    ("{not json", "cannot be read by the tokenizers library"),
    (json.dumps({"version": "1.0", "model": {"type": "Unknown"}}),
     "cannot be read by the tokenizers library"),
])
def test_an_unloadable_tokenizer_json_is_one_line(damage, message, tmp_path):
    (tmp_path / "tokenizer.json").write_text(damage)
    with pytest.raises(TokenizerError, match=message) as error:
        HFTokenizer(tmp_path)
    assert "\n" not in str(error.value)


# --- chat templates --------------------------------------------------------------------------

CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                   "message['content'] + '<|im_end|>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be kind. Ünïcode 🙂"},
            {"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("files", [
    {"chat_template.jinja": CHATML_TEMPLATE},
    {"tokenizer_config.json": {"chat_template": CHATML_TEMPLATE}},
    {"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": "no"},
                                                 {"name": "default",
                                                  "template": CHATML_TEMPLATE}]}},
    # transformers 5 saves it in its own file, which wins over tokenizer_config.json's
    {"chat_template.jinja": CHATML_TEMPLATE, "tokenizer_config.json": {"chat_template": "no"}},
], ids=["jinja file", "config string", "config named list", "jinja file first"])
def test_the_chat_template_is_found_where_transformers_keeps_it(files, made, tmp_path):
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2()), files))
    assert ours.chat_template == CHATML_TEMPLATE
    rendered = ours.render_chat(MESSAGES)
    assert rendered == ("<|im_start|>system\nBe kind. Ünïcode 🙂<|im_end|>\n<|im_start|>user\n"
                        "Tell me a story.<|im_end|>\n<|im_start|>assistant\n")
    assert ours.render_chat(MESSAGES, add_generation_prompt=False) == rendered.removesuffix(
        "<|im_start|>assistant\n")
    assert ours.encode_ordinary(rendered)[:1] == [ours.special_tokens["<|im_start|>"]]


def test_render_chat_is_what_jinja2_renders(made, tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}\n"
                "  {% if loop.first %}[{{ m.role|upper }}]{% endif %}{{ m.content|trim }}"
                "{{ m|tojson }}{% if loop.last %}{% break %}{% endif %}\n{% endfor %}"
                "{{ eos_token }}{% if add_generation_prompt %}>>{% endif %}")
    files = {"chat_template.jinja": template,
             "tokenizer_config.json": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}}
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2()), files))
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    expected = env.from_string(template).render(messages=MESSAGES, add_generation_prompt=True,
                                                 bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert ours.render_chat(MESSAGES) == expected
    assert "Ünïcode 🙂" in expected  # tojson keeps what is not ASCII


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     "TemplateError: Conversation roles must alternate user/assistant"),
    ("{% for m in messages %}{{ m.content }}", "TemplateSyntaxError"),
    ("{{ messages[5]['content'] + 1 }}", "UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),  # the sandbox: Hub templates are code
])
def test_a_template_that_fails_is_one_line(template, message, made, tmp_path):
    folder = folder_of(tmp_path, made.setdefault("smollm2", smollm2()),
                       {"chat_template.jinja": template})
    with pytest.raises(TokenizerError, match=message) as error:
        HFTokenizer(folder).render_chat(MESSAGES)
    assert "\n" not in str(error.value) and "chat template" in str(error.value)


def test_without_a_template_chat_is_refused_in_one_line(made, tmp_path):
    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2())))
    assert ours.chat_template is None
    with pytest.raises(TokenizerError, match="has no chat template.*use --prompt") as error:
        ours.render_chat(MESSAGES)
    assert "\n" not in str(error.value)
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer("tinystories-4k").render_chat(MESSAGES)


def test_streamed_text_is_the_returned_text_even_inside_a_character(made, tmp_path):
    from minigpt.decoding import TextStream

    ours = HFTokenizer(folder_of(tmp_path, made.setdefault("smollm2", smollm2())))
    ids = ours.encode_ordinary("a café")
    cut = ids[:-1] if ours.decode(ids[:-1]).endswith("\ufffd") else [
        *ids, *ours.encode_ordinary("🙂")[:1]]  # ends inside a character
    shown = []
    stream = TextStream(ours)
    for token in cut:
        shown.append(stream.add([token]))
    shown.append(stream.finish())
    assert "".join(shown) == ours.decode(cut, skip_special_tokens=True)
    assert "".join(shown).endswith("\ufffd")


def test_a_vocabulary_without_added_tokens_imports_and_generates(tmp_path, capsys):
    from hf_checkpoints import llama_checkpoint, write_hf

    from minigpt import generate, hub

    bare = _byte_level_bpe(pt.ByteLevel(add_prefix_space=False), vocab_size=400)
    config, weights = llama_checkpoint(L=1, V=bare.get_vocab_size())
    directory = write_hf(tmp_path / "hf", config, weights)
    bare.save(str(directory / "tokenizer.json"))
    assert hub.main(["import", str(directory), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert generate.main(["--run", str(tmp_path / "run"), "--prompt", "Once upon",
                          "--max-new-tokens", "8", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Once upon") and len(out) > len("Once upon\n")


# --- the zoo's vocabularies as tokenizer.json (minigpt.hub.tokenizer_export) -------------------

EDGES = ["", " ", "   ", "\n", "'s 'll 'VE", "a  b   c\n\n\n  d", "hello\r\n\r\n  world  ",
         "a<|endoftext|>b <|endoftext|>", "<|endoftext|>"]


def mixed_texts(seed: int, count: int) -> list[str]:
    """Words of the torture text recombined with random whitespace, and random code points:
    merges fire, and every split rule meets every neighbour."""
    rng = random.Random(seed)
    words = TORTURE.split()
    gaps = [" ", "  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "", " 7", "42 ", "\u3000"]
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x4E00, 0x4FFF),
              (0x1F300, 0x1F64F), (0x660, 0x669), (0x2000, 0x206F), (0x30, 0x39)]
    out = []
    for _ in range(count):
        parts = [rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(1, 12))]
        noise = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 9)))
        out.append("".join(parts) + noise)
    return out


def assert_same_ids(tokenizer: Tokenizer, enc, cases: list[str]) -> None:
    for text in cases:
        ids = tokenizer.encode(text).ids
        assert enc.encode(text, allowed_special="all") == ids, text
        assert enc.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_token_str_is_the_byte_level_alphabet():
    assert {hf_export.token_str(bytes([b])) for b in range(256)} == set(
        pt.ByteLevel.alphabet())
    text = "Café 🙂\t\n x"
    pieces = pt.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert [p for p, _ in pieces] == [hf_export.token_str(text.encode())]


def test_bpe_merges_the_lowest_priority_first_and_leftmost_on_ties():
    priority = {("a", "b"): 1, ("b", "c"): 0, ("c", "d"): 0, ("ab", "cd"): 5}
    assert hf_export.bpe(list("abcd"), lambda x, y: priority.get((x, y))) == ["a", "bc", "d"]
    assert hf_export.bpe(list("abab"), lambda x, y: priority.get((x, y))) == ["ab", "ab"]


def gpt2_files() -> tuple[Path, Path]:
    """GPT-2's real encoder.json and vocab.bpe (Hugging Face's vocab.json and merges.txt)."""
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    cache = Path(os.environ.get("TIKTOKEN_CACHE_DIR", "/nonexistent"))
    paths = tuple(cache / hashlib.sha1((base + name).encode()).hexdigest()
                  for name in ("encoder.json", "vocab.bpe"))
    if not all(p.is_file() for p in paths):
        pytest.skip("GPT-2's BPE files are not in the tiktoken cache (TIKTOKEN_CACHE_DIR)")
    return paths


def test_gpt2_exported_from_tiktoken_is_hugging_faces_gpt2(gpt2, tmp_path, assets_dir):
    out = hf_export.write_hf_tokenizer(gpt2, tmp_path / "gpt2-hf", model_max_length=1024)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    stories = sorted((assets_dir / "tinystories").glob("*.txt"))
    sample = [stories[0].read_text(encoding="utf-8")[:100_000]] if stories else []
    assert_same_ids(tokenizer, gpt2, EDGES + texts([]) + mixed_texts(4, 300) + sample)
    vocab_json, merges_txt = gpt2_files()
    assert json.loads((out / "vocab.json").read_text()) == json.loads(
        vocab_json.read_text(encoding="utf-8"))
    lines = [(out / "merges.txt").read_text(encoding="utf-8").splitlines(),
             merges_txt.read_text(encoding="utf-8").splitlines()]
    assert lines[0] == [line for line in lines[1] if line] and len(lines[0]) == 50001
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 1024 and config["eos_token"] == "<|endoftext|>"
    assert config["bos_token"] == "<|endoftext|>" and not config["clean_up_tokenization_spaces"]
    assert json.loads((out / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


def test_the_shipped_vocabulary_exports_with_its_gpt2_files(tmp_path):
    enc = load_tokenizer("tinystories-4k")
    out = hf_export.write_hf_tokenizer(enc, tmp_path / "hf", model_max_length=256)
    cases = EDGES + texts([]) + mixed_texts(6, 200)
    assert_same_ids(Tokenizer.from_file(str(out / "tokenizer.json")), enc, cases)
    # GPT2Tokenizer's files: vocab.json, merges.txt and GPT-2's own split.
    gpt2_style = Tokenizer(models.BPE.from_file(str(out / "vocab.json"), str(out / "merges.txt")))
    gpt2_style.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    gpt2_style.decoder = decoders.ByteLevel()
    gpt2_style.add_special_tokens(["<|endoftext|>"])
    assert_same_ids(gpt2_style, enc, cases)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256
    # and minigpt reads the export back as an imported tokenizer, with its end token
    back = HFTokenizer(out)
    assert back.stop_tokens == (enc.eot_token,) and back.bos_token is None
    assert [back.encode_ordinary(t) for t in cases] == [  # specials in the text are specials
        enc.encode(t, allowed_special="all") for t in cases]
    with pytest.raises(TokenizerError, match="eos_token '<eos>' is not a special token"):
        hf_export.write_hf_tokenizer(enc, tmp_path / "bad", model_max_length=256,
                                     eos_token="<eos>")


@pytest.mark.parametrize("first, split", [(b"ab", (b"ab", b"c")), (b"bc", (b"a", b"bc"))])
def test_merges_are_the_last_bpe_step_when_a_token_splits_two_ways(first, split):
    # "abc" is both "ab"+"c" and "a"+"bc"; BPE makes whichever pair is ranked first.
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({first: 256, ({b"ab", b"bc"} - {first}).pop(): 257, b"abc": 258})
    assert hf_export.recover_merges(ranks)[-1] == split
    enc = Encoding("abc", pattern=PATTERN, ranks=ranks, special_tokens={"<|endoftext|>": 259})
    tokenizer = Tokenizer.from_str(json.dumps(hf_export.tokenizer_json_from_encoding(enc)))
    assert_same_ids(tokenizer, enc, ["abc", "abcabc", "xabc", "zabcd", "ab bc abcbc", "cab"])


def test_ranks_that_are_not_merges_have_no_tokenizer_json():
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256}  # no "ab" nor "bc"
    with pytest.raises(TokenizerError, match="is not a merge of two lower-ranked tokens"):
        hf_export.recover_merges(ranks)
