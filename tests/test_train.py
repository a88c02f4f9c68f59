"""The trainer: loss falls, exact resume, resume under another preset, Ctrl-C, metrics, CLI.

The tiny model trains here with the TinyStories vocabulary (its output layer a twelfth of
GPT-2's), every run of one shape, so the module compiles its train step once. One uninterrupted
run (`finished`) is checked for its files and metrics and is what every resumed or interrupted
run of its configuration must reproduce. The command line tells its story once with GPT-2's
tokenizer, the default.
"""

import dataclasses
import json
import math
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import losses, refused, small_vocab, tensorboard_scalars

import minigpt
from minigpt import generate, train
from minigpt.config import TrainConfig
from minigpt.models import execution
from minigpt.optim import lr_schedule, steps
from minigpt.train import metrics

MODEL = small_vocab("minigpt-tiny")


def short_run(data: Path, out: Path) -> TrainConfig:
    """A short run of the tiny model: 8 sequences of 32 tokens a step on 8 devices."""
    return TrainConfig(preset="fsdp", model="minigpt-tiny", data=(str(data),), out=str(out),
                       steps=6, decay_steps=6, batch_size=8, seq_len=32, lr=3e-3,
                       warmup_steps=2, eval_every=3, eval_batches=2, save_every=3, log_every=1)


@pytest.fixture
def config(data_4k, tmp_path) -> TrainConfig:
    return short_run(data_4k, tmp_path / "run")


@pytest.fixture(scope="module")
def finished(data_4k, tmp_path_factory) -> tuple[TrainConfig, dict]:
    """The short run, uninterrupted, trained once for the module: (its config, its summary).
    Tests read it, refuse to change it, or copy it."""
    config = short_run(data_4k, tmp_path_factory.mktemp("finished") / "run")
    return config, train.train(MODEL, config, sample=False)


def contents(directory) -> dict[str, bytes]:
    """Every file under a directory, with its bytes."""
    return {str(p): p.read_bytes() for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def test_a_run_writes_its_directory_and_honest_metrics(finished):
    config, summary = finished
    out = Path(config.out)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json", "loss.png",
                                                     "metrics.jsonl", "tensorboard"]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [3, 6]
    saved = json.loads((out / "config.json").read_text())
    as_json = json.loads(json.dumps(MODEL.as_dict()))  # tuples are lists there
    assert saved["model"] == as_json and saved["preset"] == "fsdp"
    assert saved["tokenizer"] == "tinystories-4k"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    rates = lr_schedule.lr_schedule(config)
    for r in train_records:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["lr"] == pytest.approx(float(rates(r["step"] - 1)))
    assert "tokens_per_s" not in train_records[0]  # the first step includes compilation
    for r in train_records[1:]:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard shows the same numbers: every metric at every step it was logged at.
    board = tensorboard_scalars(out / "tensorboard")
    for key, tag in metrics.TENSORBOARD_TAGS.items():
        logged = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records if key in r]
        assert board[tag] == logged, tag


def test_a_resumed_run_continues_its_tensorboard_curves_without_repeating_steps(finished,
                                                                                 config):
    shutil.copytree(finished[0].out, config.out)
    checkpoints = Path(config.out) / "checkpoints"
    shutil.rmtree(checkpoints / "6")  # killed after step 6 was logged, before it was saved
    train.train(MODEL, config, resume=True, sample=False)
    board = tensorboard_scalars(Path(config.out) / "tensorboard")
    assert [step for step, _ in board["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in board["train/loss"]] == pytest.approx(losses(config.out))


def test_loss_falls_on_tinystories(config):
    cfg = dataclasses.replace(config, steps=40, decay_steps=40, eval_every=40, save_every=40,
                              warmup_steps=5)
    train.train(MODEL, cfg, sample=False)
    seen = losses(Path(cfg.out))
    # Measured falls, seeds 0-2 (2026-11-28): 1.90, 1.93, 1.98 nats reading shards in their
    # keyed order; 2.06, 1.85, 2.01 in the order of the one-file layout before them. The 2.0
    # this asserted before sat inside that spread; 1.75 is below all six.
    assert np.mean(seen[-5:]) < np.mean(seen[:5]) - 1.75


def test_resume_continues_exactly(finished, config):
    half = dataclasses.replace(config, steps=3)
    train.train(MODEL, half, sample=False)
    summary = train.train(MODEL, dataclasses.replace(half, steps=6), resume=True, sample=False)
    assert summary["step"] == 6
    assert losses(config.out) == losses(finished[0].out)  # bitwise: same preset


# The presets whose steps run other code than fsdp's: a pipeline's schedule (its microbatches
# and stages), the ring of context parallelism, experts dispatched by all-to-all. A run resumed
# under the same preset gives the uninterrupted run's losses bit for bit under each too.
BITWISE = [("dp_pp", "minigpt-tiny"), ("cp", "minigpt-tiny"), ("ep", "moe-tiny")]


@pytest.mark.slow
@pytest.mark.parametrize("preset, model", BITWISE, ids=[p for p, _ in BITWISE])
def test_resume_continues_exactly_under_the_pipeline_context_and_expert_presets(
        preset, model, data_4k, tmp_path, straight):
    cfg = small_vocab(model, dropout=0.1)
    run = dataclasses.replace(short_run(data_4k, tmp_path / "run"), preset=preset, model=model,
                              batch_size=16)
    uninterrupted = straight(cfg, run)
    train.train(cfg, dataclasses.replace(run, steps=3), sample=False)
    train.train(cfg, dataclasses.replace(run, steps=6), resume=True, sample=False)
    assert losses(run.out) == uninterrupted  # bitwise


@pytest.mark.slow  # tests/test_checkpoint.py restores a checkpoint into another preset's layout
def test_resume_under_another_preset(finished, config):
    half = dataclasses.replace(config, steps=3)
    train.train(MODEL, half, sample=False)
    train.train(MODEL, dataclasses.replace(half, steps=6, preset="dp_tp"), resume=True,
                sample=False)
    np.testing.assert_allclose(losses(config.out), losses(finished[0].out), rtol=1e-5)


def test_ctrl_c_saves_a_checkpoint_and_resume_matches(finished, config, tmp_path, monkeypatch):
    calls = []
    real_step = steps.train_step

    def interrupting_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(steps, "train_step", interrupting_step)
    interrupted = dataclasses.replace(config, out=str(tmp_path / "stopped"))
    summary = train.train(MODEL, interrupted, sample=False)
    assert summary["interrupted"] and summary["step"] == 2
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["2"]
    monkeypatch.setattr(steps, "train_step", real_step)
    train.train(MODEL, interrupted, resume=True, sample=False)
    assert losses(tmp_path / "stopped") == losses(finished[0].out)


def test_cli_trains_then_generate_tells_a_story(data_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    code = train.main(["--preset", "dp", "--model", "minigpt-tiny", "--data", str(data_dir),
                       "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--out", str(out),
                       "--set", "eval_batches=1", "--set", "warmup_steps=1", "--set",
                       "keep_checkpoints=1", "--save-every", "1"])
    assert code == 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["2"]  # keeps the last one
    printed = capsys.readouterr().out
    assert f"checkpoint: {out.absolute() / 'checkpoints' / '2'}" in printed
    assert "sample:\nOnce upon a time" in printed
    # Samples are printed whole, each decoded from its tokens: the prompt comes back out of
    # GPT-2's encoding as it went in. (Streaming, which prints the prompt as given, is told in
    # tests/test_recipes.py and tests/test_recovery.py.)
    assert generate.main(["--run", str(out), "--max-new-tokens", "5", "--num-samples", "2",
                          "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("--- sample") == 2
    assert printed.count(" (step 2) ---\nOnce upon a time") == 2
    # A prompt the model cannot take is refused before anything is printed.
    err = refused(capsys, generate.main(["--run", str(out), "--prompt", "word " * 200]),
                  quiet=True)
    assert err.startswith("error: the prompt has ")


def test_a_profile_range_past_the_last_step_still_closes_its_trace(config):
    config = dataclasses.replace(config, steps=2, profile_steps="1:50")
    assert train.train(MODEL, config, sample=False)["step"] == 2
    # where TensorBoard's profile plugin looks: <logdir>/plugins/profile/<run>/*.xplane.pb
    assert list((Path(config.out) / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_cli_refuses_to_resume_with_another_model(finished, capsys):
    out = finished[0].out
    before = contents(out)
    code = train.main(["--out", out, "--resume", "--set", "model.mlp_dim=256",
                       "--set", "num_layers=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "mlp_dim: 128 -> 256" in err and "num_layers: 2 -> 3" in err
    assert contents(out) == before


def test_cli_refuses_to_overwrite_a_run(finished, capsys):
    out = finished[0].out
    before = contents(out)
    assert train.main(["--out", out, "--model", "minigpt-tiny"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert contents(out) == before


@pytest.mark.parametrize("args, message", [
    (["--preset", "zero3"], "unknown preset 'zero3'"),
    (["--preset", "dp", "--batch-size", "12"], "multiple of 8"),
    (["--set", "num_heads=7"], "divisible by model.num_heads (7)"),
    (["--set", "colour=blue"], "unknown field 'colour'"),
    (["--seq-len", "512"], "exceeds the model's context 128"),
])
def test_cli_reports_user_errors_in_one_line(data_4k, tmp_path, capsys, args, message):
    code = train.main(["--model", "minigpt-tiny", "--tokenizer", "tinystories-4k", "--data",
                       str(data_4k), "--out", str(tmp_path / "bad"), "--steps", "1",
                       "--batch-size", "8", *args])
    refused(capsys, code, message)
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.parametrize("name, scan", [
    # tests/test_recipes.py trains llama-tiny and generates from it in the default run
    pytest.param("gpt2-tiny", False, marks=pytest.mark.slow),
    pytest.param("llama-tiny", True, marks=pytest.mark.slow),
])
def test_every_architecture_trains_resumes_and_tells_stories(config, tmp_path, name, scan):
    model = small_vocab(name, scan_layers=scan)
    first = dataclasses.replace(config, model=name, preset="fsdp_tp", steps=2, decay_steps=4,
                                eval_every=2, save_every=2)
    train.train(model, first, sample=False)
    summary = train.train(model, dataclasses.replace(first, preset="dp", steps=4), resume=True,
                          sample=False)
    assert summary["step"] == 4 and len(losses(tmp_path / "run")) == 4
    run = minigpt.load_run(tmp_path / "run")
    restored, tokenizer, preset, mesh, step = (run.model, run.tokenizer, run.preset, run.mesh,
                                               run.step)
    # The run keeps what was asked and what it resolved to: the model comes back with its
    # execution settings concrete for this backend (no "auto" left), the rest as trained.
    assert step == 4 and restored.config == execution.for_backend(model)
    assert restored.config.dtype == "float32" and model.dtype == "auto"
    from minigpt import sharding

    with sharding.Layout(preset, mesh).active():
        story = generate.generate(restored, tokenizer, ["Once upon a time"], max_new_tokens=5,
                                  temperature=0.0)[0]
    assert story.startswith("Once upon a time") and len(story) > len("Once upon a time")
