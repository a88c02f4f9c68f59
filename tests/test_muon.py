"""Muon (`train.optimizer = "muon"`): which parameters it updates, as what matrices; one step
agrees across presets; a Muon run resumes bit for bit and keeps its optimizer."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from conftest import losses, random_batch, zoo_config
from flax import nnx

from minigpt import sharding, train
from minigpt.config import ConfigError, TrainConfig
from minigpt.models import build_model, get_config
from minigpt.optim import lr_schedule, steps
from minigpt.optim import optimizer as optim

MUON = TrainConfig(steps=10, warmup_steps=4, batch_size=16, lr=1e-3, optimizer="muon",
                   muon_lr=0.02)

# Every block matrix: (reduction axes, output axes) of its orthogonalised [inputs, outputs] view;
# axis 0 is the stacked layers. Everything else is AdamW's.
ATTENTION = {
    "blocks/layers/attention/query/kernel": ((1,), (2, 3)),
    "blocks/layers/attention/key/kernel": ((1,), (2, 3)),
    "blocks/layers/attention/value/kernel": ((1,), (2, 3)),
    "blocks/layers/attention/out/kernel": ((1, 2), (3,)),
}
MUON_GROUPS = {
    "minigpt-tiny": {**ATTENTION, "blocks/layers/mlp/up/kernel": ((1,), (2,)),
                     "blocks/layers/mlp/down/kernel": ((1,), (2,))},
    "gpt2-tiny": {**ATTENTION, "blocks/layers/mlp/up/kernel": ((1,), (2,)),
                  "blocks/layers/mlp/down/kernel": ((1,), (2,))},
    "llama-tiny": {**ATTENTION, "blocks/layers/mlp/gate/kernel": ((1,), (2,)),
                   "blocks/layers/mlp/up/kernel": ((1,), (2,)),
                   "blocks/layers/mlp/down/kernel": ((1,), (2,))},
    "llama-tiny+qk_norm": {**ATTENTION, "blocks/layers/mlp/gate/kernel": ((1,), (2,)),
                           "blocks/layers/mlp/up/kernel": ((1,), (2,)),
                           "blocks/layers/mlp/down/kernel": ((1,), (2,))},
}
ADAMW_GROUPS = {
    "minigpt-tiny": ["blocks/layers/attention/key/bias", "blocks/layers/attention/out/bias",
                     "blocks/layers/attention/query/bias", "blocks/layers/attention/value/bias",
                     "blocks/layers/mlp/down/bias", "blocks/layers/mlp/up/bias",
                     "blocks/layers/norm1/bias", "blocks/layers/norm1/scale",
                     "blocks/layers/norm2/bias", "blocks/layers/norm2/scale", "output/bias",
                     "output/kernel", "positions/table", "tokens/table"],
    "gpt2-tiny": ["blocks/layers/attention/key/bias", "blocks/layers/attention/out/bias",
                  "blocks/layers/attention/query/bias", "blocks/layers/attention/value/bias",
                  "blocks/layers/mlp/down/bias", "blocks/layers/mlp/up/bias",
                  "blocks/layers/norm1/bias", "blocks/layers/norm1/scale",
                  "blocks/layers/norm2/bias", "blocks/layers/norm2/scale", "final_norm/bias",
                  "final_norm/scale", "positions/table", "tokens/table"],
    "llama-tiny": ["blocks/layers/norm1/scale", "blocks/layers/norm2/scale", "final_norm/scale",
                   "output/kernel", "tokens/table"],
    "llama-tiny+qk_norm": ["blocks/layers/attention/k_norm/scale",
                           "blocks/layers/attention/q_norm/scale", "blocks/layers/norm1/scale",
                           "blocks/layers/norm2/scale", "final_norm/scale", "output/kernel",
                           "tokens/table"],
}


def as_tuple(axes):
    return (axes,) if isinstance(axes, int) else tuple(axes)


@pytest.mark.parametrize("name", sorted(MUON_GROUPS))
def test_muon_takes_the_block_matrices_and_adamw_the_rest(name):
    model = nnx.eval_shape(lambda: build_model(zoo_config(name), rngs=nnx.Rngs(0)))
    muon, adamw = {}, []
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = "/".join(map(str, path))
        dims = optim.muon_dimensions(tuple(jax.tree_util.DictKey(p) for p in path),
                                     value.get_value().ndim)
        if dims is None:
            adamw.append(key)
        else:
            muon[key] = (as_tuple(dims.reduction_axis), as_tuple(dims.output_axis))
    assert muon == MUON_GROUPS[name]
    assert sorted(adamw) == ADAMW_GROUPS[name]


_steps: dict = {}


def muon_step(model_name: str, preset_name: str):
    """The loss of one Muon step under a preset and the parameters before and after it, once
    per file. (With a 256-token vocabulary, the key bias, whose true gradient is 0, moved by
    float noise differently under `pp`: the model keeps its own vocabulary.)"""
    if (model_name, preset_name) not in _steps:
        _steps[model_name, preset_name] = _muon_step(model_name, preset_name)
    return _steps[model_name, preset_name]


def _muon_step(model_name: str, preset_name: str):
    cfg = dataclasses.replace(get_config(model_name), dropout=0.0)

    def build():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optim.make_optimizer(MUON), wrt=nnx.Param)

    rates = lr_schedule.lr_schedule(MUON)
    host = random_batch(cfg.vocab_size, 16, 32)
    layout = sharding.Layout.make(preset_name)
    model, optimizer = sharding.create_sharded(build, layout)
    before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model,
                                                                                   nnx.Param))}
    with layout.checked(model=model_name, num_layers=cfg.num_layers).active():
        batch = sharding.put_batch(host, layout.batch_sharding())
        metrics = steps.train_step(model, optimizer, batch, jax.random.key(0), rates)
    after = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model,
                                                                                  nnx.Param))}
    return float(metrics["loss"]), before, after


@pytest.mark.parametrize("model_name, preset_name", [
    pytest.param("llama-tiny", "fsdp", marks=pytest.mark.slow),
    pytest.param("llama-tiny", "dp_tp", marks=pytest.mark.slow),
    pytest.param("minigpt-tiny8", "pp", marks=pytest.mark.slow)])
def test_one_muon_step_is_the_same_under_every_preset(model_name, preset_name):
    ref_loss, before, ref = muon_step(model_name, "dp")
    loss, before_p, got = muon_step(model_name, preset_name)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    moved = 0
    for key in ref:
        np.testing.assert_array_equal(before_p[key], before[key])
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-5, err_msg=str(key))
        if "blocks" in str(key) and "kernel" in str(key):
            # The step means something only if Muon moved the block matrices: orthogonalised,
            # every one moves by about muon_lr x (first warm-up rate) per entry.
            step = np.abs(ref[key] - before[key])
            assert np.median(step) > 0.1 * MUON.muon_lr / MUON.warmup_steps / 8, key
            moved += 1
    assert moved >= 6


def test_the_muon_update_is_orthogonal_and_scaled_by_shape():
    """One update of a [layers, 8, 32] block matrix from zero momentum: Newton-Schulz leaves
    singular values near 1 (0.5-1.5 by design), times sqrt(32 / 8) for a wide matrix."""
    grads = {"blocks": {"mlp": {"up": {"kernel": jax.random.normal(jax.random.key(0),
                                                                   (2, 8, 32))}}}}
    tx = optax.chain(optax.contrib.scale_by_muon(
        weight_dimension_numbers=lambda u: jax.tree_util.tree_map_with_path(
            lambda p, x: optim.muon_dimensions(p, x.ndim), u)), optim.scale_by_shape())
    update, _ = tx.update(grads, tx.init(grads))
    for layer in np.asarray(update["blocks"]["mlp"]["up"]["kernel"]):
        singular = np.linalg.svd(layer, compute_uv=False) / 2.0  # sqrt(32 / 8)
        assert singular.min() > 0.5 and singular.max() < 1.5


def test_unknown_optimizer_is_refused_by_name():
    with pytest.raises(ConfigError, match="unknown train.optimizer 'lion': choose one of "
                                          "adamw, muon"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ConfigError, match="train.muon_lr must be > 0"):
        TrainConfig(optimizer="muon", muon_lr=0)


@pytest.mark.slow  # resume's exactness is checked for AdamW in the default run (test_train.py)
@pytest.mark.usefixtures("gpt2")
def test_a_muon_run_resumes_bit_for_bit(data_dir, tmp_path, straight):
    model_cfg = get_config("minigpt-tiny")
    config = TrainConfig(preset="fsdp", model="minigpt-tiny", data=(str(data_dir),),
                         out=str(tmp_path / "run"), steps=6, decay_steps=6, batch_size=8,
                         seq_len=32, lr=3e-3, warmup_steps=2, eval_every=3, eval_batches=2,
                         save_every=3, log_every=1, optimizer="muon")
    half = dataclasses.replace(config, out=str(tmp_path / "halves"), steps=3)
    train.train(model_cfg, half, sample=False)
    train.train(model_cfg, dataclasses.replace(half, steps=6), resume=True, sample=False)
    whole = straight(model_cfg, config)
    assert losses(tmp_path / "halves") == whole
    adamw = straight(model_cfg, dataclasses.replace(config, optimizer="adamw"))
    assert whole[2:] != adamw[2:]  # Muon's run is its own
