"""The dense families people download, against transformers itself: Llama 3 (llama3 rope scaling,
tied and untied), Qwen2 / Qwen2.5 / Qwen3, Llama 2 / TinyLlama / Mistral (a sliding window shorter
than the sequences), SmolLM2 and Gemma 3 (local and global layers), each a tiny
random checkpoint written by transformers' own classes and tokenizer converters
(`hf_families`), so its files have the structure the real ones have.

Each is imported under fsdp (8 simulated devices; one family under dp too, dp differing only
in how the weights are laid out, which test_hub.py checks preset by preset) and must give
transformers' logits
(1e-4) and its 20 greedy tokens; the run's tokenizer must give `AutoTokenizer`'s ids on
TinyStories text and on a torture text (with and without the begin token), decoding back to the
text; the export must load with `from_pretrained` with the same logits, ids, end tokens and chat
template. Instruct checkpoints chat as `apply_chat_template` + greedy `generate` do, token for
token, including where the reply stops. Bad input is one line and exit status 2.

Needs the [hf] extra (torch, transformers, sentencepiece); skipped, saying why, without it.
"""

import json
import shutil
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
pytest.importorskip("sentencepiece", reason="sentencepiece (the [hf] extra) trains the Llama 2 "
                                            "style tokenizer")

import hf_families as hf  # noqa: E402
import tokenizer_texts  # noqa: E402
from conftest import refused  # noqa: E402

from minigpt import generate, hub  # noqa: E402
from minigpt.generate import chat, generate_tokens  # noqa: E402
from minigpt.runs import load_run  # noqa: E402

# Logits are compared with transformers' float32 ones: float32 on an accelerator too.
pytestmark = pytest.mark.usefixtures("float32_compute")

# The quick suite runs one family of each tokenizer layout (Llama 3's tiktoken-made file, Qwen's
# NFC byte-level BPE, Llama 2's SentencePiece style) under fsdp; -m slow runs every other family
# under fsdp, and one (tied embeddings, the rotary settings spelled as older files spell them)
# under dp as well: dp differs from fsdp only in where the weights lie, which
# test_hub.py::test_gpt2_import_matches_the_architecture_under_every_preset checks preset by
# preset, so the families need not meet it one by one.
QUICK = {"llama3": "fsdp", "qwen2": "fsdp", "llama2": "fsdp", "gemma3": "fsdp", "olmo2": "dp"}
ALSO_UNDER_DP = ("llama3-tied", "olmo2")
CASES = [pytest.param(family, preset, id=f"{family}-{preset}",
                      marks=() if QUICK.get(family) == preset else pytest.mark.slow)
         for family in hf.FAMILIES
         for preset in (("dp", "fsdp") if family in ALSO_UNDER_DP else ("fsdp",))]
# Llama 3's chat in the quick suite (a template in tokenizer_config.json, bos in the template,
# several end tokens); Qwen's and SmolLM2's ChatML with -m slow.
INSTRUCT = [pytest.param(name, marks=() if name == "llama3-instruct" else pytest.mark.slow)
            for name, family in hf.FAMILIES.items() if family.template]
EXPORTED_AS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM",
               "olmo2": "Olmo2ForCausalLM",
               "olmo3": "Olmo3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "phi4": "Phi3ForCausalLM",
               }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(family)`: that family's checkpoint, written once per module."""
    root, written = tmp_path_factory.mktemp("families"), {}

    def get(name: str) -> hf.Checkpoint:
        if name not in written:
            written[name] = hf.write_family(name, root / name)
        return written[name]

    return get


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory):
    """`imported(family)`: the run its checkpoint imports into under dp, once per module."""
    root, runs = tmp_path_factory.mktemp("runs"), {}

    def get(name: str):
        if name not in runs:
            assert hub.main(["import", str(checkpoint(name).directory), "--out",
                             str(root / name)]) == 0
            runs[name] = root / name
        return runs[name]

    return get


def _theirs(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _ours(loaded, ids) -> np.ndarray:
    with loaded.layout.active():
        logits = nnx.jit(lambda m, t: m(t))(loaded.model, jnp.asarray(ids))
    return np.asarray(logits)[..., :loaded.model.config.vocab_size]


def _as_decoded(checkpoint: hf.Checkpoint, text: str) -> str:
    """The text a tokenizer's ids decode to: Qwen's normalizer composes accents (NFC); Gemma's
    (which only turns spaces into `▁`) leaves them."""
    normalizer = checkpoint.tokenizer.backend_tokenizer.normalizer
    composes = normalizer is not None and "NFC" in json.dumps(
        json.loads(checkpoint.tokenizer.backend_tokenizer.to_str())["normalizer"])
    return unicodedata.normalize("NFC", text) if composes else text


def assert_same_tokenizer(ours, auto, checkpoint: hf.Checkpoint) -> None:
    """`ours` (a run's tokenizer) gives AutoTokenizer's ids, with and without the begin token,
    and decodes them back to the text."""
    for text in tokenizer_texts.texts(checkpoint.specials):
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ours.encode_ordinary(text) == ids, text[:80]
        assert ours.encode_prompt(text) == auto(text)["input_ids"], text[:80]
        assert ours.decode(ids) == auto.decode(ids) == _as_decoded(checkpoint, text), text[:80]
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True)


@pytest.mark.parametrize("family, preset", CASES)
def test_family_imports_generates_and_exports_as_transformers_does(family, preset, checkpoint,
                                                                  tmp_path):
    ck = checkpoint(family)
    run = tmp_path / "run"
    assert hub.main(["import", str(ck.directory), "--out", str(run), "--preset", preset]) == 0
    loaded = load_run(run, preset)
    ours_tok = loaded.tokenizer
    auto = transformers.AutoTokenizer.from_pretrained(ck.directory)

    # the model: logits, and greedy decoding stopping where transformers' stops
    ids = np.random.default_rng(0).integers(0, len(ck.tokenizer), size=(2, 24))
    theirs = _theirs(ck.model, ids)
    np.testing.assert_allclose(_ours(loaded, ids), theirs, rtol=1e-4,
                               atol=1e-4 * np.abs(theirs).max())
    prompt = ours_tok.encode_prompt("Once upon a time, there was a little cat named Tom.")
    assert prompt == auto("Once upon a time, there was a little cat named Tom.")["input_ids"]
    expected = hf.greedy(ck.model, prompt, 20)
    with loaded.layout.active():
        got = generate_tokens(loaded.model, [prompt], max_new_tokens=20, temperature=0.0,
                              stop_ids=ours_tok.stop_tokens, rng=jax.random.key(0))[0]
    stopped = len(expected) < 20 and expected[-1] in ck.stop_ids
    assert got == (expected[:-1] if stopped else expected)

    # the tokenizer: the checkpoint's own, as transformers reads it
    assert ours_tok.stop_tokens == tuple(ck.stop_ids)
    bos = ck.tokenizer.convert_tokens_to_ids(ck.family.bos) if ck.family.bos else None
    adds_bos = bos is not None and auto("a")["input_ids"][:1] == [bos]
    assert ours_tok.bos_token == (bos if adds_bos else None)
    assert adds_bos == family.startswith(("llama3", "llama2", "mistral", "gemma3", "phi3"))
    assert_same_tokenizer(ours_tok, auto, ck)

    # the export: transformers loads it and computes, encodes and stops as the original did
    out = tmp_path / "out"
    assert hub.main(["export", "--run", str(run), "--out", str(out)]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(again).__name__ == EXPORTED_AS.get(family.split("-")[0],
                                                "LlamaForCausalLM")
    np.testing.assert_allclose(_theirs(again, ids), theirs, rtol=1e-5, atol=1e-6)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert_same_tokenizer(ours_tok, exported, ck)
    assert exported.chat_template == ck.tokenizer.chat_template  # None for a base model
    original = json.loads((ck.directory / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        original["bos_token_id"], original["eos_token_id"])
    assert again.generation_config.eos_token_id == ck.model.generation_config.eos_token_id
    assert again.generation_config.bos_token_id == ck.model.generation_config.bos_token_id
    assert hf.greedy(again, prompt, 20) == expected


@pytest.mark.parametrize("family", INSTRUCT)
def test_chat_replies_token_for_token_as_transformers(family, checkpoint, imported, capsys):
    ck, run = checkpoint(family), imported(family)
    capsys.readouterr()  # what importing printed
    # transformers' reply: apply_chat_template, then greedy generate until an end token. The
    # fixture biased the model so that it ends its reply early (hf.make_it_stop); that it does
    # is checked here, so the stop is tested, not assumed.
    reply = hf.greedy(ck.model, hf.chat_prompt(ck), hf.CHAT_TOKENS)
    assert reply[-1] in ck.stop_ids and len(reply) < hf.CHAT_TOKENS
    expected = ck.tokenizer.decode(reply, skip_special_tokens=True)
    assert generate.main(["--run", str(run), "--chat", hf.CHAT_MESSAGE, "--system",
                          hf.CHAT_SYSTEM, "--temperature", "0", "--max-new-tokens",
                          str(hf.CHAT_TOKENS)]) == 0
    assert capsys.readouterr().out == expected + "\n"

    # the Python API takes the messages; without a system message the template adds its own
    loaded = load_run(run)
    for system in (True, False):
        messages = ck.chat_messages(system)
        assert loaded.tokenizer.render_chat(messages) == ck.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
        theirs = hf.greedy(ck.model, hf.chat_prompt(ck, system), hf.CHAT_TOKENS)
        with loaded.layout.active():
            ours = chat(loaded.model, loaded.tokenizer, messages,
                        max_new_tokens=hf.CHAT_TOKENS)
        assert ours == ck.tokenizer.decode(theirs, skip_special_tokens=True)


@pytest.mark.slow
def test_a_family_fine_tunes_from_its_import_on_its_own_tokens(checkpoint, imported, tmp_path,
                                                               small_stories):
    from minigpt.data import load_meta
    from minigpt.train import cli, train

    ck, run = checkpoint("llama3"), imported("llama3")
    new = tmp_path / "tuned"
    assert cli.run(["--init-from", str(run), "--data", str(small_stories), "--preset", "fsdp",
                    "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-9",
                    "--eval-every", "2", "--save-every", "2", "--no-sample", "--out", str(new),
                    "--set", f"train.data_root={tmp_path / 'data'}",
                    "--set", "eval_batches=1"], train) == 0
    # stories were written as <|begin_of_text|> story <|end_of_text|>, in the model's own ids
    meta = load_meta(next((tmp_path / "data").iterdir()))
    bos, eos = ck.tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>"])
    assert (meta["bos_token"], meta["eot_token"]) == (bos, eos)
    # two steps at a learning rate of 1e-9 leave transformers' logits
    ids = np.random.default_rng(1).integers(0, len(ck.tokenizer), size=(2, 24))
    theirs = _theirs(ck.model, ids)
    np.testing.assert_allclose(_ours(load_run(new), ids), theirs, rtol=1e-4,
                               atol=1e-4 * np.abs(theirs).max())


def test_a_run_without_a_chat_template_refuses_chat(imported, capsys):
    run = imported("llama3")
    capsys.readouterr()
    refused(capsys, generate.main(["--run", str(run), "--chat", "hello", "--temperature", "0"]),
            "has no chat template", "--prompt", quiet=True)


def _copy(checkpoint, name, tmp_path):
    return shutil.copytree(checkpoint(name).directory, tmp_path / "hf")


def _edit(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _yarn(directory):
    _edit(directory / "config.json", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 32})


def _unloadable(directory):
    data = json.loads((directory / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "SomethingNew"}
    (directory / "tokenizer.json").write_text(json.dumps(data))


IMPORT_REFUSALS = {
    "yarn": ("qwen2", _yarn, 'rope_type "yarn"'),
    # sliding windows import (Mistral's on every layer, Gemma 3's on five of six); a global
    # layer before the local ones is an order minigpt does not implement
    "window-order": ("gemma3", lambda d: _edit(d / "config.json", layer_types=[
        "full_attention", "sliding_attention"]), "layer_types in an order"),
    "softcap": ("gemma3", lambda d: _edit(d / "config.json", attn_logit_softcapping=50.0),
                "does not cap scores"),
    "qwen-sliding-window": ("qwen2", lambda d: _edit(d / "config.json", use_sliding_window=True,
                                                    sliding_window=32), "use_sliding_window"),
    "tokenizer": ("smollm2", _unloadable, "cannot be read by the tokenizers library"),
    # OLMo 3 7B's YaRN on its full layers: not yet
    "olmo3-yarn": ("olmo3", lambda d: _edit(d / "config.json", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0,
                           "original_max_position_embeddings": 64}}), 'rope_type "yarn"'),
    # the 128k Phi-3 models' LongRoPE: not yet
    "longrope": ("phi3", lambda d: _edit(d / "config.json", rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 1.0,
        "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}), "LongRoPE"),
    # Gemma 3's special token past the rows imports (below); an ordinary one does not
    "ordinary-past-rows": ("gemma3", lambda d: _not_special(d, "<image_soft_token>"),
                           "'<image_soft_token>' (id 501) is ordinary text past the embedding "
                           "rows"),
}


def _not_special(directory, token: str) -> None:
    data = json.loads((directory / "tokenizer.json").read_text())
    for added in data["added_tokens"]:
        added["special"] = added["special"] and added["content"] != token
    (directory / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize("case", IMPORT_REFUSALS)
def test_what_cannot_be_imported_is_refused_in_one_line(case, checkpoint, tmp_path, capsys):
    family, damage, message = IMPORT_REFUSALS[case]
    directory = _copy(checkpoint, family, tmp_path)  # may write it first (transformers' bars)
    damage(directory)
    capsys.readouterr()
    refused(capsys, hub.main(["import", str(directory), "--out", str(tmp_path / "run")]), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no run, no leftovers


def test_a_special_token_past_the_rows_imports_and_text_spelling_it_is_refused(
        checkpoint, imported, tmp_path, capsys):
    """Gemma 3's tokenizers list <image_soft_token> one past the embedding rows (transformers
    issue 37011): the checkpoint imports (its logits, tokens and export are the quick family
    test's), and a prompt or training text spelling the token is refused in one line naming
    it, before anything is written."""
    from minigpt.tokenizer import load_tokenizer
    from minigpt.train import cli, train

    ck, run = checkpoint("gemma3"), imported("gemma3")
    rows = ck.model.config.vocab_size
    assert ck.tokenizer.convert_tokens_to_ids("<image_soft_token>") == rows
    tokenizer = load_tokenizer(str(run / "tokenizer"))
    assert (tokenizer.n_vocab, tokenizer.n_rows) == (rows + 1, rows)
    text = "Once upon a time <image_soft_token> a cat sat."
    capsys.readouterr()
    refused(capsys, generate.main(["--run", str(run), "--prompt", text]),
            f"the text holds <image_soft_token>, token {rows}, a special token past the "
            f"model's {rows:,} embedding rows")
    pytest.importorskip("fastapi", reason="the server is the [serve] extra")
    from fastapi.testclient import TestClient

    from minigpt.serve.api import create_app
    from minigpt.serve.service import Service

    service = Service(engine=None, tokenizer=tokenizer, name="gemma3", context=64,
                      vocab_size=rows, max_batch=1)
    answer = TestClient(create_app(service)).post("/tokenize", json={"prompt": text})
    assert answer.status_code == 400
    assert "<image_soft_token>, token" in answer.json()["error"]["message"]
    stories = tmp_path / "stories.txt"
    stories.write_text(f"{hf.CHAT_MESSAGE}\n\n{text}\n")
    out = tmp_path / "tuned"
    refused(capsys, cli.run(["--init-from", str(run), "--data", str(stories), "--steps", "1",
                             "--out", str(out)], train), "<image_soft_token>, token")
    assert not out.exists()


def test_a_hugging_face_folder_where_a_run_belongs_says_to_import_it(checkpoint, tmp_path,
                                                                    capsys):
    from minigpt.train import cli, train

    directory = _copy(checkpoint, "llama3", tmp_path)
    before = sorted(p.name for p in directory.iterdir())
    capsys.readouterr()  # what writing the checkpoint printed
    refused(capsys, generate.main(["--run", str(directory)]),
            f"python -m minigpt.hub import {directory}")
    out = tmp_path / "tuned"
    refused(capsys, cli.run(["--init-from", str(directory), "--data", "tinystories", "--out",
                             str(out)], train), f"python -m minigpt.hub import {directory}")
    assert not out.exists() and sorted(p.name for p in directory.iterdir()) == before


def test_a_chat_template_that_raises_is_one_line(checkpoint, tmp_path, capsys):
    directory = _copy(checkpoint, "qwen2-instruct", tmp_path)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m.content }}{% endfor %}")
    assert hub.main(["import", str(directory), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    refused(capsys, generate.main(["--run", str(tmp_path / "run"), "--chat", "hi", "--system",
                                   "be nice", "--temperature", "0"]),
            "System role not supported", quiet=True)
