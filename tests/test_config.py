"""Configuration: invariants refused at construction, --set overrides parsed by declared type,
config.json written atomically and read back, damaged or foreign files refused clearly."""


import pytest

from minigpt.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    parse_step_range,
)
from minigpt.models import from_dict, get_config, replaced
from minigpt.runs import resolved
from minigpt.runs.overrides import available_recipes, load_recipe, parse_duration
from minigpt.tokenizer import load_tokenizer
from minigpt.train import cli


@pytest.mark.parametrize("changes, message", [
    (dict(embed_dim=100, num_heads=8), "embed_dim (100) must be divisible by model.num_heads (8)"),
    (dict(num_heads=8, num_kv_heads=3), "multiple of model.num_kv_heads (3)"),
    (dict(dropout=1.0), "model.dropout must be in [0, 1)"),
    (dict(dtype="float16"), "model.dtype must be one of"),
    (dict(num_layers=0), "model.num_layers must be positive, got 0"),
    (dict(arch="gpt2", qk_norm=True), "model.qk_norm is a llama option"),
    (dict(arch="llama", options={"qk_norm": True}), "unknown ModelConfig field 'options'"),
    (dict(arch="llama", qk_norm=True, llama={"qk_norm": False}),
     "model.qk_norm is given twice"),
])
def test_model_config_refuses_what_cannot_build(changes, message):
    with pytest.raises(ConfigError) as e:
        from_dict(changes)
    assert message in str(e.value)


@pytest.mark.parametrize("changes, message", [
    (dict(batch_size=12, microbatches=5), "train.batch_size (12) must be divisible by"),
    (dict(steps=0), "train.steps must be positive, got 0"),
    (dict(lr=0.0), "train.lr must be > 0"),
    (dict(seq_len=-1), "train.seq_len must be >= 0"),
    (dict(profile_steps="5:2"), "must satisfy 0 <= a < b"),
    (dict(reward_weights=(float("nan"),)), "train.reward_weights must be a list of finite"),
    (dict(rewards=("r.py:f",)), "--reward (train.rewards) scores GRPO's completions"),
])
def test_train_config_refuses_bad_values(changes, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**changes)
    assert message in str(e.value)


def test_model_config_derives_heads_and_padded_vocabulary():
    cfg = ModelConfig(vocab_size=50257, embed_dim=256, num_heads=8, num_kv_heads=2)
    assert (cfg.head_dim, cfg.kv_heads, cfg.padded_vocab) == (32, 2, 50304)
    assert ModelConfig(num_kv_heads=0).kv_heads == ModelConfig().num_heads


def overridden(*items: str) -> tuple[ModelConfig, TrainConfig]:
    """The configs `python -m minigpt.train --set ITEM ...` resolves."""
    args = [part for item in items for part in ("--set", item)]
    return cli.resolve_configs(cli.build_parser().parse_args(args))


def test_overrides_are_parsed_by_the_declared_type_and_scope():
    model, train = overridden("dropout=0", "model.remat=yes", "train.lr=3e-4", "steps=7",
                              "data=a.txt,b.txt", "train.profile_steps=1:3",
                              "data.truncate=true")
    assert (model.dropout, model.remat) == (0.0, True)
    assert (train.lr, train.steps, train.data, train.profile_steps, train.data_truncate) == (
        3e-4, 7, ("a.txt", "b.txt"), "1:3", True)
    assert parse_step_range("1:3") == (1, 3)


@pytest.mark.parametrize("item, message", [
    ("colour=blue", "unknown field 'colour'"),
    ("model.lr=1", "unknown field 'model.lr'"),
    ("steps", "expects key=value"),
    ("qk_norm=maybe", "expected true or false, got 'maybe'"),
    ("remat=maybe", "model.remat must be one of auto, none, minimal, full"),
    ("scan_layers=sometimes", "model.scan_layers must be true, false or auto"),
    ("steps=many", "expected int, got 'many'"),
])
def test_bad_overrides_say_what_is_wrong(item, message):
    with pytest.raises(ConfigError) as e:
        overridden(item)
    assert message in str(e.value)


@pytest.mark.parametrize("text, seconds", [
    ("600", 600), ("90s", 90), ("10m", 600), ("1.5h", 5400), ("1h30m", 5400), ("2m30s", 150)])
def test_durations_are_read_in_hours_minutes_and_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "10x", "0", "0m", "1h 30", "-5m"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ConfigError, match="duration|positive"):
        parse_duration(text)


@pytest.mark.parametrize("steps, warmup, expected", [
    (40, -1, 4), (5, -1, 1), (500, -1, 50), (5000, -1, 100), (40, 25, 25), (40, 0, 0)])
def test_warmup_defaults_to_a_tenth_of_the_run_capped_at_100(steps, warmup, expected):
    assert resolved.warmup_steps(TrainConfig(steps=steps, warmup_steps=warmup)) == expected
    decayed = TrainConfig(steps=10_000, decay_steps=steps, warmup_steps=warmup)
    assert resolved.warmup_steps(decayed) == expected


def test_every_shipped_recipe_names_a_zoo_model_and_valid_settings():
    assert "stories-cpu" in available_recipes()
    for name in available_recipes():
        recipe = load_recipe(name)
        model = replaced(get_config(recipe.model), **recipe.model_fields)
        assert load_tokenizer(model.tokenizer).n_vocab == model.vocab_size
        train = TrainConfig(**recipe.train_fields)
        assert recipe.description and train.time_budget > 0


@pytest.mark.parametrize("text, message", [
    ('description = "x"\n[train]\nlr = 1e-3\n', "a \\[model\\] table with `name`"),
    ('[model]\nname = "llama-tiny"\nwings = 2\n', r"unknown \[model\] fields \['wings'\]"),
    ('[model]\nname = "llama-tiny"\n[train]\nstep = 3\n', r"unknown \[train\] fields"),
    ('[model]\nname = "llama-tiny"\n[train]\ntime_budget = "soon"\n', "expected a duration"),
    ('[model\nname = 1', "is not valid TOML"),
])
def test_bad_recipe_files_are_refused_saying_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe(path)


def test_an_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown recipe 'stories-tpu'.*: choose one of .*"
                                          "stories-cpu"):
        load_recipe("stories-tpu")
