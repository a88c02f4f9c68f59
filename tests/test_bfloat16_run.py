"""A bfloat16 run on a CPU (bfloat16 operands accumulated in float32 there; the accelerators'
default computes in bfloat16): it trains, says what it computes with, resumes exactly, and
its checkpoints hold float32 weights that a float32 run continues from: checkpoints do not
depend on the compute dtype."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from conftest import losses
from flax import nnx

from minigpt import train
from minigpt.config import TrainConfig
from minigpt.models import get_config
from minigpt.runs import load_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gpt2")]

BF16 = dataclasses.replace(get_config("minigpt-tiny"), dtype="bfloat16")


def test_a_bfloat16_run_trains_resumes_exactly_and_keeps_float32_weights(data_dir, tmp_path,
                                                                         straight, capsys):
    config = TrainConfig(preset="dp", model="minigpt-tiny", data=(str(data_dir),),
                         out=str(tmp_path / "straight"), steps=4, decay_steps=4, batch_size=8,
                         seq_len=32, lr=3e-3, warmup_steps=1, eval_every=2, eval_batches=1,
                         save_every=2, log_every=1)
    half = dataclasses.replace(config, out=str(tmp_path / "halves"), steps=2)
    train.train(BF16, half, sample=False)
    # on a CPU bfloat16 means bfloat16 operands, float32 accumulation and activations
    assert ("computing in float32 with bfloat16 products (their operands; float32 "
            "accumulation); MFU against") in capsys.readouterr().out
    train.train(BF16, dataclasses.replace(half, steps=4), resume=True, sample=False)
    resumed = losses(tmp_path / "halves")
    assert resumed == straight(BF16, config) and all(map(math.isfinite, resumed))

    run = load_run(tmp_path / "halves")
    assert run.model.config.dtype == "bfloat16"
    weights = jax.tree.leaves(nnx.state(run.model, nnx.Param))
    assert weights and all(w.dtype == jnp.float32 for w in weights)
    # The same checkpoint goes on in float32 (the dtype says how a run computes, not what it is).
    as_float32 = dataclasses.replace(BF16, dtype="float32")
    summary = train.train(as_float32, dataclasses.replace(half, steps=6, decay_steps=6),
                          resume=True, sample=False)
    assert summary["step"] == 6 and all(map(math.isfinite, losses(tmp_path / "halves")))
    assert "computing in float32; MFU against" in capsys.readouterr().out
