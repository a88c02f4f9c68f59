"""The training command line (`minigpt.cli`): a resumed run accepts the command line that started
it, refuses real differences by name, and extends a finished run as the README says."""

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import losses, small_vocab

from minigpt import train
from minigpt.config import ConfigError, TrainConfig
from minigpt.models import replaced
from minigpt.optim import steps
from minigpt.runs import RunDir
from minigpt.train import cli

pytestmark = pytest.mark.usefixtures("gpt2")


def configs(*argv):
    return cli.resolve_configs(cli.build_parser().parse_args(list(argv)))


PP_COMMAND = ["--preset", "pp", "--model", "minigpt-tiny", "--set", "model.num_layers=8",
              "--set", "model.dropout=0"]
# The TinyStories vocabulary (4,096 tokens) for a command that trains: an output layer a twelfth
# of GPT-2's.
SMALL_VOCAB = ["--set", "model.tokenizer=tinystories-4k", "--set", "model.vocab_size=4096"]


def saved_run(path: Path, *argv: str, **record) -> Path:
    """A run directory whose config.json is what `argv` starts (no training needed to check
    how a resume resolves)."""
    model, cfg = configs(*argv, "--out", str(path))
    path.mkdir()
    RunDir(path).write(model, cfg, preset=cfg.preset, **record)
    return path


def test_the_command_that_started_a_run_resumes_it(tmp_path):
    run = saved_run(tmp_path / "pp", *PP_COMMAND, "--steps", "20")
    model, cfg = configs(*PP_COMMAND, "--steps", "20", "--out", str(run), "--resume")
    saved = json.loads((run / "config.json").read_text())
    assert json.loads(json.dumps(model.as_dict())) == saved["model"]  # lists: tuples
    assert (model.num_layers, model.dropout, cfg.steps, cfg.preset) == (8, 0.0, 20, "pp")
    # Nothing but the run directory works as well, and so do changes of how to go on.
    assert configs("--out", str(run), "--resume")[0] == model
    model, cfg = configs(*PP_COMMAND, "--out", str(run), "--resume", "--preset", "dp",
                         "--steps", "30", "--set", "model.remat=true")
    assert (cfg.preset, cfg.steps, model.remat) == ("dp", 30, True)


def test_a_recipe_run_resumes_with_its_recipe_and_keeps_the_steps_its_budget_fixed(tmp_path):
    run = tmp_path / "stories"
    model, cfg = configs("--recipe", "stories-cpu", "--out", str(run))
    decided = dataclasses.replace(cfg, steps=1363, time_budget=0.0)  # what the budget wrote
    run.mkdir()
    RunDir(run).write(model, decided, preset=cfg.preset,
                    time_budget={"seconds": 600.0, "steps": 1363})
    resumed_model, resumed = configs("--recipe", "stories-cpu", "--out", str(run), "--resume")
    assert resumed_model == model and resumed == decided
    _, resumed = configs("--recipe", "stories-cpu", "--time-budget", "10m", "--out", str(run),
                         "--resume")
    assert resumed == decided
    _, resumed = configs("--recipe", "stories-cpu", "--steps", "2000", "--out", str(run),
                         "--resume")
    assert resumed.steps == 2000 and resumed.time_budget == 0


def test_a_recipe_run_from_before_muon_resumes_with_adamw(tmp_path):
    """stories-cpu now trains 3 layers with a tied output layer, query and key norms and a
    context of 128 at batch 16, with Muon, AdamW at 1e-2 and a 30-step warm-up; a run it started
    with 4 untied layers without the norms, a context of 256 at batch 8, AdamW at 6e-3 and the
    default warm-up (config.json written before the optimizer fields and `qk_norm` existed)
    resumes with all of those, which its checkpoints and schedule hold."""
    run = tmp_path / "stories"
    model, cfg = configs("--recipe", "stories-cpu", "--out", str(run))
    assert (cfg.optimizer, model.num_layers, model.tie_embeddings) == ("muon", 3, True)
    assert (cfg.lr, cfg.warmup_steps, model.context_len, cfg.batch_size) == (1e-2, 30, 128, 16)
    assert model.options.qk_norm
    old_model = replaced(model, num_layers=4, tie_embeddings=False, context_len=256,
                         qk_norm=False)
    run.mkdir()
    RunDir(run).write(old_model,
                    dataclasses.replace(cfg, steps=1363, lr=6e-3, warmup_steps=-1,
                                        batch_size=8),
                    preset=cfg.preset)
    saved = json.loads((run / "config.json").read_text())
    for name in ("optimizer", "muon_lr", "muon_momentum"):
        del saved["train"][name]
    del saved["model"]["tie_embeddings"], saved["model"]["llama"]
    (run / "config.json").write_text(json.dumps(saved))
    resumed_model, resumed = configs("--recipe", "stories-cpu", "--out", str(run), "--resume")
    assert resumed.optimizer == "adamw" and resumed.steps == 1363
    assert (resumed.lr, resumed.warmup_steps, resumed.batch_size) == (6e-3, -1, 8)
    assert resumed_model == old_model
    with pytest.raises(ConfigError, match="optimizer: 'adamw' -> 'muon'"):
        configs("--recipe", "stories-cpu", "--set", "train.optimizer=muon", "--out", str(run),
                "--resume")


def test_a_run_from_before_families_kept_their_own_settings_resumes_with_them(tmp_path):
    """config.json now keeps a family's own settings in its section (`"llama": {"qk_norm":
    true, ...}`); a run written when they sat among the shared fields resumes with them, and
    `--set` names them either way (`model.qk_norm`, `model.llama.qk_norm`)."""
    run = saved_run(tmp_path / "stories", "--recipe", "stories-cpu")
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["llama"] == {"qk_norm": True, "qkv_bias": False, "out_bias": False}
    saved["model"].update(saved["model"].pop("llama"))  # the layout before
    (run / "config.json").write_text(json.dumps(saved))
    model, _ = configs("--recipe", "stories-cpu", "--out", str(run), "--resume")
    assert model == configs("--recipe", "stories-cpu", "--out", str(tmp_path / "new"))[0]
    assert model.options.qk_norm
    for key in ("model.qk_norm", "model.llama.qk_norm"):
        with pytest.raises(ConfigError, match=r"llama.qk_norm: True -> False"):
            configs("--recipe", "stories-cpu", "--out", str(run), "--resume", "--set",
                    f"{key}=false")
    with pytest.raises(ConfigError, match="model.gemma3.local_rope_theta is a gemma3 setting; "
                                          "the llama architecture's own are model.llama.qk_norm"):
        configs("--recipe", "stories-cpu", "--out", str(run), "--resume", "--set",
                "model.gemma3.local_rope_theta=5")


def test_a_recipe_run_keeps_its_schedule_when_the_recipe_changes_it(tmp_path):
    """A run saved before `decay_fraction` existed (a cosine from the warm-up) resumes with that
    cosine, its warm-up and its rate though its recipe has since moved to other ones, so its
    rate does not jump. A --set on the command line still applies."""
    recipe = tmp_path / "laptop.toml"
    text = ('[model]\nname = "llama-cpu"\n\n[train]\ntime_budget = "10m"\nbatch_size = 8\n'
            'lr = 6e-3\n')
    recipe.write_text(text)
    run = tmp_path / "stories"
    model, cfg = configs("--recipe", str(recipe), "--out", str(run))
    run.mkdir()
    RunDir(run).write(model, dataclasses.replace(cfg, steps=1000),
                    preset=cfg.preset, time_budget={"seconds": 600.0, "steps": 1000})
    saved = json.loads((run / "config.json").read_text())
    del saved["train"]["decay_fraction"]
    (run / "config.json").write_text(json.dumps(saved))
    recipe.write_text(text.replace("6e-3", "1e-2") + "warmup_steps = 30\ndecay_fraction = 0.3\n")
    new = configs("--recipe", str(recipe), "--out", str(tmp_path / "new"))[1]
    assert (new.lr, new.warmup_steps, new.decay_fraction) == (1e-2, 30, 0.3)
    _, resumed = configs("--recipe", str(recipe), "--out", str(run), "--resume")
    assert (resumed.lr, resumed.warmup_steps, resumed.decay_fraction) == (6e-3, -1, 0.0)
    assert resumed.steps == 1000
    _, resumed = configs("--recipe", str(recipe), "--set", "train.decay_fraction=0.2",
                         "--out", str(run), "--resume")
    assert resumed.decay_fraction == 0.2


def test_a_recipe_run_keeps_its_shape_when_the_recipe_changes_it(tmp_path):
    """A run started when its recipe trained 4 layers resumes with 4 (its checkpoints hold
    them) after the recipe's [model] table moves to 3; a new run gets 3, and asking the old run
    for 3 on the command line is refused by name."""
    recipe = tmp_path / "laptop.toml"
    text = '[model]\nname = "llama-cpu"\n\n[train]\nbatch_size = 8\n'
    recipe.write_text(text)
    run = saved_run(tmp_path / "stories", "--recipe", str(recipe), "--steps", "100")
    recipe.write_text(text.replace('"llama-cpu"\n', '"llama-cpu"\nnum_layers = 3\n'))
    assert configs("--recipe", str(recipe), "--out", str(tmp_path / "new"))[0].num_layers == 3
    model, cfg = configs("--recipe", str(recipe), "--out", str(run), "--resume")
    assert (json.loads(json.dumps(model.as_dict()))
            == json.loads((run / "config.json").read_text())["model"])
    assert (model.num_layers, cfg.steps, cfg.model) == (4, 100, "llama-cpu")
    with pytest.raises(ConfigError, match="num_layers: 4 -> 3"):
        configs("--recipe", str(recipe), "--set", "model.num_layers=3", "--out", str(run),
                "--resume")


@pytest.mark.parametrize("argv, named", [
    (["--model", "minigpt-tiny", "--set", "model.num_layers=8"], "dropout: 0.0 -> 0.1"),
    (["--set", "model.embed_dim=128"], "embed_dim: 64 -> 128"),
    (["--model", "gpt2-tiny"], "arch: 'minigpt' -> 'gpt2'"),
    (["--tokenizer", "tinystories-4k"], "vocab_size: 50257 -> 4096, "
                                        "tokenizer: 'gpt2' -> 'tinystories-4k'"),
    (["--data", "other.txt"], "data: ('tinystories',) -> ('other.txt',)"),
    (["--seed", "3"], "seed: 0 -> 3"),
    (["--recipe", "stories-cpu"], "arch: 'minigpt' -> 'llama'"),
    (["--set", "model.num_kv_heads=4"],
     "num_kv_heads: 0 (as many as the query heads) -> 4"),
    (["--time-budget", "5m"], "trained without a time budget: to train it further give --steps"),
])
def test_real_differences_are_refused_by_name(tmp_path, argv, named):
    run = saved_run(tmp_path / "pp", *PP_COMMAND, "--steps", "20")
    before = (run / "config.json").read_text()
    with pytest.raises(ConfigError) as e:
        configs(*argv, "--out", str(run), "--resume")
    assert named in str(e.value)
    assert (run / "config.json").read_text() == before


def interrupted_at(step: int, monkeypatch):
    """Make the trainer receive Ctrl-C while it runs step `step`."""
    real_step, calls = steps.train_step, []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(steps, "train_step", interrupting)
    return lambda: monkeypatch.setattr(steps, "train_step", real_step)


@pytest.mark.parametrize("command", [
    pytest.param(PP_COMMAND + ["--batch-size", "16", *SMALL_VOCAB], id="pp with --set",
                 marks=pytest.mark.slow),
    pytest.param(["--recipe", "stories-cpu", "--preset", "dp", "--steps", "6"], id="recipe",
                 marks=pytest.mark.slow),
])
def test_pressing_up_and_adding_resume_continues_exactly(command, small_stories, tmp_path,
                                                         monkeypatch):
    common = [*command, "--data", str(small_stories), "--set", f"data_root={tmp_path / 'data'}",
              "--steps", "6", "--seq-len", "32", "--save-every", "3", "--eval-every", "6",
              "--set", "eval_batches=1", "--no-sample"]
    assert train.main([*common, "--out", str(tmp_path / "straight")]) == 0
    restore = interrupted_at(3, monkeypatch)
    assert train.main([*common, "--out", str(tmp_path / "run")]) == 130
    restore()
    assert train.main([*common, "--out", str(tmp_path / "run"), "--resume"]) == 0
    assert losses(tmp_path / "run") == losses(tmp_path / "straight")


@pytest.fixture(scope="module")
def finished(data_4k, tmp_path_factory) -> Path:
    """Four steps of the tiny model (TinyStories vocabulary), its cosine ended: trained once
    for the module, copied by the tests that go on from it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cfg = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(data_4k),), out=str(out),
                      steps=4, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=1,
                      eval_every=100, eval_batches=1, save_every=2)
    train.train(small_vocab("minigpt-tiny"), cfg, sample=False)
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, this test's to change."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def test_extending_a_finished_run_says_what_it_does_and_goes_on_at_the_floor(run, capsys):
    assert train.main(["--out", str(run), "--resume", "--steps", "8", "--no-sample"]) == 0
    printed = capsys.readouterr().out
    assert ("the run now ends at step 8 instead of 4: the learning rate goes on from 0.0003 "
            "(its value at step 4) and holds at 0.0003 until step 8") in printed
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    rates = [r["lr"] for r in records if "lr" in r]
    assert rates[:4] == pytest.approx([3e-3, 3e-3, 2.325e-3, 9.75e-4])  # the saved cosine
    assert rates[4:] == pytest.approx([3e-4] * 4)  # then the floor, to the new end
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["steps"], saved["decay_start"], saved["warmup_steps"]) == (8, 4, 1)
    # Resuming again (the same command, or none) goes on with that schedule, with no message.
    assert train.main(["--out", str(run), "--resume", "--steps", "8", "--no-sample"]) == 0
    assert "now ends" not in capsys.readouterr().out


def test_a_run_cannot_be_resumed_behind_its_step(run, capsys):
    assert train.main(["--out", str(run), "--resume", "--steps", "2"]) == 2
    assert "is at step 4, past --steps 2: give a later step" in capsys.readouterr().err
