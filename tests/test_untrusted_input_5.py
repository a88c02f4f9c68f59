"""Hostile and mistaken inputs, round 5: adapters, checkpoint configs, tokenizer configs, chat
templates, a run's own files, faults while writing, and values that pass a type check but mean
nothing. Each hostile case sits beside one that must work.

A refusal is exit status 2 with one line naming the file and the field, no traceback, and the
file system as it was (every file's hash, in the test's folder and in the shared runs). Most
refusals happen before JAX compiles anything; the runs they need are made once per module: a
tiny Llama checkpoint with a WordPiece tokenizer (`base`, imported) and a run trained from it
for two steps (`trained`). The full disk is a real one (a small tmpfs; the test is skipped
where this process may not mount one), as is the read-only run (a read-only bind mount).
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import write_synthetic_stories
from hf_checkpoints import llama_checkpoint, write_hf

from minigpt import chat_template, generate, hub, train
from minigpt.config import TrainConfig
from minigpt.hub import adapter_config, peft
from minigpt.hub.configs import model_config
from minigpt.hub.safetensors import encode
from minigpt.tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from minigpt.train import metrics

COMMANDS = {"train": train.main, "generate": generate.main, "hub": hub.main}
V, D, L = 256, 64, 1  # the tiny Llama: vocabulary, width, layers
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}"
            "{% generation %}{{ m.content }}[SEP]{% endgeneration %}{% else %}{{ m.content }}"
            "[SEP]{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ["Once upon a time there was a little cat named Tom who liked to play.",
        "One day Lily went to the park with her mom and saw a big dog.",
        "Ben had a toy car and he drove it around the house all day long."] * 40


def snapshot(*roots: Path) -> dict[str, str]:
    """Every path under the roots, files with the sha256 of their bytes."""
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for root in roots for p in sorted(Path(root).rglob("*"))}


def refuses(capsys, roots, command: str, args: list[str], *messages: str) -> str:
    """Run a command that must refuse: exit 2, one line with each message, no traceback, every
    file under `roots` as it was. Returns the line."""
    before = snapshot(*roots)
    code = COMMANDS[command](args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err + captured.out
    for message in messages:
        assert message in err, err
    assert snapshot(*roots) == before
    return err


def tokenizer(kind: str):
    """A WordPiece (BERT's layout) or Unigram (SentencePiece's) tokenizer of at most V ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pt

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pt.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=V - 8, show_progress=False,
                                            special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pt.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=V - 8, show_progress=False, unk_token="<unk>",
                                          special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXT, trainer)
    return tok


def checkpoint(directory: Path, kind: str = "wordpiece", *, config=None, tensors=None,
               files=None) -> Path:
    """A tiny Llama in the Hugging Face layout with its tokenizer and configs; `config`
    changes config.json, `files` adds (or, with None, removes) files."""
    hf_config, weights = llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)
    write_hf(directory, {**hf_config, **(config or {})}, {**weights, **(tensors or {})})
    tokenizer(kind).save(str(directory / "tokenizer.json"))
    end = "[SEP]" if kind == "wordpiece" else "</s>"
    defaults = {"tokenizer_config.json": {"eos_token": end, "unk_token": "[UNK]"},
                "chat_template.jinja": TEMPLATE}
    for name, content in {**defaults, **(files or {})}.items():
        path = directory / name
        if content is None:
            path.unlink(missing_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny Llama with a WordPiece tokenizer, imported: a run at step 0."""
    root = tmp_path_factory.mktemp("base")
    hf = checkpoint(root / "hf", files={"generation_config.json": {"eos_token_id": [2, 3]}})
    assert hub.main(["import", str(hf), "--out", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory) -> Path:
    """Two steps of llama-tiny with the base's WordPiece tokenizer, a checkpoint at each. (Its
    config names the tokenizer by a path outside the run, so every copy of the run has the
    same config, and resuming copies compiles once.)"""
    root = tmp_path_factory.mktemp("trained")
    stories = write_synthetic_stories(root / "stories.txt", copies=60)
    assert train.main(["--model", "llama-tiny", "--tokenizer", str(base / "tokenizer"),
                       "--data", str(stories),
                       "--out", str(root / "run"), "--steps", "2", "--batch-size", "8",
                       "--seq-len", "32", "--save-every", "1", "--eval-every", "100",
                       "--no-sample", "--set", f"train.data_root={root / 'data'}",
                       "--set", "eval_batches=1"]) == 0
    return root / "run"


@pytest.fixture
def scratch(tmp_path_factory) -> Path:
    """One folder for the copies tests damage, the same path each time: a model's config
    names its tokenizer by path, so copies at one path share one compilation."""
    folder = tmp_path_factory.getbasetemp() / "scratch"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def untrained(base, tmp_path_factory) -> Path:
    """The base's weights as a training run at step 0 (config.json with a train section, its
    checkpoint without optimizer state): enough for every refusal that comes before weights
    are restored, at no cost of training."""
    out = Path(shutil.copytree(base, tmp_path_factory.mktemp("untrained") / "run"))
    config = json.loads((out / "config.json").read_text())
    train_cfg = dataclasses.asdict(TrainConfig(model="llama-tiny", steps=2, batch_size=8,
                                               seq_len=32, out=str(out)))
    (out / "config.json").write_text(json.dumps({**config, "train": train_cfg}))
    return out


@pytest.fixture
def run(untrained, scratch) -> Path:
    """A copy of `untrained` this test may damage."""
    return Path(shutil.copytree(untrained, scratch / "run"))


@pytest.fixture
def trained_copy(trained, scratch) -> Path:
    """A copy of the trained run this test may damage."""
    return Path(shutil.copytree(trained, scratch / "run"))


# --- adapter_config.json (PEFT) ---------------------------------------------------------------

def adapter(directory: Path, **config) -> Path:
    """A PEFT adapter folder for `base`: rank-4 adapters on q_proj and v_proj, described by an
    adapter_config.json with `config`'s changes ("INF" becomes the JSON number 1e999)."""
    r = 4
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(L):
        for name, out in (("q_proj", 64), ("v_proj", 16)):
            module = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{module}.lora_A.weight"] = rng.standard_normal((r, D), np.float32)
            tensors[f"{module}.lora_B.weight"] = rng.standard_normal((out, r), np.float32)
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(b"".join(encode(tensors)))
    values = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "use_dora": False,
              "base_model_name_or_path": None, **config}
    text = json.dumps({k: v for k, v in values.items() if v is not ...})
    (directory / "adapter_config.json").write_text(text.replace('"INF"', "1e999"))
    return directory


@pytest.mark.parametrize("config, message", [
    ({"lora_alpha": "INF"}, "lora_alpha must be a finite number, got inf"),
    ({"lora_alpha": "16"}, "lora_alpha must be a finite number, got '16'"),
    ({"lora_alpha": 1e308}, "scales each adapter's output by 2.5e+307, over the 10000"),
    ({"r": 0}, "needs r > 0 (got 0)"),
    ({"r": "4"}, "r must be an integer, got '4'"),
    ({"lora_dropout": 1.5}, "lora_dropout in [0, 1)"),
    ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
    ({"layer_replication": [[0, 1]]}, "layer_replication"),
    ({"trainable_token_indices": [5]}, "trained token embeddings"),
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "a bias on lora_B"),
    ({"rank_pattern": {"q_proj": 8}}, "a rank per module"),
    ({"peft_type": "IA3"}, 'peft_type "IA3"'),
    ({"task_type": "SEQ_CLS"}, 'task_type "SEQ_CLS"'),
    ({"init_lora_weights": "pissa"}, "changes the base weights"),
    ({"use_future_trick": True}, "use_future_trick = true, a field minigpt does not know"),
    ({"target_modules": ".*q_proj"}, "not a regular expression"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "adapts embed_tokens, which"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}, "made for 'meta-llama/Llama-3"),
    ({"base_model_name_or_path": 7}, "base_model_name_or_path must be str, got 7"),
])
def test_an_adapter_config_is_checked_field_by_field(base, tmp_path, capsys, config, message):
    folder = adapter(tmp_path / "adapter", **config)
    args = ["import", str(folder), "--base", str(base), "--out", str(tmp_path / "new")]
    refuses(capsys, [tmp_path, base], "hub", args, message, "adapter_config.json")
    assert not (tmp_path / "new").exists()


def test_a_rank_of_a_billion_is_refused_from_the_header_before_anything_is_allocated(
        base, tmp_path, capsys):
    folder = adapter(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 10**9}))
    refuses(capsys, [tmp_path, base], "hub", ["import", str(folder), "--base", str(base),
                                              "--out", str(tmp_path / "new")],
            "needs float [1000000000, 64]", "its r is wrong")


def test_a_plain_adapter_imports_and_says_how_its_base_was_matched(base, tmp_path, capsys):
    """Valid: unknown fields left unset, rsLoRA, and a base named by the checkpoint's folder
    name from elsewhere (matched by name and shapes, and said so)."""
    folder = adapter(tmp_path / "adapter", use_rslora=True, use_future_trick=None,
                     base_model_name_or_path="someone/hf")
    assert hub.main(["import", str(folder), "--base", str(base), "--out",
                     str(tmp_path / "new")]) == 0
    assert "matched by folder name and tensor shapes only" in capsys.readouterr().err
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert saved["adapters"]["rank"] == 4 and saved["adapters"]["alpha"] == pytest.approx(16.0)
    assert saved["imported"]["base_matched_by"] == "folder name and shapes"


@pytest.mark.parametrize("targets, ours", [
    ("all-linear", ("down", "gate", "key", "out", "query", "up", "value")),  # not the head
    (["q_proj", "lm_head"], ("output", "query")),
    (["self_attn.q_proj", "model.layers.0.mlp.up_proj"], ("query", "up")),  # 1 layer: all
])
def test_target_modules_name_projections_as_peft_matches_them(tmp_path, targets, ours):
    cfg = model_config(llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)[0])
    adapters, config = peft.read_config(adapter(tmp_path / "a", target_modules=targets), cfg)
    assert adapters.targets == ours and isinstance(config, adapter_config.AdapterConfig)


# --- a checkpoint's config.json ---------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings = "false": expected true or false'),
    ({"attention_bias": 0}, "attention_bias = 0: expected true or false"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5: expected a positive integer"),
    ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps = "1e-5": expected a positive number'),
    ({"hidden_size": 10**9}, "has shape [256, 64], but config.json implies [256, 1000000000]"),
    ({"eos_token_id": "2"}, "eos_token_id must be an integer, got '2'"),
])
def test_a_checkpoint_config_is_typed_before_use(tmp_path, capsys, change, message):
    hf = checkpoint(tmp_path / "hf", config=change)
    err = refuses(capsys, [tmp_path], "hub", ["import", str(hf), "--out", str(tmp_path / "run")],
                  message)
    assert "config.json" in err


@pytest.mark.parametrize("same", [True, False], ids=["equal head", "different head"])
def test_a_tied_config_beside_its_own_head_imports_as_transformers_loads_it(tmp_path, same):
    """transformers 5 ties only where the file's lm_head.weight equals the embedding; a
    different one is kept (its tie_weights warns and leaves them apart)."""
    _, weights = llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)
    head = weights["model.embed_tokens.weight"] if same else weights["lm_head.weight"]
    hf = checkpoint(tmp_path / "hf", config={"tie_word_embeddings": True},
                    tensors={"lm_head.weight": head})
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["tie_embeddings"] is same


@pytest.mark.slow
def test_a_tied_config_with_a_different_head_gives_transformers_logits(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is the [hf] extra")
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    from minigpt.runs import load_run

    hf = checkpoint(tmp_path / "hf", config={"tie_word_embeddings": True})
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    ids = np.random.default_rng(0).integers(0, V, size=(8, 12))  # a row per device
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf)(
            torch.tensor(ids)).logits.numpy()
    loaded = load_run(tmp_path / "run")
    with loaded.layout.active():
        ours = np.asarray(loaded.model(ids.astype(np.int32)))[..., :V]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


# --- tokenizer files: generation_config.json, tokenizer_config.json, the template -----------

@pytest.mark.parametrize("files, message", [
    ({"generation_config.json": {"eos_token_id": 10**9}}, "names 1000000000, which is not a "),
    ({"generation_config.json": {"eos_token_id": True}}, "eos_token_id must be an integer"),
    ({"generation_config.json": {"eos_token_id": [2, "3"]}}, "must be a list of integers"),
    ({"generation_config.json": {"bos_token_id": "x"}}, "bos_token_id must be an integer"),
    ({"tokenizer_config.json": {"eos_token": 7}}, "eos_token must be a token's text"),
    ({"tokenizer_config.json": {"chat_template": 5}, "chat_template.jinja": None},
     "chat_template must be a template"),
    ({"chat_template.jinja": b"{{ messages }}\xff\xfe"}, "is not UTF-8 text"),
    ({"generation_config.json": b"\xff{}"}, "is not UTF-8 text"),
    ({"generation_config.json": "[" * 100_000}, "nested too deeply"),
])
def test_tokenizer_files_are_typed_at_import(tmp_path, capsys, files, message):
    hf = checkpoint(tmp_path / "hf", files=files)
    refuses(capsys, [tmp_path], "hub", ["import", str(hf), "--out", str(tmp_path / "run")],
            message, str(hf))


@pytest.mark.parametrize("kind, files, stops", [
    ("wordpiece", {"generation_config.json": {"eos_token_id": 2}}, (2,)),
    ("wordpiece", {"generation_config.json": {"eos_token_id": [3, 2, 3]}}, (3, 2)),
    ("wordpiece", {"generation_config.json": None}, (2,)),  # tokenizer_config's name: [SEP]
    ("unigram", {"generation_config.json": {"eos_token_id": [2], "bos_token_id": None}}, (2,)),
    ("unigram", {"tokenizer_config.json": {"chat_template": [{"name": "default",
                                                              "template": TEMPLATE}]},
                 "chat_template.jinja": None}, (2,)),
])
def test_odd_but_valid_tokenizer_files_load(tmp_path, kind, files, stops):
    tok = HFTokenizer(checkpoint(tmp_path / "hf", kind, files=files))
    assert tok.stop_tokens == stops and tok.chat_template == TEMPLATE
    ids = tok.encode_ordinary("once upon a time there was a cat")
    assert tok.decode(ids).replace(" ", "") == "onceuponatimetherewasacat"


def test_a_unigram_checkpoint_imports(tmp_path):
    """(The WordPiece one is `base`, which tells stories below.)"""
    hf = checkpoint(tmp_path / "hf", "unigram")
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()


# --- templates, bounded ------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]


def test_generation_spans_are_where_transformers_puts_them(base):
    tok = HFTokenizer(base / "tokenizer")
    rendered = tok.render_chat_with_spans(MESSAGES)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["hello[SEP]", "yes[SEP]"]
    with contextlib.suppress(ImportError):
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template([MESSAGES], chat_template=TEMPLATE,
                                             return_assistant_tokens_mask=True, eos_token="[SEP]")
        assert (rendered.text, list(rendered.spans)) == (texts[0], spans[0])


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "did not finish rendering within 0.5 s"),
    ("{% for i in range(100000) %}{{ 'x' * 1200 }}{% endfor %}", "renders more than 4,096"),
    ("{{ 'x' * 10**12 }}", "needs more than the 1 GiB"),
])
def test_a_template_is_rendered_under_time_memory_and_length_limits(template, message):
    with pytest.raises(chat_template.RenderError, match=message) as refused:
        chat_template.render(template, MESSAGES, add_generation_prompt=True, max_chars=4096,
                             seconds=0.5)
    assert "\n" not in str(refused.value)
    # and the renderer goes on serving the next template
    assert chat_template.render("{{ messages[0].content }}", MESSAGES,
                                add_generation_prompt=False).text == "hi"


def test_chat_refusals_are_one_line_before_anything_compiles(base, tmp_path, capsys,
                                                             monkeypatch):
    chat = ["--run", str(base), "--chat"]
    refuses(capsys, [base], "generate", [*chat, ""], "--chat needs a message")
    refuses(capsys, [base], "generate", [*chat, "  \n"], "it is empty")
    # a message too long for the context, whatever the template does with it
    err = refuses(capsys, [base], "generate", [*chat, "once " * 1000],
                  "the chat's messages hold 5,000 characters, more than a context of 128 tokens")
    assert "template" not in err
    run = Path(shutil.copytree(base, tmp_path / "run"))
    monkeypatch.setattr(chat_template, "SECONDS", 0.5)
    for template, message in (
            (b"\xff\xfe{{ x }}", "not UTF-8"),
            (b"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "did not finish rendering within 0.5 s"),
            (b"{% for i in range(100000) %}{{ 'x' * 1200 }}{% endfor %}",
             f"renders more than {128 * chat_template.CHARS_PER_TOKEN:,} characters")):
        (run / "tokenizer" / "chat_template.jinja").write_bytes(template)
        load_tokenizer.cache_clear()  # read the template afresh
        refuses(capsys, [tmp_path], "generate", ["--run", str(run), "--chat", "hi"], message)


def test_a_wordpiece_checkpoint_tells_the_greedy_story_at_tiny_temperatures(base, capsys):
    told = []
    for temperature in ("0", "1e-40"):
        assert generate.main(["--run", str(base), "--prompt", "once upon a time",
                              "--max-new-tokens", "4", "--temperature", temperature]) == 0
        told.append(capsys.readouterr().out)
    assert told[0] == told[1] and told[0].startswith("once upon a time")


# --- a run's own config.json -------------------------------------------------------------------

def _edit(run: Path, **sections) -> None:
    config = json.loads((run / "config.json").read_text())
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (run / "config.json").write_text(json.dumps(config).replace('"NAN"', "NaN"))


@pytest.mark.parametrize("change, message", [
    ({"adapters": {"rank": 0, "alpha": 8, "targets": ["query"]}}, "adapters need a rank > 0"),
    ({"adapters": {"rank": "4", "alpha": 8, "targets": ["query"]}},
     "adapters.rank must be an integer"),
    ({"adapters": {"rank": 4, "alpha": "NAN", "targets": ["query"]}},
     "adapters.alpha must be a finite number, got nan"),
    ({"adapters": {"rank": 4, "alpha": 1e308, "targets": ["query"]}},
     "adapters.alpha = 1e+308 with rank 4 scales each adapter's output by 2.5e+307"),
    ({"adapters": [4]}, "adapters must be an object"),
    ({"devices": {"count": "8"}}, "devices.count must be an integer"),
    ({"time_budget": {"seconds": "soon"}}, "time_budget.seconds must be a finite number"),
    ({"model": {"embed_dim": 2**28}}, "more than a device here has"),
    ({"model": {"embed_dim": 2**28}}, "width 268435456"),
    ({"model": {"tie_embeddings": "false"}}, "model.tie_embeddings must be true or false"),
])
@pytest.mark.parametrize("command", ["generate", "train"])
def test_a_run_config_is_typed_before_use(run, capsys, change, message, command):
    _edit(run, **change)
    args = (["--run", str(run), "--max-new-tokens", "2"] if command == "generate"
            else ["--out", str(run), "--resume", "--steps", "3"])
    refuses(capsys, [run], command, args, message)


def test_adapters_of_no_projection_are_refused_where_weights_are_loaded(run, capsys):
    """(A resumed run trains the adapters its own train config names; generate, export and
    --init-from read the recorded ones.)"""
    _edit(run, adapters={"rank": 4, "alpha": 8, "targets": ["nope"]})
    refuses(capsys, [run], "generate", ["--run", str(run)], "train.lora_targets nope")


def test_fields_a_run_does_not_read_are_kept(run):
    from minigpt.runs import RunDir

    _edit(run, notes={"mine": [1, 2]})
    assert RunDir(run).read().record["notes"] == {"mine": [1, 2]}


# --- faults while writing ---------------------------------------------------------------------

def _mounted(*command: str) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0


def _resumes(run: Path, *more: str) -> None:
    """The run trains on, from its latest checkpoint (as it was before the fault)."""
    assert train.main(["--out", str(run), "--resume", "--steps", "3", "--no-sample",
                       *more]) == 0
    assert (run / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize("linked", ["checkpoints", "a step"])
def test_a_checkpoints_link_is_refused_naming_where_it_points(run, tmp_path, capsys, linked):
    """(A linked step would be read through, then deleted where it points when old
    checkpoints are pruned: refused before training, as the linked folder is.)"""
    outside = tmp_path / "elsewhere"
    folder = run / "checkpoints"
    if linked == "a step":
        folder = max((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    folder.rename(outside)
    folder.symlink_to(outside)
    refuses(capsys, [run, outside], "train", ["--out", str(run), "--resume", "--steps", "3"],
            f"{folder.name} is a link (to {outside})", "Replace the link with the folder")


def _read_only(folder: Path) -> bool:
    if _mounted("mount", "--bind", str(folder), str(folder)):
        if _mounted("mount", "-o", "remount,ro,bind", str(folder)):
            return True
        subprocess.run(["umount", str(folder)], capture_output=True)
    return False


@pytest.mark.parametrize("folder, message", [
    ("", "a run is trained in a directory it may write"),
    # (Orbax, meeting it mid-save, waited 300 s and printed 9 tracebacks after the one line)
    ("checkpoints", "the run saves its checkpoints there; make it writable")])
def test_a_read_only_run_is_refused_in_one_line(run, capsys, folder, message):
    """A read-only bind mount of the run or its checkpoints (where this process may mount
    one)."""
    if not _read_only(run / folder):
        pytest.skip("a read-only bind mount needs root")
    try:
        refuses(capsys, [run], "train", ["--out", str(run), "--resume", "--steps", "3"],
                "Read-only file system", message)
    finally:
        subprocess.run(["umount", str(run / folder)], check=True)


def test_a_garbage_lock_is_taken_over_saying_so(tmp_path):
    from minigpt.train.lock import hold_run_lock

    (tmp_path / "trainer.lock").write_bytes(b"\x00\xffnot a lock at all")
    said = []
    with hold_run_lock(tmp_path, say=said.append):
        assert json.loads((tmp_path / "trainer.lock").read_text())["pid"] > 0
    assert said == [f"took over {tmp_path / 'trainer.lock'}: it held no lock a trainer could "
                    f"read (garbage, or a trainer stopped while writing it)"]


@pytest.mark.slow
def test_after_a_link_a_read_only_mount_or_a_garbage_lock_the_run_resumes(trained_copy,
                                                                          tmp_path, capsys):
    run = trained_copy
    (run / "checkpoints").rename(tmp_path / "elsewhere")
    (run / "checkpoints").symlink_to(tmp_path / "elsewhere")
    assert train.main(["--out", str(run), "--resume", "--steps", "3"]) == 2
    (run / "checkpoints").unlink()
    (tmp_path / "elsewhere").rename(run / "checkpoints")
    if _read_only(run):
        try:
            assert train.main(["--out", str(run), "--resume", "--steps", "3"]) == 2
        finally:
            subprocess.run(["umount", str(run)], check=True)
    (run / "trainer.lock").write_bytes(b"\x00\xffnot a lock at all")
    capsys.readouterr()
    _resumes(run)
    assert "it held no lock a trainer could read" in capsys.readouterr().out


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_resumes(trained, scratch,
                                                                        capsys):
    """A real full disk: a tmpfs holding the run and room for less than one more checkpoint
    (where this process may mount one)."""
    size = sum(p.stat().st_size for p in trained.rglob("*") if p.is_file())
    step = sum(p.stat().st_size for p in (trained / "checkpoints" / "1").rglob("*")
               if p.is_file())
    if not _mounted("mount", "-t", "tmpfs", "-o", f"size={size + step // 2}", "tmpfs",
                    str(scratch)):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        run = Path(shutil.copytree(trained, scratch / "run"))
        before = snapshot(run / "checkpoints")
        code = train.main(["--out", str(run), "--resume", "--steps", "4", "--save-every", "1",
                           "--no-sample"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        # Whichever write meets the full disk first (the checkpoint, metrics.jsonl) is named,
        # on a line of its own (not after the progress bar), with the way on: --resume.
        assert "No space left on device" in lines[0] and "--resume" in lines[0]
        assert err.splitlines()[-1] == lines[0]
        assert {k: v for k, v in snapshot(run / "checkpoints").items() if k in before} == before
        subprocess.run(["mount", "-o", "remount,size=256m", str(scratch)], check=True)
        _resumes(run)
    finally:  # lazily: TensorStore may still hold a file of the run open
        subprocess.run(["umount", "-l", str(scratch)], check=True)


# --- sizes and values that mean nothing ---------------------------------------------------------

@pytest.mark.parametrize("setting, message", [
    ("train.lora_rank=1000000000", "train.lora_rank=1000000000 needs"),
    ("model.embed_dim=1048576", "the model (minigpt, 2 layers of width 1048576) needs"),
])
def test_an_absurd_size_is_refused_before_jax_allocates_it(tmp_path, capsys, setting, message):
    (tmp_path / "stories.txt").write_text(TEXT[0])  # refused before it is read
    refuses(capsys, [tmp_path], "train", ["--model", "minigpt-tiny", "--data",
                                          str(tmp_path / "stories.txt"), "--out",
                                          str(tmp_path / "new"), "--steps", "1",
                                          "--set", setting], message, "more than a device")
    assert not (tmp_path / "new").exists()


def test_a_divergence_names_the_extreme_setting_that_caused_it():
    from minigpt.config import ModelConfig, TrainConfig

    moe = ModelConfig(arch="llama", num_experts=4, router_z_loss_coef=1e30)
    values = {"loss": 3.0, "grad_norm": math.inf, "z_loss": math.inf}
    extreme = metrics.extreme_settings(moe, TrainConfig(), values)
    assert extreme == ["model.router_z_loss_coef 1e+30"]
    message = str(metrics.TrainingDiverged.at(5, values, lr=1e-3, warmup=10, dtype="float32",
                                              out=Path("r"), latest_checkpoint=None,
                                              extreme=extreme))
    assert "likely cause: model.router_z_loss_coef 1e+30" in message and "\n" not in message
    assert "learning rate" not in message
    plain = metrics.extreme_settings(ModelConfig(), TrainConfig(lr=1e-3), values)
    assert plain == []  # a run with ordinary settings: the learning rate is the suspect


@pytest.mark.slow
def test_an_extreme_z_loss_diverges_naming_it(tmp_path, capsys):
    stories = write_synthetic_stories(tmp_path / "s.txt", copies=20)
    code = train.main(["--model", "moe-tiny", "--data", str(stories), "--out", str(tmp_path / "r"),
                       "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--no-sample",
                       "--set", "model.router_z_loss_coef=1e30",
                       "--set", f"train.data_root={tmp_path / 'data'}"])
    err = capsys.readouterr().err
    assert code == 3 and "model.router_z_loss_coef 1e+30" in err, err


@pytest.mark.slow
def test_generation_under_a_context_parallel_preset(base, capsys):
    assert generate.main(["--run", str(base), "--prompt", "once upon a time", "--preset", "cp",
                          "--max-new-tokens", "4", "--temperature", "0"]) == 0
    cp = capsys.readouterr().out
    assert generate.main(["--run", str(base), "--prompt", "once upon a time",
                          "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert cp == capsys.readouterr().out


def test_a_template_error_keeps_its_type_and_first_line(base):
    tok = HFTokenizer(base / "tokenizer")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TokenizerError, match="failed: TemplateError: roles must alternate"):
        tok.render_chat(MESSAGES)
