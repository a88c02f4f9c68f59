"""Hostile and broken inputs, fed to every command as a user would: a checkpoint downloaded from
someone else, a file damaged in transit, a typo in a number, a leftover directory.

Each refusal must be exit status 2 with one line naming the offending thing, no traceback, and the
file system exactly as it was (every file's hash, and every directory, before and after). Inputs
that are benign get a clean, documented success instead. The safetensors and index readers have
their own generated cases in tests/test_safetensors_untrusted.py.
"""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import small_vocab
from hf_checkpoints import llama_checkpoint, write_hf

from minigpt import data, generate, hub, train
from minigpt.config import TrainConfig

# The vocabulary is no matter here: TinyStories' 4,096 tokens keep the run's steps small.
MODEL = small_vocab("minigpt-tiny")
COMMANDS = {"train": train.main, "generate": generate.main, "hub": hub.main, "data": data.main}


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root`, files with the sha256 of their bytes."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                       if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


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


def refuses(capsys, tmp_path, command: str, args: list[str], message: str) -> str:
    """Run a command that must refuse; returns its one line."""
    before = snapshot(tmp_path)
    code = COMMANDS[command](args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err + captured.out
    assert message in err, err
    assert snapshot(tmp_path) == before
    return err


# --- numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "train.lr must be a finite number, got inf"),
    (["--lr", "nan"], "train.lr must be a finite number, got nan"),
    (["--set", "train.muon_lr=nan"], "train.muon_lr must be a finite number"),
    (["--set", "train.weight_decay=-1"], "train.weight_decay >= 0"),
    (["--set", "model.dropout=nan"], "model.dropout must be a finite number"),
    (["--seed", "-1"], "train.seed must be in [0, 2^32)"),
    (["--set", "train.time_budget=inf"], "train.time_budget must be a finite number"),
])
def test_invalid_numbers_are_refused_before_anything_runs(data_dir, tmp_path, capsys, args,
                                                          message):
    refuses(capsys, tmp_path, "train", ["--model", "minigpt-tiny", "--data", str(data_dir),
                                        "--out", str(tmp_path / "new"), "--steps", "1", *args],
            message)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "need a finite temperature"),
    (["--temperature", "-1"], "need a finite temperature"),
    (["--top-p", "nan"], "0 < top_p <= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens >= 1"),
    (["--seed", "-3"], "0 <= --seed < 2^32"),
])
def test_invalid_sampling_is_refused(run, tmp_path, capsys, args, message):
    refuses(capsys, tmp_path, "generate", ["--run", str(run), *args], message)


def test_a_top_k_past_the_vocabulary_samples_from_all_of_it(run, capsys):
    """Benign: a top-k of the vocabulary size or more keeps every token (the help says so)."""
    assert generate.main(["--run", str(run), "--top-k", "999999", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")


# --- files of the wrong shape ---------------------------------------------------------------

def test_a_recipe_value_of_the_wrong_type_names_it(data_dir, tmp_path, capsys):
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[model]\nname = "minigpt-tiny"\nnum_layers = "three"\n\n[train]\n')
    refuses(capsys, tmp_path, "train", ["--recipe", str(recipe), "--data", str(data_dir),
                                        "--out", str(tmp_path / "new")],
            f"recipe {recipe}: model.num_layers must be an integer, got 'three'")


@pytest.mark.parametrize("command", ["train", "generate", "export"])
def test_a_run_config_that_is_a_list_is_refused(run, tmp_path, capsys, command):
    (run / "config.json").write_text("[1, 2, 3]")
    args = {"train": ["train", ["--out", str(run), "--resume"]],
            "generate": ["generate", ["--run", str(run)]],
            "export": ["hub", ["export", "--run", str(run), "--out", str(tmp_path / "hf")]]}
    name, argv = args[command]
    refuses(capsys, tmp_path, name, argv, "is not a minigpt run config")


@pytest.mark.parametrize("command", ["train", "import", "export"])
def test_out_naming_an_existing_file_is_refused(run, checkpoint, tmp_path, capsys, command,
                                                data_dir):
    target = tmp_path / "taken"
    target.write_text("mine")
    argv = {"train": ["train", ["--model", "minigpt-tiny", "--data", str(data_dir), "--out",
                                str(target)]],
            "import": ["hub", ["import", str(checkpoint), "--out", str(target)]],
            "export": ["hub", ["export", "--run", str(run), "--out", str(target)]]}
    name, args = argv[command]
    refuses(capsys, tmp_path, name, args, "is a file")


def test_init_from_a_file_is_refused(data_dir, tmp_path, capsys):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"\0" * 64)
    refuses(capsys, tmp_path, "train", ["--init-from", str(source), "--data", str(data_dir),
                                        "--out", str(tmp_path / "new")],
            "is not a run directory")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_init_from_unreadable_checkpoints_writes_nothing(run, data_4k, tmp_path, capsys):
    rng = np.random.default_rng(0)
    for path in (run / "checkpoints").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(rng.bytes(path.stat().st_size))
    refuses(capsys, tmp_path, "train", ["--init-from", str(run), "--data", str(data_4k),
                                        "--steps", "1", "--out", str(tmp_path / "new")],
            "can be read")
    assert not (tmp_path / "new").exists()


# --- leftovers in a run directory -----------------------------------------------------------

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
    refuses(capsys, tmp_path, "train", ["--out", str(run), "--resume", "--steps", "3"], message)


# --- Hugging Face folders -------------------------------------------------------------------

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
    err = refuses(capsys, tmp_path, "hub", ["import", str(checkpoint), "--out",
                                            str(tmp_path / "run")], message)
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


def test_data_of_a_file_that_is_not_there_is_refused(tmp_path, capsys):
    refuses(capsys, tmp_path, "data", ["prepare", "--text", str(tmp_path / "missing.txt"),
                                       "--out", str(tmp_path / "data")], "no such file")


def test_the_trainer_checks_configs_made_in_python_too():
    with pytest.raises(Exception, match="train.lr must be a finite number"):
        dataclasses.replace(TrainConfig(), lr=float("nan"))
