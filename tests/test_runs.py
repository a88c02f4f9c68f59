"""The run directory (minigpt.runs): config.json written atomically and read back, damaged or
foreign files refused clearly, runs written by earlier versions read as they were, and a run's
latest weights loaded as one object."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from minigpt.config import ModelConfig, TrainConfig
from minigpt.runs import RunDir, RunError, load_run


def test_run_config_round_trips_and_leaves_no_temporary_file(tmp_path):
    model, train = ModelConfig(num_layers=3), TrainConfig(steps=9, data=("x.txt",))
    RunDir(tmp_path).write(model, train, preset="dp", tokenizer="gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    saved = RunDir(tmp_path).read()
    assert saved.model == model and saved.train == train and saved.record["preset"] == "dp"
    RunDir(tmp_path).write(model, None, imported={"source": "somewhere"})
    assert RunDir(tmp_path).read().train is None
    assert RunDir(tmp_path).read().imported == {"source": "somewhere"}


def test_damaged_missing_and_foreign_run_configs_are_refused(tmp_path):
    with pytest.raises(RunError, match="is this a minigpt run directory"):
        RunDir(tmp_path).read()
    (tmp_path / "config.json").write_text('{"model": {"arch": "minigpt"')
    with pytest.raises(RunError, match="not valid JSON.*damaged"):
        RunDir(tmp_path).read()
    (tmp_path / "config.json").write_text(json.dumps(
        {"model": {**dataclasses.asdict(ModelConfig()), "wings": 2}}))
    with pytest.raises(RunError, match=r"unknown ModelConfig fields \['wings'\]"):
        RunDir(tmp_path).read()


def test_a_config_json_without_newer_fields_still_loads(tmp_path):
    values = dataclasses.asdict(ModelConfig())
    del values["kernels"]  # written before the field existed
    (tmp_path / "config.json").write_text(json.dumps({"model": values, "train": {}}))
    saved = RunDir(tmp_path).read()
    # Runs from before documents were kept apart trained without: they go on as they were.
    assert saved.model.kernels == "auto" and saved.train == TrainConfig(document_mask=False)


def test_a_run_from_before_models_named_their_tokenizer_keeps_the_data_tokenizer(tmp_path):
    values = dataclasses.asdict(ModelConfig(vocab_size=4096))
    del values["tokenizer"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": values, "train": {}, "tokenizer": "tinystories-4k"}))
    assert RunDir(tmp_path).read().model.tokenizer == "tinystories-4k"
    path.write_text(json.dumps({"model": values, "train": {}}))  # older still: GPT-2's
    assert RunDir(tmp_path).read().model.tokenizer == "gpt2"


def test_a_run_from_before_families_kept_their_own_settings_loads_and_generates(tmp_path,
                                                                               capsys):
    """Until families kept their own settings in a section of config.json (`"gemma3":
    {...}`), Gemma 3's sat among the shared fields: such a run loads with them and generates
    what the same weights in today's layout generate."""
    from conftest import untrained_run

    from minigpt import generate
    from minigpt.models import get_config

    cfg = get_config("gemma3-tiny")  # a query scale and local base other than the defaults
    new = untrained_run(tmp_path / "new", cfg)
    old = tmp_path / "old"
    shutil.copytree(new, old)
    saved = json.loads((old / "config.json").read_text())
    assert saved["model"]["gemma3"] == {"query_pre_attn_scalar": 16.0, "local_rope_theta": 1e4}
    saved["model"].update(saved["model"].pop("gemma3"))
    (old / "config.json").write_text(json.dumps(saved))
    assert RunDir(old).read().model == cfg
    stories = []
    for run in (new, old):
        capsys.readouterr()
        assert generate.main(["--run", str(run), "--max-new-tokens", "8", "--seed", "1",
                              "--prompt", "Once upon a time"]) == 0
        stories.append(capsys.readouterr().out)
    assert stories[0] == stories[1] and stories[0].startswith("Once upon a time")


def test_a_run_directory_names_its_files(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.path == tmp_path / "run"
    assert [p.name for p in (run.config_file, run.checkpoints, run.metrics, run.tensorboard,
                             run.loss_plot, run.lock, run.damaged)] == [
        "config.json", "checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "trainer.lock",
        "damaged-checkpoints"]
    assert not run.has_checkpoints()


def test_loading_a_directory_that_is_not_a_trained_run_says_what_to_do(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        load_run(tmp_path / "nowhere")
    RunDir(tmp_path).write(ModelConfig(), TrainConfig())
    with pytest.raises(RunError, match="holds no checkpoints/ directory: train it first"):
        load_run(tmp_path)


def test_a_run_imported_by_an_earlier_version_still_generates_exports_and_seeds_runs(
        tmp_path, capsys):
    """Earlier versions converted an imported tokenizer into `vocabulary.tiktoken` (ranks, with
    its split regex and special tokens in `vocabulary.json`) and named it in config.json: such a
    run keeps generating, exporting and starting new runs."""
    from hf_checkpoints import llama_checkpoint, write_hf

    from minigpt import generate, hub
    from minigpt.ranks import write_ranks
    from minigpt.tokenizer import PATTERN, load_tokenizer

    config, tensors = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, tensors, tokenizer="tinystories-4k")
    run = tmp_path / "old"
    assert hub.main(["import", str(hf), "--out", str(run)]) == 0
    shutil.rmtree(run / "tokenizer")  # the previous format: a converted vocabulary instead
    write_ranks(load_tokenizer("tinystories-4k").ranks, run / "vocabulary.tiktoken",
                {"vocab_size": 4096, "special_tokens": {"<|endoftext|>": 4095},
                 "pat_str": PATTERN, "source": {"file": "tokenizer.json"},
                 "converted_by": "minigpt.hf_tokenizer.save_as_tiktoken"})
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["tokenizer"] = "vocabulary.tiktoken"
    (run / "config.json").write_text(json.dumps(saved))
    loaded = load_run(run)
    assert loaded.tokenizer.encode_ordinary("Once upon a time") == load_tokenizer(
        "tinystories-4k").encode_ordinary("Once upon a time")
    capsys.readouterr()
    assert generate.main(["--run", str(run), "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")
    assert hub.main(["export", "--run", str(run), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())[
        "eos_token_id"] == 4095
    new = RunDir(tmp_path / "new")
    from minigpt.runs import keep_vocabulary
    kept = keep_vocabulary(str((run / "vocabulary.tiktoken").absolute()), run, new.path)
    assert Path(kept).read_bytes() == (run / "vocabulary.tiktoken").read_bytes()
