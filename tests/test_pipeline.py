"""Pipeline presets: the same losses and gradients as data parallel, each device holding only its
stage's layers, activations moved by collective permutes, runs that move between pipelined and
unpipelined presets through their checkpoints, and bad requests refused before compiling."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses, random_batch
from flax import nnx

from minigpt import explain, generate, pipeline, schedule, sharding, steps, train
from minigpt.config import TrainConfig
from minigpt.models import build_model, get_config

PIPELINES = ["pp", "dp_pp", "fsdp_pp", "pp_tp"]
TRAIN = TrainConfig(steps=10, warmup_steps=4, batch_size=16, lr=1e-3)
RATES = schedule.lr_schedule(TRAIN)
BATCH = 16


def deep(name: str, **changes):
    """A zoo model with 8 layers (one per stage under `pp`), float32, dropout off."""
    return dataclasses.replace(get_config(name), **{"num_layers": 8, "dropout": 0.0, **changes})


def build(cfg):
    model = build_model(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, steps.make_optimizer(TRAIN), wrt=nnx.Param)


def on(preset_name: str, cfg):
    preset = sharding.load_preset(preset_name)
    mesh = sharding.make_mesh(preset)
    model, optimizer = sharding.create_sharded(lambda: build(cfg), preset, mesh)
    return preset, mesh, model, optimizer


def placed(preset, mesh, vocab: int, seed: int = 0):
    """A random batch of BATCH sequences of 32 tokens, placed as the preset splits batches."""
    return sharding.put_batch(random_batch(vocab, BATCH, 32, seed),
                              sharding.batch_sharding(preset, mesh))


def as_host(state) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(state)}


_grads: dict = {}


def loss_and_grads(preset_name: str, cfg, microbatches: int = 4):
    key = (preset_name, cfg, microbatches)
    if key not in _grads:
        preset, mesh, model, _ = on(preset_name, cfg)
        with sharding.use_preset(preset, mesh, sharding.Pipeline(microbatches)):
            loss, grads = nnx.jit(nnx.value_and_grad(steps.loss_fn))(
                model, placed(preset, mesh, cfg.vocab_size))
        _grads[key] = (float(loss), as_host(nnx.state(grads)))
    return _grads[key]


def parity_cases():
    """minigpt under pp in the default run; every model under every pipeline preset with
    -m slow."""
    for name in ("minigpt-tiny", "gpt2-tiny", "llama-tiny"):
        for preset in PIPELINES:
            slow = name != "minigpt-tiny" or preset != "pp"
            yield pytest.param(name, preset, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("model_name, preset_name", list(parity_cases()))
def test_pipelined_loss_and_every_gradient_equal_data_parallel(model_name, preset_name):
    cfg = deep(model_name)
    ref_loss, ref = loss_and_grads("dp", cfg)
    loss, got = loss_and_grads(preset_name, cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert got.keys() == ref.keys()
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for key, g in ref.items():
        # Relative 1e-5; an absolute floor for the key bias, whose true gradient is 0 and
        # whose computed one is float noise (tests/test_kernels.py says why).
        np.testing.assert_allclose(got[key], g, rtol=1e-5, atol=1e-6 * scale, err_msg=key)


def test_dropout_masks_are_the_same_pipelined_or_not():
    cfg = deep("minigpt-tiny", dropout=0.1)
    results = {}
    for name in ("dp", "pp"):
        preset, mesh, model, optimizer = on(name, cfg)
        with sharding.use_preset(preset, mesh, sharding.Pipeline(microbatches=8)):
            metrics = steps.train_step(model, optimizer, placed(preset, mesh, cfg.vocab_size),
                                       jax.random.key(5), RATES)
        results[name] = (float(metrics["loss"]), float(metrics["grad_norm"]))
    assert results["pp"][0] == pytest.approx(results["dp"][0], rel=1e-6)
    assert results["pp"][1] == pytest.approx(results["dp"][1], rel=1e-5)


@pytest.mark.slow
def test_three_adamw_steps_agree_with_data_parallel():
    cfg = deep("minigpt-tiny")
    params = {}
    for name in ("dp", "fsdp_pp"):
        preset, mesh, model, optimizer = on(name, cfg)
        with sharding.use_preset(preset, mesh, sharding.Pipeline(microbatches=4)):
            for step in range(3):
                steps.train_step(model, optimizer, placed(preset, mesh, cfg.vocab_size, step),
                                 jax.random.key(0), RATES)
        params[name] = as_host(nnx.state(model, nnx.Param))
    moved = sum(float(RATES(s)) for s in range(3))  # at most this far
    close = total = 0
    for key, value in params["dp"].items():
        got = params["fsdp_pp"][key]
        # Adam's step m / sqrt(v) scales a gradient to about lr whatever its size, so where a
        # gradient is nearly zero its float noise (the same 1e-5 as above) can move a weight by
        # a visible fraction of lr: 1% of the summed step bounds that; the key bias, whose
        # gradient is pure noise, may differ by up to the steps themselves.
        atol = moved if "key']['bias" in key else 0.01 * moved
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=atol, err_msg=key)
        close += int(np.sum(np.abs(got - value) <= 1e-6 + 1e-5 * np.abs(value)))
        total += value.size
    assert close / total > 0.999  # nearly every weight agrees to float32 precision


def test_each_device_holds_only_its_stage_of_the_block_stack():
    for name, stages in (("pp", 8), ("pp_tp", 4)):
        _, mesh, model, optimizer = on(name, deep("minigpt-tiny"))
        blocks = jax.tree.leaves(nnx.state(model.blocks, nnx.Param))
        total = sum(x.nbytes for x in blocks)
        for device in mesh.devices.flat:
            held = sum(s.data.nbytes for x in blocks for s in x.addressable_shards
                       if s.device == device)
            tp = 2 if name == "pp_tp" else 1  # pp_tp also splits heads and units in pairs
            assert held * stages <= total and held * stages * tp >= total
            if name == "pp":
                assert held * stages == total
        mu = optimizer.opt_state[1][0].mu["blocks"]["layers"]["mlp"]["up"]["kernel"]
        assert mu.get_value().sharding.spec[0] == "stage"  # the optimizer state too
        layer_rows = {(s.index[0].start, s.index[0].stop)  # contiguous blocks of layers
                      for s in model.blocks.layers.mlp.up.kernel.get_value().addressable_shards}
        assert sorted(layer_rows) == [(i, i + 8 // stages) for i in range(0, 8, 8 // stages)]


def replica_groups(line: str) -> list[list[int]]:
    explicit = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
    if explicit:
        return [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}",
                                                                    explicit.group(1))]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\], device_ids=\((\S+)\) \{([^}]*)\}", line)
    if mesh:  # mesh form: axis sizes, device ids (iota), the axes the collective runs over
        names = re.findall(r"'(\w+)'=\d+", mesh.group(1))
        sizes = [int(n) for n in re.findall(r"=(\d+)", mesh.group(1))]
        over = [names.index(n) for n in re.findall(r"'(\w+)'", mesh.group(3))]
        ids = iota_ids(mesh.group(2)).reshape(sizes)
        rest = [a for a in range(len(sizes)) if a not in over]
        return ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[a] for a in over])))\
            .tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\](<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    assert iota, f"unparsed replica groups: {line[:200]}"
    return iota_ids(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()


def iota_ids(text: str) -> np.ndarray:
    """Device ids written `<=[dims]` or `[dims]`, with an optional `T(perm)` transposing them."""
    iota = re.fullmatch(r"(?:<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    assert iota, f"unparsed device ids: {text}"
    ids = np.arange(np.prod([int(d) for d in iota.group(1).split(",")]))
    ids = ids.reshape([int(d) for d in iota.group(1).split(",")])
    if iota.group(2):
        ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
    return ids


@pytest.mark.parametrize("preset_name", ["pp", pytest.param("fsdp_pp", marks=pytest.mark.slow)])
def test_compiled_step_permutes_activations_and_never_gathers_across_stages(preset_name):
    cfg = deep("minigpt-tiny")
    preset, mesh, model, optimizer = on(preset_name, cfg)
    stage_of = {d.id: s for s in range(mesh.shape["stage"])
                for d in np.take(mesh.devices, [s], axis=mesh.axis_names.index("stage")).flat}
    with sharding.use_preset(preset, mesh, sharding.Pipeline(microbatches=4)):
        text = steps.train_step.lower(model, optimizer, placed(preset, mesh, cfg.vocab_size),
                                      jax.random.key(0), RATES).compile().as_text()
    ops = re.findall(r"^\s*%\S+ = .*?[\]})] (all-gather|collective-permute)(?:-start)?\(.*$",
                     text, flags=re.M)
    lines = [line for line in text.splitlines()
             if re.search(r"[\]})] all-gather(-start)?\(", line)]
    assert ops.count("collective-permute") >= 2  # forward and backward
    if preset_name == "pp":
        assert lines == []  # nothing is gathered: each stage keeps its layers
    in_pipeline = [line for line in lines if "/shard_map/" in line]  # where block weights live
    assert len(in_pipeline) >= (10 if preset_name == "fsdp_pp" else 0)
    for line in in_pipeline:  # fsdp gathers a stage's own weights within the stage
        for group in replica_groups(line):
            assert len({stage_of[d] for d in group}) == 1, line[:200]


def test_microbatch_helpers_and_the_bubble():
    x = jnp.arange(12).reshape(6, 2)
    split = pipeline.split_microbatches(x, 3)
    assert split.shape == (3, 2, 2) and split[0, :, 0].tolist() == [0, 6]  # every 3rd row
    assert np.array_equal(pipeline.join_microbatches(split), x)
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 8) == 0.0 and sharding.default_microbatches(4) == 8


def test_explainer_shows_each_stages_layers_and_the_bubble(capsys):
    assert explain.main(["--model", "minigpt-tiny8", "--preset", "dp_pp",
                         "--microbatches", "6"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages over mesh axis 'stage', 4 layer(s) each" in out
    assert "  stage 0: layers 0-3 on device(s) 0, 1, 2, 3" in out
    assert "  stage 1: layers 4-7 on device(s) 4, 5, 6, 7" in out
    assert "bubble with 6 microbatches: (S - 1) / (M + S - 1) = 1/7 = 14.3% of each step" in out
    assert "blocks.layers.mlp.up.kernel" in out and "('stage', None, None)" in out
    assert explain.main(["--model", "minigpt-tiny8", "--preset", "pp"]) == 0  # a 1-D mesh
    out = capsys.readouterr().out
    assert "  stage 7: layer 7 on device(s) 7\n" in out and "= 7/23 = 30.4%" in out


# Training runs: resume across pipelined and unpipelined presets, bad requests ---------------


MODEL = get_config("minigpt-tiny8")


@pytest.fixture
def config(data_dir, tmp_path):
    return TrainConfig(preset="pp", model="minigpt-tiny8", data=(str(data_dir),),
                       out=str(tmp_path / "run"), steps=6, decay_steps=6, batch_size=16,
                       seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=1,
                       save_every=3, log_every=1, pipeline_microbatches=8)


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("dp", "pp"), ("pp", "dp")])
def test_a_run_moves_between_pipelined_and_unpipelined_presets(config, straight, first, then):
    uninterrupted = straight(MODEL, config)
    half = dataclasses.replace(config, preset=first, steps=3)
    train.train(MODEL, half, sample=False)
    summary = train.train(MODEL, dataclasses.replace(half, preset=then, steps=6), resume=True,
                          sample=False)
    assert summary["step"] == 6 and summary["eval_loss"] is not None
    np.testing.assert_allclose(losses(config.out), uninterrupted, rtol=1e-5)
    # Generation under a pipeline preset, from what either layout wrote.
    model, tokenizer, preset, mesh, _ = generate.load_for_generation(config.out, "pp")
    with sharding.use_preset(preset, mesh):
        piped = generate.generate_tokens(model, [[464, 3797]], max_new_tokens=6, temperature=0)
    model, *_ = generate.load_for_generation(config.out, "dp")
    assert piped == generate.generate_tokens(model, [[464, 3797]], max_new_tokens=6,
                                             temperature=0)


@pytest.mark.parametrize("args, message", [
    (["--model", "minigpt-tiny", "--preset", "pp"],
     "preset 'pp' splits the layers into 8 pipeline stages, but model 'minigpt-tiny' has 2 "
     "layer(s)"),
    (["--model", "minigpt-tiny8", "--preset", "pp", "--set", "num_layers=1"],
     "model 'minigpt-tiny8' has 1 layer(s), which 8 stages cannot share evenly"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_microbatches=3"],
     "train.pipeline_microbatches 3 does not divide the 16 sequences"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_microbatches=8"],
     "gives 2 sequences per piece, which preset 'dp_pp' must split 4 ways"),
])
def test_pipeline_requests_that_cannot_work_are_refused_before_compiling(
        data_dir, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(steps, "train_step", lambda *a, **k: pytest.fail("compiled a step"))
    code = train.main(["--data", str(data_dir), "--out", str(tmp_path / "bad"), "--steps", "1",
                       "--batch-size", "16", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "bad").exists()
