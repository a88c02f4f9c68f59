"""Recipes, the tokenizer a model is trained with, and defaults for short runs."""

import json

import numpy as np
import pytest
from conftest import losses, refused, small_vocab

import minigpt
from minigpt import generate, train
from minigpt.config import TrainConfig
from minigpt.models import get_config, replaced
from minigpt.runs.overrides import load_recipe
from minigpt.tokenizer import load_tokenizer
from minigpt.train import cli


def configs(*argv):
    return cli.resolve_configs(cli.build_parser().parse_args(list(argv)))


def test_flags_override_the_recipe_and_set_overrides_flags():
    recipe = load_recipe("stories-cpu")
    model, cfg = configs("--recipe", "stories-cpu")
    assert cfg.model == recipe.model and cfg.recipe == "stories-cpu"
    assert model == replaced(get_config(recipe.model), **recipe.model_fields)
    for name, value in recipe.train_fields.items():
        assert getattr(cfg, name) == value
    assert model.tokenizer == "tinystories-4k" and model.vocab_size == 4096
    _, cfg = configs("--recipe", "stories-cpu", "--lr", "1e-4", "--batch-size", "8",
                     "--time-budget", "90s", "--set", "lr=2e-4")
    assert (cfg.lr, cfg.batch_size, cfg.time_budget) == (2e-4, 8, 90.0)
    _, cfg = configs("--recipe", "stories-cpu", "--steps", "40")  # steps instead of the budget
    assert (cfg.steps, cfg.time_budget) == (40, 0.0)
    model, cfg = configs("--recipe", "stories-cpu", "--model", "llama-tiny")
    assert model == get_config("llama-tiny") and cfg.model == "llama-tiny"


def test_the_tokenizer_flag_gives_the_model_a_matching_vocabulary():
    model, _ = configs("--model", "minigpt-tiny", "--tokenizer", "tinystories-4k")
    assert (model.tokenizer, model.vocab_size) == ("tinystories-4k", 4096)
    model, _ = configs("--model", "minigpt-tiny")
    assert (model.tokenizer, model.vocab_size) == ("gpt2", 50257)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "5", "--time-budget", "1m"], "give --steps or --time-budget, not both"),
    (["--time-budget", "soon"], "expected a duration"),
    (["--recipe", "stories-tpu"], "unknown recipe 'stories-tpu'"),
    (["--resume", "--recipe", "stories-cpu"], "config.json does not exist: is this a minigpt run"),
    (["--tokenizer", "nope"], "unknown tokenizer 'nope'"),
])
def test_bad_recipe_budget_and_tokenizer_flags_are_refused(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    refused(capsys, train.main(["--out", str(out), *argv]), message)
    assert not out.exists()


def test_a_model_trains_and_tells_stories_with_the_tinystories_tokenizer(small_stories,
                                                                         tmp_path, capsys):
    out = tmp_path / "run"
    code = train.main(["--model", "llama-tiny", "--tokenizer", "tinystories-4k", "--preset",
                       "dp", "--data", str(small_stories), "--set",
                       f"data_root={tmp_path / 'data'}", "--steps", "3", "--batch-size", "8",
                       "--seq-len", "32", "--out", str(out), "--set", "eval_batches=1",
                       "--no-sample"])  # the closing sample: tests/test_train.py's CLI run
    assert code == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["tokenizer"] == "tinystories-4k" and saved["model"]["vocab_size"] == 4096
    assert saved["tokenizer"] == "tinystories-4k"  # the data's, the same
    assert [p.name.endswith("-tinystories-4k") for p in (tmp_path / "data").iterdir()] == [True]
    loaded = minigpt.load_run(out)
    model, tokenizer = loaded.model, loaded.tokenizer
    assert tokenizer is load_tokenizer("tinystories-4k") and model.config.vocab_size == 4096
    capsys.readouterr()
    assert generate.main(["--run", str(out), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")


@pytest.mark.slow  # 40 steps of 64 x 128 tokens: the training defaults, on a 4k-token head
@pytest.mark.usefixtures("optimised")
def test_a_40_step_run_with_default_settings_lowers_the_loss_by_more_than_a_nat(data_4k,
                                                                               tmp_path):
    cfg = TrainConfig(model="minigpt-tiny", data=(str(data_4k),), out=str(tmp_path / "run"),
                      steps=40)
    train.train(small_vocab("minigpt-tiny"), cfg, sample=False)
    seen = losses(tmp_path / "run")
    assert len(seen) == 40 and np.mean(seen[-5:]) < seen[0] - 1.0

