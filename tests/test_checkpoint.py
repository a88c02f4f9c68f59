"""Checkpoints: what is saved comes back exactly, into another preset's layout; the last N are
kept; a step is never written twice; a run without checkpoints is refused clearly."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import minigpt
from minigpt import generate, sharding, train
from minigpt.checkpoint import Checkpointer, CheckpointError
from minigpt.config import ModelConfig, TrainConfig
from minigpt.models import build_model
from minigpt.optim import optimizer as optim

SMALL = ModelConfig(vocab_size=512, context_len=32, embed_dim=64, num_heads=8, mlp_dim=64,
                    num_layers=2)


def state(preset_name: str, seed: int):
    preset = sharding.load_preset(preset_name)

    def build():
        model = build_model(SMALL, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optim.make_optimizer(TrainConfig()), wrt=nnx.Param)

    return sharding.create_sharded(build, sharding.Layout.make(preset))


@pytest.fixture(scope="module")
def dp_state():
    """A model and its optimizer under dp, created once: the tests below only save and read."""
    return state("dp", seed=0)


def arrays(obj) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(obj))}


def test_a_checkpoint_restores_exactly_into_another_presets_layout(tmp_path):
    model, optimizer = state("fsdp", seed=0)
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(3, model, optimizer, data_state={"next_index": 12},
                      rng=jax.random.key(42))
    checkpointer.wait()
    other_model, other_optimizer = state("dp_tp", seed=1)  # different values, different layout
    restored = checkpointer.restore(other_model, other_optimizer)
    checkpointer.close()
    assert restored["step"] == 3 and restored["data_state"] == {"next_index": 12}
    assert np.array_equal(jax.random.key_data(restored["rng"]),
                          jax.random.key_data(jax.random.key(42)))
    for saved, loaded in [(model, other_model), (optimizer, other_optimizer)]:
        expected, got = arrays(saved), arrays(loaded)
        assert expected.keys() == got.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    kernel = other_model.blocks.layers.mlp.up.kernel.get_value()  # [L, D, F]
    assert kernel.sharding.spec == jax.P(None, None, "model")  # dp_tp's layout, not fsdp's


def test_only_the_last_checkpoints_are_kept_and_a_step_is_written_once(tmp_path, dp_state):
    model, optimizer = dp_state
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        assert checkpointer.save(step, model, optimizer, data_state={}, rng=jax.random.key(0))
    assert not checkpointer.save(3, model, optimizer, data_state={}, rng=jax.random.key(0))
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 3] and checkpointer.latest_step() == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "3"]
    checkpointer.close()


def test_restoring_where_there_is_no_checkpoint_says_so(tmp_path, dp_state):
    model, _ = dp_state
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(model)


# Runs written before every model stacked its blocks ---------------------------------------

LIST_LAYOUT = "8ff6e99"  # the last commit whose models kept a list of blocks by default


def old_code(tmp_path) -> Path:
    """The package as of LIST_LAYOUT, from this clone's history (skip where there is none)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", LIST_LAYOUT, "minigpt",
                              "presets"], capture_output=True)
    if archive.returncode:
        pytest.skip(f"commit {LIST_LAYOUT} is not in this clone's history (a shallow clone?)")
    dest = tmp_path / "old"
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_a_run_written_before_the_stacked_layout_resumes_and_generates(
        tmp_path, stories_file, gpt2, scan):
    old, run = old_code(tmp_path), tmp_path / "run"
    common = ["--data", str(stories_file), "--out", str(run), "--batch-size", "16",
              "--seq-len", "32", "--save-every", "3", "--eval-every", "3", "--no-sample",
              "--set", "eval_batches=1"]
    env = {**os.environ, "PYTHONPATH": str(old)}
    result = subprocess.run(
        [sys.executable, "-m", "minigpt.train", "--preset", "fsdp", "--model", "minigpt-tiny",
         "--steps", "3", "--set", f"scan_layers={str(scan).lower()}", *common],
        cwd=old, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "checkpoints" / "3").is_dir()

    # Resume under a pipeline preset (2 stages of 1 layer), then generate under another.
    assert train.main(["--resume", "--out", str(run), "--preset", "dp_pp", "--steps", "5",
                       "--no-sample"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r][-2:] == [4, 5]
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    loaded = minigpt.load_run(run, "dp")
    model, tokenizer = loaded.model, loaded.tokenizer
    assert nnx.state(model, nnx.Param)["blocks"]["layers"]["mlp"]["up"]["kernel"].shape[0] == 2
    tokens = generate.generate_tokens(model, [tokenizer.encode("Once")], max_new_tokens=4,
                                      temperature=0)
    assert len(tokens[0]) == 4
