"""Presets: every file applies to the tiny model as its rules say; bad presets are refused."""

import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, child_env, refused
from flax import nnx

from minigpt import explain, sharding
from minigpt.config import ModelConfig
from minigpt.models import build_model, get_config

TINY = get_config("minigpt-tiny")
PRESETS = sharding.available_presets()


def build_tiny(cfg: ModelConfig = TINY):
    return build_model(cfg, rngs=nnx.Rngs(0))


# What each preset does to every kind of parameter, written out by hand (trailing Nones left
# out): the expectation, not a second implementation of the rule resolution.
_TP = {
    ("vocab", "embed"): ("model",), (None, "embed"): (), ("embed",): (),
    ("embed", "heads", "kv"): (None, "model"), ("heads", "kv"): ("model",),
    ("embed", "kv_heads", "kv"): (None, "model"), ("kv_heads", "kv"): ("model",),
    ("heads", "kv", "embed"): ("model",), ("embed", "mlp"): (None, "model"), ("mlp",): ("model",),
    ("mlp", "embed"): ("model",), ("vocab",): ("model",),
}
_FSDP = {axes: ("fsdp",) if axes[0] else (None, "fsdp") for axes in _TP}
_FSDP_TP = {
    ("vocab", "embed"): ("model", "fsdp"), (None, "embed"): (None, "fsdp"),
    ("embed",): ("fsdp",), ("embed", "heads", "kv"): ("fsdp", "model"),
    ("heads", "kv"): ("model",), ("embed", "kv_heads", "kv"): ("fsdp", "model"),
    ("kv_heads", "kv"): ("model",), ("heads", "kv", "embed"): ("model", None, "fsdp"),
    ("embed", "mlp"): ("fsdp", "model"), ("mlp",): ("model",),
    ("mlp", "embed"): ("model", "fsdp"), ("vocab",): ("model",),
}
# (what the preset does to each parameter but the block stack's leading `layers` axis,
#  what it does to that axis)
EXPECTED_SPECS = {
    "dp": (dict.fromkeys(_TP, ()), None),
    "fsdp": (_FSDP, None),
    "tp": (_TP, None),
    "dp_tp": (_TP, None),
    "fsdp_tp": (_FSDP_TP, None),
    "pp": (dict.fromkeys(_TP, ()), "stage"),
    "dp_pp": (dict.fromkeys(_TP, ()), "stage"),
    "fsdp_pp": (_FSDP, "stage"),
    "pp_tp": (_TP, "stage"),
    "dp_pp_tp": (_TP, "stage"),
    "fsdp_pp_tp": (_FSDP_TP, "stage"),
    # `seq` is an activation axis: context parallelism lays parameters out as the same preset
    # without it would
    "cp": (dict.fromkeys(_TP, ()), None),
    "dp_cp": (dict.fromkeys(_TP, ()), None),
    "fsdp_cp": (_FSDP, None),
    "cp_tp": (_TP, None),
    "fsdp_cp_tp": (_FSDP_TP, None),
    # `expert` names only a mixture of experts' weights, which minigpt-tiny has none of: they
    # lay it out as `dp` and `fsdp` do (the experts' layout: tests/test_moe.py)
    "ep": (dict.fromkeys(_TP, ()), None),
    "fsdp_ep": (_FSDP, None),
}


def expected(name: str, axes: tuple) -> tuple:
    """The PartitionSpec a preset gives an array with these logical axes (trailing Nones
    left out): from the table above, with the stacked layers' axis in front for blocks."""
    table, layers = EXPECTED_SPECS[name]
    if axes[0] != "layers":
        return table[axes]
    return normalised((layers, *(table[axes[1:]] or (None,))))


def normalised(spec) -> tuple:
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def test_the_promised_presets_exist_and_each_has_its_expected_table():
    assert {"dp", "fsdp", "dp_tp", "tp", "fsdp_tp", "pp", "dp_pp", "fsdp_pp", "pp_tp",
            "dp_pp_tp", "fsdp_pp_tp", "cp", "dp_cp", "fsdp_cp", "cp_tp", "fsdp_cp_tp", "ep",
            "fsdp_ep"} <= set(PRESETS)
    assert set(PRESETS) == set(EXPECTED_SPECS)


def asked_shardings(preset, mesh, cfg: ModelConfig = TINY) -> dict[str, tuple]:
    """Every parameter's (logical axes, NamedSharding) as `create_sharded` asks for them: the
    output shardings it compiles the initialisation with, from the abstract model alone."""
    abstract = nnx.state(nnx.eval_shape(lambda: build_tiny(cfg)), nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(
        sharding.state_shardings(sharding.Layout(preset, mesh), abstract),
        is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {jax.tree_util.keystr(path): (tuple(var.get_metadata()["out_sharding"]),
                                         var.get_value()) for path, var in leaves}


def assert_born_as_asked(model, preset, mesh, cfg: ModelConfig = TINY):
    """Each array `create_sharded` made lies exactly where it asked (`asked_shardings`)."""
    asked = asked_shardings(preset, mesh, cfg)
    born = {jax.tree_util.keystr(path): var.get_value() for path, var in
            jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                                is_leaf=lambda x: isinstance(x, nnx.Variable))}
    assert born.keys() == asked.keys() and len(born) > 10
    for key, array in born.items():
        assert array.sharding.is_equivalent_to(asked[key][1], array.ndim), key


@pytest.mark.parametrize("name", sorted(EXPECTED_SPECS))
def test_every_parameter_is_sharded_as_the_rules_say(name):
    """The layout each preset gives minigpt-tiny, read without compiling anything; that the
    arrays are born so is checked under `fsdp` and `fsdp_tp` below (and `pp`, `pp_tp`:
    tests/test_pipeline.py, `ep`: tests/test_moe.py)."""
    layout = sharding.Layout.make(name)
    assert layout.mesh.size == 8
    cfg = get_config("minigpt-tiny8") if EXPECTED_SPECS[name][1] else TINY  # layers to split
    sharding.check_divisible(layout, nnx.state(nnx.eval_shape(lambda: build_tiny(cfg))))
    asked = asked_shardings(layout.preset, layout.mesh, cfg)
    assert len(asked) > 10
    for path, (axes, placed) in asked.items():
        assert placed.mesh.shape == layout.mesh.shape, path
        assert normalised(placed.spec) == expected(name, axes), path


def test_fsdp_splits_every_parameter_eight_ways():
    layout = sharding.Layout.make("fsdp")
    model = sharding.create_sharded(build_tiny, layout)
    assert_born_as_asked(model, layout.preset, layout.mesh)
    for var in jax.tree.leaves(nnx.state(model, nnx.Param)):
        assert any(size % 8 == 0 for size in var.shape)
        shard = var.addressable_shards[0].data
        assert shard.nbytes * 8 == var.nbytes
        assert len({d for s in var.addressable_shards for d in [s.device]}) == 8


def test_a_run_loads_into_shapes_that_carry_their_shardings():
    """`load_run` restores a checkpoint into `abstract_sharded`'s shapes: nothing is initialised
    or compiled first, and each array is read into the shards `create_sharded` would give it
    (that the loaded model computes what was saved: tests/test_generate.py, test_runs.py)."""
    layout = sharding.Layout.make("fsdp_tp")
    model = sharding.abstract_sharded(build_tiny, layout)
    asked = asked_shardings(layout.preset, layout.mesh)
    placed = {jax.tree_util.keystr(path): var.get_value() for path, var in
              jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                                  is_leaf=lambda x: isinstance(x, nnx.Variable))}
    assert placed.keys() == asked.keys()
    for key, value in placed.items():
        assert isinstance(value, jax.ShapeDtypeStruct), key
        assert value.sharding == asked[key][1], key


def test_optimizer_state_is_born_with_its_parameter_sharding():
    from minigpt.config import TrainConfig
    from minigpt.optim.optimizer import make_optimizer

    preset = sharding.load_preset("fsdp_tp")

    def build():
        model = build_tiny()
        return model, nnx.Optimizer(model, make_optimizer(TrainConfig()), wrt=nnx.Param)

    mesh = sharding.make_mesh(preset)
    model, optimizer = sharding.create_sharded(build, sharding.Layout(preset, mesh))
    assert_born_as_asked(model, preset, mesh)
    kernel = model.blocks.layers.mlp.up.kernel.get_value()
    adam = optimizer.opt_state[1][0]
    for moment in (adam.mu, adam.nu):
        state = moment["blocks"]["layers"]["mlp"]["up"]["kernel"].get_value()
        assert state.sharding == kernel.sharding
        assert normalised(state.sharding.spec) == (None, "fsdp", "model")


def test_activation_spec_gives_a_shared_mesh_axis_to_the_first_dimension():
    rules = sharding.load_preset("fsdp").rules
    assert sharding.logical_to_spec(("batch", "seq", "embed"), rules) == jax.P("fsdp", None, None)
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == jax.P("fsdp", None)
    assert sharding.logical_to_spec(("mlp",), rules) == jax.P("fsdp")
    tp_rules = sharding.load_preset("fsdp_tp").rules
    assert sharding.logical_to_spec(("embed", "mlp"), tp_rules) == jax.P("fsdp", "model")


def test_batch_sharding_follows_the_batch_rule():
    for name, expected in [("dp", "data"), ("fsdp", "fsdp"), ("tp", None), ("dp_tp", "data")]:
        preset = sharding.load_preset(name)
        mesh = sharding.make_mesh(preset)
        spec = sharding.Layout(preset, mesh).batch_sharding().spec
        assert normalised(spec) == normalised((expected,))
    preset = sharding.load_preset("dp_tp")
    assert sharding.Layout.make(preset).batch_divisor == 4


# Refusals ---------------------------------------------------------------------------------------


def write_preset(tmp_path, text: str, name: str = "custom"):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_unknown_preset_name_lists_the_available_ones():
    with pytest.raises(sharding.PresetError) as e:
        sharding.load_preset("zero3")
    assert "'zero3'" in str(e.value)
    for name in PRESETS:
        assert name in str(e.value)


def test_malformed_toml_is_refused_naming_the_preset(tmp_path):
    path = write_preset(tmp_path, '[mesh]\naxes = ["data"\nshape = [-1]\n', "broken")
    with pytest.raises(sharding.PresetError, match=r"preset 'broken'.*not valid TOML"):
        sharding.load_preset(path)


def test_rule_naming_a_missing_mesh_axis_is_refused(tmp_path):
    path = write_preset(tmp_path, '[mesh]\naxes = ["data"]\nshape = [-1]\n[rules]\nmlp = "model"\n')
    with pytest.raises(sharding.PresetError) as e:
        sharding.load_preset(path)
    assert "mlp" in str(e.value) and "'model'" in str(e.value) and "['data']" in str(e.value)


def test_unknown_logical_axis_is_refused(tmp_path):
    path = write_preset(tmp_path, '[mesh]\naxes = ["data"]\nshape = [-1]\n'
                                  '[rules]\nhidden = "data"\n')
    with pytest.raises(sharding.PresetError) as e:
        sharding.load_preset(path)
    assert "'hidden'" in str(e.value) and "embed" in str(e.value)


@pytest.mark.parametrize("shape, needs", [("[3]", "uses 3 devices"), ("[-1, 3]", "divisible by 3"),
                                          ("[4, 4]", "uses 16 devices")])
def test_mesh_that_does_not_fit_the_devices_is_refused(tmp_path, shape, needs):
    axes = '["data"]' if shape == "[3]" else '["data", "model"]'
    path = write_preset(tmp_path, f"[mesh]\naxes = {axes}\nshape = {shape}\n")
    preset = sharding.load_preset(path)
    with pytest.raises(sharding.PresetError) as e:
        sharding.make_mesh(preset)
    message = str(e.value)
    assert needs in message and "there are 8" in message


def test_a_dimension_its_mesh_axes_do_not_divide_leaves_them_to_the_next():
    # An mlp of 36 does not split 8 ways: the [mlp, embed] kernel is split by embed instead, the
    # [mlp] bias stays whole; GPT-2's 12 heads the same (its checkpoints load under fsdp on 8).
    cfg = ModelConfig(context_len=32, embed_dim=96, num_heads=12, mlp_dim=36, num_layers=1,
                      arch="gpt2")
    preset = sharding.load_preset("fsdp")
    model = sharding.create_sharded(lambda: build_tiny(cfg), sharding.Layout.make(preset))
    layer = model.blocks.layers
    specs = {name: normalised(var.get_value().sharding.spec) for name, var in [
        ("up", layer.mlp.up.kernel), ("up_bias", layer.mlp.up.bias),
        ("down", layer.mlp.down.kernel), ("out", layer.attention.out.kernel),
        ("query_bias", layer.attention.query.bias)]}
    assert specs == {"up": (None, "fsdp"), "up_bias": (), "down": (None, None, "fsdp"),
                     "out": (None, None, None, "fsdp"), "query_bias": ()}
    # without shapes (activations) the first dimension takes the axis, with them the first
    # that divides
    rules = preset.rules
    assert sharding.resolve_spec(("heads", "kv", "embed"), rules) == jax.P("fsdp", None, None)
    assert sharding.resolve_spec(("heads", "kv", "embed"), preset.rules, (12, 4, 64),
                                 sharding.make_mesh(preset)) == jax.P(None, None, "fsdp")


def test_explainer_prints_every_parameter_and_per_device_totals(capsys):
    assert explain.main(["--model", "minigpt-tiny", "--preset", "fsdp"]) == 0
    out = capsys.readouterr().out
    model = build_tiny()
    names = [".".join(str(k) for k in path) for path, _ in nnx.to_flat_state(nnx.state(model))]
    for name in names:
        assert name in out
    total = sum(v.nbytes for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert f"{total / 8 / 2**20:,.2f} MiB per device (of {total / 2**20:,.2f} MiB in all)" in out
    assert "('fsdp', None)" in out


def test_explainer_runs_as_python_m_minigpt_sharding():
    env = child_env("JAX_PLATFORMS")
    result = subprocess.run(
        [sys.executable, "-m", "minigpt.sharding", "--model", "minigpt-tiny", "--preset", "dp_tp",
         "--devices", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "mesh: data=4 x model=2 (8 cpu devices)" in result.stdout
    assert "blocks.layers.mlp.up.kernel" in result.stdout


def test_explainer_refuses_a_bad_preset_with_one_line(capsys):
    err = refused(capsys, explain.main(["--model", "minigpt-tiny", "--preset", "nope"]))
    assert err.startswith("error: unknown preset 'nope'")


def test_dp_holds_eight_times_the_fsdp_bytes_per_device():
    sizes = {}
    for name in ("dp", "fsdp"):
        layout = sharding.Layout.make(name)
        rows = sharding.describe(layout, nnx.state(nnx.eval_shape(build_tiny), nnx.Param))
        sizes[name] = sum(r["bytes_per_device"] for r in rows)
    assert sizes["dp"] == 8 * sizes["fsdp"]
    assert math.isclose(sizes["dp"], sum(
        np.prod(v.shape) * 4 for v in jax.tree.leaves(nnx.state(build_tiny(), nnx.Param))))
