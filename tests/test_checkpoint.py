"""Checkpoints: what is saved comes back exactly, into another preset's layout; the last N are
kept; a step is never written twice; a run without checkpoints is refused clearly."""

import jax
import numpy as np
import pytest
from flax import nnx

from minigpt import sharding, steps
from minigpt.checkpoint import Checkpointer, CheckpointError
from minigpt.config import ModelConfig, TrainConfig
from minigpt.models import build_model

SMALL = ModelConfig(vocab_size=512, context_len=32, embed_dim=64, num_heads=8, mlp_dim=64,
                    num_layers=2)


def state(preset_name: str, seed: int):
    preset = sharding.load_preset(preset_name)

    def build():
        model = build_model(SMALL, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, steps.make_optimizer(TrainConfig()), wrt=nnx.Param)

    return sharding.create_sharded(build, preset, sharding.make_mesh(preset))


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
    kernel = other_model.blocks.layers[0].mlp.up.kernel.get_value()
    assert kernel.sharding.spec == jax.P(None, "model")  # dp_tp's layout, not fsdp's


def test_only_the_last_checkpoints_are_kept_and_a_step_is_written_once(tmp_path):
    model, optimizer = state("dp", seed=0)
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        assert checkpointer.save(step, model, optimizer, data_state={}, rng=jax.random.key(0))
    assert not checkpointer.save(3, model, optimizer, data_state={}, rng=jax.random.key(0))
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 3] and checkpointer.latest_step() == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "3"]
    checkpointer.close()


def test_restoring_where_there_is_no_checkpoint_says_so(tmp_path):
    model, _ = state("dp", seed=0)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(model)
