"""Hostile and damaged run folders and checkpoints, fed to every command as a user would: a run
directory someone edited (its config.json), a leftover file where a run keeps a folder, a
checkpoint damaged in transit, a Hugging Face folder downloaded from someone else (its
config.json, safetensors, index and tokenizer files), a run whose tokenizer does not fit its
model, links, read-only folders, a full disk. Each hostile case sits beside one that must work.

The rule: a refusal is exit status 2 with one `error:` line naming the file and the field, no
traceback, and nothing written (every file's hash, and every directory, in the test's folder
and in the runs it reads, as before); a damaged checkpoint that can be passed over is, with a
one-line warning. Most refusals come before JAX compiles anything. The runs they need are made
once: `trained` (minigpt-tiny trained two steps, a checkpoint at each, copied as `run`),
conftest's `wordpiece_run` (a tiny imported Llama with a WordPiece tokenizer), and `untrained`
(its weights as a training run at step 0, copied as `llama_run`). The safetensors and index
readers have their own generated cases in tests/test_safetensors_untrusted.py. The full disk is
a real one (a small tmpfs; the test is skipped where this process may not mount one), as is the
read-only run (a read-only bind mount).
"""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import refused, small_vocab, snapshot, write_synthetic_stories
from hf_checkpoints import llama_checkpoint, write_hf
from tiny_llama import TEMPLATE, D, L, V, hf_folder

from minigpt import generate, hub, train
from minigpt.config import TrainConfig
from minigpt.tokenizer import HFTokenizer

COMMANDS = {"train": train.main, "generate": generate.main, "hub": hub.main}


# The vocabulary is no matter here: TinyStories' 4,096 tokens keep the run's steps small.
MODEL = small_vocab("minigpt-tiny")


@pytest.fixture(scope="module")
def trained(data_4k, tmp_path_factory) -> Path:
    """A minigpt-tiny run (TinyStories' vocabulary) of two steps with a checkpoint at each."""
    out = tmp_path_factory.mktemp("trained") / "run"
    cfg = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(data_4k),), out=str(out),
                      steps=2, batch_size=8, seq_len=32, eval_every=100, eval_batches=1,
                      save_every=1)
    train.train(MODEL, cfg, sample=False)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run this test may damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny Hugging Face Llama checkpoint this test may damage."""
    config, tensors = llama_checkpoint(L=2)
    return write_hf(tmp_path / "hf", config, tensors, tokenizer="tinystories-4k")


@pytest.fixture(scope="module")
def llama_trained(wordpiece_run, tmp_path_factory) -> Path:
    """Two steps of llama-tiny with the WordPiece tokenizer, a checkpoint at each. (Its config
    names the tokenizer by a path outside the run, so every copy of the run has the same
    config, and resuming copies compiles once.)"""
    root = tmp_path_factory.mktemp("trained")
    stories = write_synthetic_stories(root / "stories.txt", copies=60)
    assert train.main(["--model", "llama-tiny", "--tokenizer", str(wordpiece_run / "tokenizer"),
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
def untrained(wordpiece_run, tmp_path_factory) -> Path:
    """The WordPiece Llama's weights as a training run at step 0 (config.json with a train
    section, its checkpoint without optimizer state): enough for every refusal that comes
    before weights are restored, at no cost of training."""
    out = Path(shutil.copytree(wordpiece_run, tmp_path_factory.mktemp("untrained") / "run"))
    config = json.loads((out / "config.json").read_text())
    train_cfg = dataclasses.asdict(TrainConfig(model="llama-tiny", steps=2, batch_size=8,
                                               seq_len=32, out=str(out)))
    (out / "config.json").write_text(json.dumps({**config, "train": train_cfg}))
    return out


@pytest.fixture
def llama_run(untrained, scratch) -> Path:
    """A copy of `untrained` this test may damage."""
    return Path(shutil.copytree(untrained, scratch / "run"))


@pytest.fixture
def llama_trained_copy(llama_trained, scratch) -> Path:
    """A copy of `llama_trained` this test may damage."""
    return Path(shutil.copytree(llama_trained, scratch / "run"))


# --- a minigpt run folder: config.json, --out, --init-from, checkpoints -------------------------

@pytest.mark.parametrize("command", ["train", "generate", "export"])
def test_a_run_config_that_is_a_list_is_refused(run, tmp_path, capsys, command):
    (run / "config.json").write_text("[1, 2, 3]")
    args = {"train": ["train", ["--out", str(run), "--resume"]],
            "generate": ["generate", ["--run", str(run)]],
            "export": ["hub", ["export", "--run", str(run), "--out", str(tmp_path / "hf")]]}
    name, argv = args[command]
    before = snapshot(tmp_path)
    refused(capsys, COMMANDS[name](argv), "is not a minigpt run config", unchanged=before)


@pytest.mark.parametrize("command", ["train", "import", "export"])
def test_out_naming_an_existing_file_is_refused(run, checkpoint, tmp_path, capsys, command,
                                                data_4k):
    target = tmp_path / "taken"
    target.write_text("mine")
    argv = {"train": ["train", ["--model", "minigpt-tiny", "--data", str(data_4k), "--out",
                                str(target)]],
            "import": ["hub", ["import", str(checkpoint), "--out", str(target)]],
            "export": ["hub", ["export", "--run", str(run), "--out", str(target)]]}
    name, args = argv[command]
    before = snapshot(tmp_path)
    refused(capsys, COMMANDS[name](args), "is a file", unchanged=before)


def test_init_from_a_file_is_refused(data_4k, tmp_path, capsys):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"\0" * 64)
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--init-from", str(source), "--data", str(data_4k), "--out",
                                str(tmp_path / "new")]),
            "is not a run directory", unchanged=before)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_init_from_unreadable_checkpoints_writes_nothing(run, data_4k, tmp_path, capsys):
    rng = np.random.default_rng(0)
    for path in (run / "checkpoints").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(rng.bytes(path.stat().st_size))
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--init-from", str(run), "--data", str(data_4k), "--steps", "1",
                                "--out", str(tmp_path / "new")]),
            "can be read", unchanged=before)
    assert not (tmp_path / "new").exists()


def test_a_tokenizer_larger_than_the_table_is_refused_at_init_from(run, data_4k, gpt2, tmp_path,
                                                                   capsys):
    """A config.json naming GPT-2's 50,257 ids over a 4,096-row table: --init-from once trained
    on ids past the table, diverged, and blamed the learning rate."""
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": {**config["model"],
                                                                     "tokenizer": "gpt2"}}))
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--init-from", str(run), "--data", str(data_4k), "--steps", "1",
                                "--out", str(tmp_path / "new")]),
            "tokenizer 'gpt2' has 50,257 tokens but the model's table has 4,096 rows",
            unchanged=before)


@pytest.mark.parametrize("leftover, message", [
    ("lock directory", "trainer.lock is not a file, so it is not a lock minigpt wrote"),
    ("lock list", "does not hold what a minigpt trainer writes"),
    ("tensorboard file", "tensorboard should be a folder of the run"),
    ("checkpoints file", "checkpoints should be a folder of the run"),
])
def test_leftovers_are_refused_and_left_as_they_are(run, tmp_path, capsys, leftover, message):
    if leftover == "lock directory":
        (run / "trainer.lock").mkdir()
        (run / "trainer.lock" / "notes.txt").write_text("mine")
    elif leftover == "lock list":
        (run / "trainer.lock").write_text("[1, 2]")
    elif leftover == "tensorboard file":
        shutil.rmtree(run / "tensorboard")
        (run / "tensorboard").write_text("not a folder")
    else:
        shutil.rmtree(run / "checkpoints")
        (run / "checkpoints").write_text("not a folder")
    before = snapshot(tmp_path)
    refused(capsys, train.main(["--out", str(run), "--resume", "--steps", "3"]), message,
            unchanged=before)


# --- warnings are one line ------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_export_of_a_damaged_latest_checkpoint_falls_back_with_a_one_line_warning(
        run, tmp_path, capsys):
    rng = np.random.default_rng(0)
    for path in (run / "checkpoints" / "2").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(rng.bytes(path.stat().st_size))
    capsys.readouterr()
    assert hub.main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 2  # minigpt
    capsys.readouterr()
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["arch"] == "minigpt"  # no Hugging Face class: the export refuses it
    generate_args = ["--run", str(run), "--max-new-tokens", "2"]
    assert generate.main(generate_args) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: checkpoint 2 of") and err.count("\n") == 1


def test_a_torn_metrics_line_warns_in_one_line_on_resume(run, capsys):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    assert train.main(["--out", str(run), "--resume", "--steps", "3", "--no-sample"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings and "not a complete record" in warnings[0]
    assert "warnings.warn" not in err and "UserWarning" not in err


# --- a minigpt run's config.json, typed ---------------------------------------------------------

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
def test_a_run_config_is_typed_before_use(llama_run, capsys, change, message, command):
    _edit(llama_run, **change)
    args = (["--run", str(llama_run), "--max-new-tokens", "2"] if command == "generate"
            else ["--out", str(llama_run), "--resume", "--steps", "3"])
    before = snapshot(llama_run)
    refused(capsys, COMMANDS[command](args), message, unchanged=before)


def test_adapters_of_no_projection_are_refused_where_weights_are_loaded(llama_run, capsys):
    """(A resumed run trains the adapters its own train config names; generate, export and
    --init-from read the recorded ones.)"""
    _edit(llama_run, adapters={"rank": 4, "alpha": 8, "targets": ["nope"]})
    before = snapshot(llama_run)
    refused(capsys, generate.main(["--run", str(llama_run)]), "train.lora_targets nope",
            unchanged=before)


def test_fields_a_run_does_not_read_are_kept(llama_run):
    from minigpt.runs import RunDir

    _edit(llama_run, notes={"mine": [1, 2]})
    assert RunDir(llama_run).read().record["notes"] == {"mine": [1, 2]}


# --- Hugging Face folders: config.json, safetensors, index ------------------------------------

def _edit_config(checkpoint: Path, **changes) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("change, message", [
    ("list", "config.json is not a JSON object"),
    ("zero heads", "num_attention_heads = 0: expected a positive integer"),
    ("string width", 'hidden_size = "64": expected a positive integer'),
    ("overlapping", "share bytes"),
    ("outside index", "not a path relative to the model folder"),
])
def test_a_broken_or_hostile_checkpoint_is_refused(checkpoint, tmp_path, capsys, change,
                                                   message):
    if change == "list":
        (checkpoint / "config.json").write_text("[]")
    elif change == "zero heads":
        _edit_config(checkpoint, num_attention_heads=0)
    elif change == "string width":
        _edit_config(checkpoint, hidden_size="64")
    elif change == "overlapping":
        _overlap_two_tensors(checkpoint / "model.safetensors")
    else:
        secret = tmp_path / "secret.safetensors"
        secret.write_bytes((checkpoint / "model.safetensors").read_bytes())
        names = json.loads((checkpoint / "model.safetensors").read_bytes()[8:][
            :int.from_bytes((checkpoint / "model.safetensors").read_bytes()[:8], "little")])
        weight_map = {name: "../secret.safetensors" for name in names if name != "__metadata__"}
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": weight_map}))
    before = snapshot(tmp_path)
    err = refused(capsys, hub.main(["import", str(checkpoint), "--out", str(tmp_path / "run")]),
                  message, unchanged=before)
    assert str((tmp_path / "secret.safetensors").stat().st_size if change == "outside index"
               else "no secret") not in err.replace(str(tmp_path), "")


def _overlap_two_tensors(path: Path) -> None:
    """Rewrite a safetensors header so that its second tensor's bytes start inside the first's,
    the rest of the file kept byte for byte."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    entries = sorted((k for k in header if k != "__metadata__"),
                     key=lambda k: header[k]["data_offsets"][0])
    first, second = entries[0], entries[1]
    begin, end = header[second]["data_offsets"]
    shift = (end - begin) // 2 if header[first]["data_offsets"][1] == begin else 0
    header[second]["data_offsets"] = [begin - max(shift, 4), end - max(shift, 4)]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text)) if len(text) <= length else b""
    assert len(text) == length, "the test needs the new header to fit the old one's length"
    path.write_bytes(raw[:8] + text + raw[8 + length:])


@pytest.mark.parametrize("change, message", [
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings = "false": expected true or false'),
    ({"attention_bias": 0}, "attention_bias = 0: expected true or false"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5: expected a positive integer"),
    ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps = "1e-5": expected a positive number'),
    ({"hidden_size": 10**9}, "has shape [256, 64], but config.json implies [256, 1000000000]"),
    ({"eos_token_id": "2"}, "eos_token_id must be an integer, got '2'"),
])
def test_a_checkpoint_config_is_typed_before_use(tmp_path, capsys, change, message):
    hf = hf_folder(tmp_path / "hf", config=change)
    before = snapshot(tmp_path)
    err = refused(capsys, hub.main(["import", str(hf), "--out", str(tmp_path / "run")]),
                  message, unchanged=before)
    assert "config.json" in err


@pytest.mark.parametrize("same", [True, False], ids=["equal head", "different head"])
def test_a_tied_config_beside_its_own_head_imports_as_transformers_loads_it(tmp_path, same):
    """transformers 5 ties only where the file's lm_head.weight equals the embedding; a
    different one is kept (its tie_weights warns and leaves them apart)."""
    _, weights = llama_checkpoint(D=D, N=8, K=2, F=96, L=L, V=V)
    head = weights["model.embed_tokens.weight"] if same else weights["lm_head.weight"]
    hf = hf_folder(tmp_path / "hf", config={"tie_word_embeddings": True},
                   tensors={"lm_head.weight": head})
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["tie_embeddings"] is same


@pytest.mark.slow
def test_a_tied_config_with_a_different_head_gives_transformers_logits(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is the [hf] extra")
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    from minigpt.runs import load_run

    hf = hf_folder(tmp_path / "hf", config={"tie_word_embeddings": True})
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
    hf = hf_folder(tmp_path / "hf", files=files)
    before = snapshot(tmp_path)
    refused(capsys, hub.main(["import", str(hf), "--out", str(tmp_path / "run")]), message,
            str(hf), unchanged=before)


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
    tok = HFTokenizer(hf_folder(tmp_path / "hf", kind, files=files))
    assert tok.stop_tokens == stops and tok.chat_template == TEMPLATE
    ids = tok.encode_ordinary("once upon a time there was a cat")
    assert tok.decode(ids).replace(" ", "") == "onceuponatimetherewasacat"


def test_a_unigram_checkpoint_imports(tmp_path):
    """(The WordPiece one is `wordpiece_run`, which tells stories below.)"""
    hf = hf_folder(tmp_path / "hf", "unigram")
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()


def test_a_wordpiece_checkpoint_tells_the_greedy_story_at_tiny_temperatures(wordpiece_run,
                                                                            capsys):
    told = []
    for temperature in ("0", "1e-40"):
        assert generate.main(["--run", str(wordpiece_run), "--prompt", "once upon a time",
                              "--max-new-tokens", "4", "--temperature", temperature]) == 0
        told.append(capsys.readouterr().out)
    assert told[0] == told[1] and told[0].startswith("once upon a time")


@pytest.mark.slow
def test_generation_under_a_context_parallel_preset(wordpiece_run, capsys):
    assert generate.main(["--run", str(wordpiece_run), "--prompt", "once upon a time",
                          "--preset", "cp", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    cp = capsys.readouterr().out
    assert generate.main(["--run", str(wordpiece_run), "--prompt", "once upon a time",
                          "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert cp == capsys.readouterr().out


# --- faults while writing ---------------------------------------------------------------------

def _mounted(*command: str) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0


def _resumes(run: Path, *more: str) -> None:
    """The run trains on, from its latest checkpoint (as it was before the fault)."""
    assert train.main(["--out", str(run), "--resume", "--steps", "3", "--no-sample",
                       *more]) == 0
    assert (run / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize("linked", ["checkpoints", "a step"])
def test_a_checkpoints_link_is_refused_naming_where_it_points(llama_run, tmp_path, capsys,
                                                              linked):
    """(A linked step would be read through, then deleted where it points when old
    checkpoints are pruned: refused before training, as the linked folder is.)"""
    outside = tmp_path / "elsewhere"
    folder = llama_run / "checkpoints"
    if linked == "a step":
        folder = max((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    folder.rename(outside)
    folder.symlink_to(outside)
    before = snapshot(llama_run, outside)
    refused(capsys, train.main(["--out", str(llama_run), "--resume", "--steps", "3"]),
            f"{folder.name} is a link (to {outside})", "Replace the link with the folder",
            unchanged=before)


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
def test_a_read_only_run_is_refused_in_one_line(llama_run, capsys, folder, message):
    """A read-only bind mount of the run or its checkpoints (where this process may mount
    one)."""
    if not _read_only(llama_run / folder):
        pytest.skip("a read-only bind mount needs root")
    try:
        before = snapshot(llama_run)
        refused(capsys, train.main(["--out", str(llama_run), "--resume", "--steps", "3"]),
                "Read-only file system", message, unchanged=before)
    finally:
        subprocess.run(["umount", str(llama_run / folder)], check=True)


def test_a_garbage_lock_is_taken_over_saying_so(tmp_path):
    from minigpt.train.lock import hold_run_lock

    (tmp_path / "trainer.lock").write_bytes(b"\x00\xffnot a lock at all")
    said = []
    with hold_run_lock(tmp_path, say=said.append):
        assert json.loads((tmp_path / "trainer.lock").read_text())["pid"] > 0
    assert said == [f"took over {tmp_path / 'trainer.lock'}: it held no lock a trainer could "
                    f"read (garbage, or a trainer stopped while writing it)"]


@pytest.mark.slow
def test_after_a_link_a_read_only_mount_or_a_garbage_lock_the_run_resumes(llama_trained_copy,
                                                                          tmp_path, capsys):
    run = llama_trained_copy
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
def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_resumes(llama_trained, scratch,
                                                                        capsys):
    """A real full disk: a tmpfs holding the run and room for less than one more checkpoint
    (where this process may mount one)."""
    trained = llama_trained
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
