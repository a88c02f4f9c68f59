"""LoRA adapters: an adapted model starts as its base and trains its adapters alone (the base
bitwise unchanged), one step agrees across presets (pipelines included), resume is exact,
exports merged and as PEFT adapters (which peft loads onto the original checkpoint), imports of
PEFT adapters, the optimizer state of rank 8 on a 1B shape, and bad requests refused in one
line."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import losses, random_batch, refused
from etils import epath
from flax import nnx
from hf_checkpoints import llama_checkpoint, write_hf

from minigpt import hub, sharding, train
from minigpt.checkpoint import key_names
from minigpt.config import ModelConfig, TrainConfig
from minigpt.generate import generate_tokens
from minigpt.hub import peft
from minigpt.models import build_model, get_config, lora
from minigpt.models.layers import row_keys
from minigpt.optim import lr_schedule, steps
from minigpt.optim import state as adapters
from minigpt.runs import load_run
from minigpt.train import cli as train_cli

ALL = ("query", "key", "value", "out", "gate", "up", "down")


def base_params(model) -> dict[str, np.ndarray]:
    frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(frozen)}


# One jitted forward for the module: models of the same structure and layout share its compile.
_forward = nnx.jit(lambda m, t: m(t))


def logits_of(model, ids, vocab):
    return np.asarray(_forward(model, jnp.asarray(ids)))[..., :vocab]


# --- the layers -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", pytest.param("gpt2-tiny", marks=pytest.mark.slow)])
def test_an_adapted_model_starts_as_its_base_and_trains_its_adapters_alone(name):
    cfg = dataclasses.replace(get_config(name), vocab_size=512)
    train_cfg = TrainConfig(lora_rank=4, lora_targets=ALL if name == "llama-tiny" else
                            ("query", "key", "value", "out", "up", "down"), lr=1e-2,
                            warmup_steps=0)
    model, optimizer = adapters.build(cfg, train_cfg)
    base = build_model(cfg, rngs=nnx.Rngs(train_cfg.seed))
    ids = random_batch(cfg.vocab_size, 2, 16)["inputs"]
    # B is zero as initialised: exactly the base model's logits, the SwiGLU's kernel or not
    np.testing.assert_array_equal(logits_of(model, ids, cfg.vocab_size),
                                  logits_of(base, ids, cfg.vocab_size))
    before = base_params(model)
    assert all(np.array_equal(v, before[k]) for k, v in base_params(base).items())
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg.vocab_size, 4, 16).items()}
    for _ in range(2):
        steps.train_step(model, optimizer, batch, jax.random.key(0),
                         lr_schedule.lr_schedule(train_cfg))
    after = base_params(model)
    assert all(np.array_equal(after[k], before[k]) for k in before)  # bitwise
    moved = [np.abs(np.asarray(d.lora.b.get_value())).max() for _, d in lora.adapted(model)]
    assert len(moved) == len(train_cfg.lora_targets) and min(moved) > 0
    # the optimizer holds the adapters (and its step count) alone
    held = jax.tree_util.tree_leaves_with_path(nnx.state(optimizer, nnx.OptState))
    names = [jax.tree_util.keystr(p) for p, v in held if np.ndim(v) > 0]
    assert names and all("'lora'" in n for n in names)
    # merged, the model computes what it did with its adapters
    adapted = logits_of(model, ids, cfg.vocab_size)
    lora.merge(model)
    assert not lora.adapted(model)
    np.testing.assert_allclose(logits_of(model, ids, cfg.vocab_size), adapted, rtol=1e-5,
                               atol=1e-5 * np.abs(adapted).max())


def test_adapters_follow_the_axes_of_their_layer():
    model, _ = nnx.eval_shape(lambda: adapters.build(
        get_config("llama-tiny"), TrainConfig(lora_rank=8, lora_targets=ALL)))
    axes = {".".join(p) + "." + k: getattr(d.lora, k).get_metadata()["out_sharding"]
            for p, d in lora.adapted(model) for k in "ab"}
    assert axes["blocks.layers.attention.query.a"] == ("layers", "embed", None)
    assert axes["blocks.layers.attention.query.b"] == ("layers", None, "heads", "kv")
    assert axes["blocks.layers.attention.out.a"] == ("layers", "heads", "kv", None)
    assert axes["blocks.layers.attention.out.b"] == ("layers", None, "embed")
    assert axes["blocks.layers.mlp.down.a"] == ("layers", "mlp", None)
    assert lora.einsum_specs("...D,VD->...V") == ("...D,Dr->...r", "...r,rV->...V", "Dr", "rV")
    assert lora.einsum_specs("BECD,EDF->BECF")[2:] == ("EDr", "ErF")


def test_the_explainer_shows_the_adapters_beside_the_frozen_base(capsys):
    from minigpt import explain

    assert explain.main(["--model", "llama-tiny", "--preset", "fsdp", "--lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "blocks.layers.attention.query.lora.a" in out and "(layers, embed, None)" in out
    base = next(line for line in out.splitlines() if line.strip().startswith("frozen base:"))
    ours = next(line for line in out.splitlines() if line.strip().startswith("adapters:"))
    assert "no optimizer state" in base and "rank 8" in ours
    assert explain.main(["--model", "llama-tiny", "--lora-rank", "8", "--lora-targets",
                         "query,gate_proj"]) == 2
    assert "gate_proj: name no layer" in capsys.readouterr().err


def test_rank_8_on_the_1b_shape_keeps_under_1_percent_of_full_fine_tunings_optimizer_state():
    cfg = ModelConfig(arch="llama", vocab_size=128256, context_len=2048, embed_dim=2048,
                      num_heads=32, num_kv_heads=8, mlp_dim=8192, num_layers=16, dropout=0.0,
                      tie_embeddings=True)

    def state_bytes(train_cfg):
        _, optimizer = nnx.eval_shape(lambda: adapters.build(cfg, train_cfg))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(optimizer)))

    full, rank8 = state_bytes(TrainConfig()), state_bytes(TrainConfig(lora_rank=8))
    assert full > 9e9  # two float32 moments of 1.24B parameters
    assert rank8 < 0.01 * full
    assert rank8 == pytest.approx(2 * 4 * 16 * 8 * (  # moments x bytes x layers x rank x ...
        2 * (2048 + 2048) + 2 * (2048 + 512) + 3 * (2048 + 8192)), rel=1e-3)


# --- one step under every kind of preset ------------------------------------------------------

# llama-tiny with 8 layers (one per stage under `pp`) and a small vocabulary, dropout on
DEEP = dataclasses.replace(get_config("llama-tiny"), num_layers=8, dropout=0.1, vocab_size=512)
STEP = TrainConfig(lora_rank=4, lora_dropout=0.1, lora_targets=ALL, lr=1e-3, warmup_steps=0)
_steps: dict = {}


def one_step(preset_name: str):
    """Loss, gradient norm and adapters after one LoRA step with dropout (the model's and the
    adapters') under a preset (a pipeline one with 4 microbatches, 1F1B)."""
    if preset_name not in _steps:
        layout = sharding.Layout.make(preset_name)
        model, optimizer = sharding.create_sharded(lambda: adapters.build(DEEP, STEP), layout)
        plan = sharding.Pipeline(microbatches=4) if layout.preset.mesh_axes_of("layers") else (
            sharding.Pipeline())
        with layout.replace(pipeline=plan).active():
            batch = sharding.put_batch(random_batch(DEEP.vocab_size, 16, 32),
                                       layout.batch_sharding())
            before = base_params(model)
            metrics = steps.train_step(model, optimizer, batch, jax.random.key(7),
                                       lr_schedule.lr_schedule(STEP))
        assert all(np.array_equal(v, before[k]) for k, v in base_params(model).items())
        found = {jax.tree_util.keystr(p): np.asarray(v) for p, v in
                 jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.LoRAParam))}
        _steps[preset_name] = (float(metrics["loss"]), float(metrics["grad_norm"]), found)
    return _steps[preset_name]


@pytest.mark.parametrize("preset_name", [
    pytest.param("pp", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow),
    pytest.param("dp_tp", marks=pytest.mark.slow),
    pytest.param("fsdp_tp", marks=pytest.mark.slow),
    pytest.param("fsdp_pp_tp", marks=pytest.mark.slow)])
def test_one_lora_step_is_the_same_under_every_preset(preset_name):
    ref_loss, ref_norm, ref = one_step("dp")
    loss, norm, found = one_step(preset_name)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert found.keys() == ref.keys()
    for key, value in ref.items():
        # Adam's first step is lr * g / (|g| + eps): about lr where |g| >> eps, and the presets
        # agree to float32 precision there; where |g| is within a few eps of zero the step is
        # g / eps times float noise (tests/test_steps.py), and they agree to a tenth of it. A
        # does not move at all: B was zero, so A's gradient is too.
        full_step = np.abs(value) > 0.99 * STEP.lr
        np.testing.assert_allclose(found[key][full_step], value[full_step], rtol=1e-5,
                                   atol=1e-3 * STEP.lr, err_msg=key)
        np.testing.assert_allclose(found[key], value, rtol=0, atol=0.1 * STEP.lr, err_msg=key)
    b_moved = [v for k, v in ref.items() if k.endswith("['b'].value")]
    assert np.mean([np.mean(np.abs(v) > 0.99 * STEP.lr) for v in b_moved]) > 0.5


@pytest.mark.slow  # a pipelined step's compile (13 s on 2 cores); LoRA under pp: the same set
def test_the_pipeline_differentiates_the_adapters_alone():
    """Under `pp` the pipeline computes the adapters' gradients and none of the frozen weights':
    asked for every parameter's, it gives zeros for those."""
    layout = sharding.Layout.make("pp")
    model, _ = sharding.create_sharded(lambda: adapters.build(DEEP, STEP), layout)
    keys = row_keys(jax.random.key(7), 16)
    with layout.replace(pipeline=sharding.Pipeline(microbatches=4)).active():
        batch = sharding.put_batch(random_batch(DEEP.vocab_size, 16, 32),
                                   layout.batch_sharding())
        grads = nnx.jit(nnx.grad(lambda m, b: m.loss(b, keys)))(model, batch)
    found = {key_names(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    frozen = [k for k in found if lora.ADAPTER not in k]
    assert len(frozen) > 5 and all(not found[k].any() for k in frozen)
    assert all(found[k].any() for k in found if k[-1] == "b")  # B's gradients: not zero


# --- runs -------------------------------------------------------------------------------------

@pytest.fixture
def config(data_dir, tmp_path):
    return TrainConfig(preset="fsdp", model="minigpt-tiny", data=(str(data_dir),),
                       out=str(tmp_path / "run"), steps=4, decay_steps=4, batch_size=8,
                       seq_len=32, lr=3e-3, warmup_steps=1, eval_every=2, eval_batches=1,
                       save_every=2, log_every=1, lora_rank=4, lora_dropout=0.1,
                       lora_targets=("query", "value", "up"))


@pytest.mark.slow  # the default run checks resume's exactness without adapters (test_train.py)
@pytest.mark.usefixtures("gpt2")
def test_a_resumed_lora_run_continues_exactly(config, tmp_path, straight):
    model = dataclasses.replace(get_config("minigpt-tiny"), dropout=0.1)
    half = dataclasses.replace(config, out=str(tmp_path / "halves"), steps=2)
    train.train(model, half, sample=False)
    train.train(model, dataclasses.replace(half, steps=4), resume=True, sample=False)
    assert losses(tmp_path / "halves") == straight(model, config)  # bitwise
    saved = json.loads((tmp_path / "halves" / "config.json").read_text())
    assert saved["adapters"] == {"rank": 4, "alpha": 16.0, "targets": ["query", "value", "up"],
                                 "base": None}
    # a resume that asks for other adapters is refused, naming them
    with pytest.raises(Exception, match="lora_rank: 4 -> 8"):
        train_cli.resolve_configs(train_cli.build_parser().parse_args(
            ["--out", half.out, "--resume", "--set", "train.lora_rank=8"]))


@pytest.mark.slow  # a real two-process job (tests/test_multihost.py runs fsdp in two)
@pytest.mark.usefixtures("gpt2")
def test_two_processes_train_adapters_like_one(data_dir, tmp_path):
    import test_multihost as multihost

    one = dataclasses.replace(multihost.config(data_dir, tmp_path / "one", "dp_pp"), lora_rank=4,
                              lora_dropout=0.1)
    train.train(get_config("minigpt-tiny"), one, sample=False)
    lora_args = ["--set", "train.lora_rank=4", "--set", "train.lora_dropout=0.1"]
    job = multihost.launcher(multihost.cli_args(dataclasses.replace(
        one, out=str(tmp_path / "two"))) + lora_args, tmp_path / "logs")
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, small_stories):
    """A Llama imported from a Hugging Face folder (written by transformers when it is here),
    then two LoRA steps at a large rate on every projection and the output head, under `fsdp`:
    (the Hugging Face folder, the imported run, the LoRA run)."""
    root = tmp_path_factory.mktemp("lora")
    hf = root / "hf"
    try:
        import torch
        import transformers
    except ImportError:
        config, w = llama_checkpoint(L=2, V=4096)
        write_hf(hf, config, w, tokenizer="tinystories-4k")
    else:
        from minigpt.hub import tokenizer_export
        from minigpt.tokenizer import load_tokenizer

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=False))
        model.save_pretrained(hf, safe_serialization=True)
        (hf / "tokenizer.json").write_text(json.dumps(
            tokenizer_export.tokenizer_json_from_encoding(load_tokenizer("tinystories-4k"))))
    imported, new = root / "imported", root / "tuned"
    assert hub.main(["import", str(hf), "--out", str(imported)]) == 0
    argv = ["--init-from", str(imported), "--data", str(small_stories), "--preset", "fsdp",
            "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--lr", "0.05",
            "--eval-every", "2", "--save-every", "2", "--no-sample", "--out", str(new),
            "--set", "train.data_root=" + str(root / "data"), "--set", "eval_batches=1",
            "--set", "warmup_steps=0", "--set", "train.lora_rank=4",
            "--set", "train.lora_alpha=8", "--set", "lora_targets=" + ",".join(ALL) + ",output"]
    assert train_cli.run(argv, train) == 0
    return hf, imported, new


@pytest.fixture(scope="module")
def adapted(tuned):
    """The LoRA run's latest weights, loaded once for the module (its adapters beside the base;
    the tests only read it)."""
    return load_run(tuned[2])


@pytest.fixture(scope="module")
def adapter(tuned, tmp_path_factory):
    """The LoRA run's adapters exported once as a PEFT adapter folder (the tests copy it before
    changing anything in it)."""
    out = tmp_path_factory.mktemp("peft") / "adapter"
    assert hub.main(["export", "--run", str(tuned[2]), "--out", str(out), "--adapter"]) == 0
    return out


IDS = np.random.default_rng(1).integers(0, 4096, size=(2, 12))


def test_a_lora_run_leaves_its_imported_base_bitwise_and_records_its_adapters(tuned, adapted):
    _, imported, new = tuned
    start, done = load_run(imported), adapted
    assert done.step == 2
    assert all(np.array_equal(v, base_params(start.model)[k])
               for k, v in base_params(done.model).items())
    assert min(float(np.abs(d.lora.b.get_value()).max()) for _, d in lora.adapted(done.model)) > 0
    saved = json.loads((new / "config.json").read_text())
    assert saved["adapters"] == {"rank": 4, "alpha": 8.0, "targets": [*ALL, "output"],
                                 "base": str(imported.absolute())}
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(new / "checkpoints" / "2" /
                                                               "optimizer")).tree
    stored = [key_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert all(lora.ADAPTER in n for n in stored if "step" not in n and "count" not in n)


def test_a_merged_export_imports_as_the_adapted_model(tuned, adapted, tmp_path):
    _, _, new = tuned
    assert hub.main(["export", "--run", str(new), "--out", str(tmp_path / "merged")]) == 0
    assert hub.main(["import", str(tmp_path / "merged"), "--out", str(tmp_path / "back")]) == 0
    back = load_run(tmp_path / "back")
    assert not lora.adapted(back.model)
    expected = logits_of(adapted.model, IDS, 4096)
    np.testing.assert_allclose(logits_of(back.model, IDS, 4096), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    # generation from the run (its adapters applied) and from its merged export agree
    told = []
    for run in (adapted, back):
        with run.layout.active():
            told.append(list(generate_tokens(run.model, [[int(t) for t in IDS[0, :4]]],
                                             max_new_tokens=8, temperature=0.0,
                                             rng=jax.random.key(0))[0]))
    assert told[0] == told[1] and len(told[0]) == 8


def test_a_peft_adapter_goes_out_and_back_in_onto_its_base(tuned, adapted, adapter, tmp_path,
                                                           capsys):
    _, imported, _ = tuned
    config = json.loads((adapter / peft.CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["base_model_name_or_path"] == str(imported.parent / "hf")
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    assert hub.main(["import", str(adapter), "--base", str(imported), "--out",
                     str(tmp_path / "again")]) == 0
    assert "--init-from" in capsys.readouterr().out
    again = load_run(tmp_path / "again")
    for (path, dense), (_, theirs) in zip(lora.adapted(again.model), lora.adapted(adapted.model)):
        for k in "ab":
            np.testing.assert_array_equal(np.asarray(getattr(dense.lora, k).get_value()),
                                          np.asarray(getattr(theirs.lora, k).get_value()),
                                          err_msg=".".join(path))
    np.testing.assert_array_equal(logits_of(again.model, IDS, 4096),
                                  logits_of(adapted.model, IDS, 4096))


def test_peft_loads_the_adapter_onto_the_original_checkpoint(tuned, adapted, adapter):
    torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    peft_lib = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    hf = tuned[0]
    base = transformers.LlamaForCausalLM.from_pretrained(hf)
    model = peft_lib.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(IDS)).logits.float().numpy()
    ours = logits_of(adapted.model, IDS, 4096)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    with torch.no_grad():  # and the adapters change what the base computes
        plain = transformers.LlamaForCausalLM.from_pretrained(hf)(torch.tensor(IDS)).logits
    assert np.abs(plain.float().numpy() - theirs).max() > 1e-2


@pytest.mark.slow
def test_a_new_run_continues_an_imported_adapter(tuned, adapter, tmp_path, small_stories,
                                                 capsys):
    _, imported, _ = tuned
    assert hub.main(["import", str(adapter), "--base", str(imported), "--out",
                     str(tmp_path / "b")]) == 0

    def start(out, *lora_settings):
        return train_cli.run([
            "--init-from", str(tmp_path / "b"), "--data", str(small_stories), "--preset", "dp",
            "--steps", "1", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-9",
            "--no-sample", "--out", str(tmp_path / out), "--set",
            "train.data_root=" + str(tmp_path / "data"), "--set", "eval_batches=1",
            *lora_settings], train)

    assert start("c", "--set", "train.lora_rank=4", "--set", "train.lora_alpha=8",
                 "--set", "lora_targets=" + ",".join(ALL) + ",output") == 0
    assert "weights and adapters of" in capsys.readouterr().out
    saved = json.loads((tmp_path / "c" / "config.json").read_text())
    assert saved["adapters"]["base"] == str(imported.absolute())
    # a full fine-tune from it starts from its adapters folded into the weights
    assert start("d") == 0
    assert "adapters folded into them" in capsys.readouterr().out
    assert "adapters" not in json.loads((tmp_path / "d" / "config.json").read_text())


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (["--set", "train.lora_rank=-1"], "train.lora_rank must be >= 0"),
    (["--set", "train.lora_rank=4", "--set", "lora_targets=query,qkv"],
     "train.lora_targets qkv: name no layer of the minigpt model"),
    (["--set", "train.lora_rank=4", "--set", "lora_alpha=0"], "train.lora_alpha > 0"),
    (["--set", "train.lora_rank=2", "--set", "lora_alpha=1e5"],
     "train.lora_alpha = 100000 with rank 2 scales each adapter's output by 5e+04"),
    (["--set", "train.lora_rank=4", "--set", "lora_dropout=1"], "lora_dropout in [0, 1)"),
])
def test_bad_lora_requests_are_refused_in_one_line(data_dir, tmp_path, capsys, change, message):
    code = train.main(["--model", "minigpt-tiny", "--data", str(data_dir), "--out",
                       str(tmp_path / "bad"), "--steps", "1", "--batch-size", "8", *change])
    refused(capsys, code, message)
    assert not (tmp_path / "bad").exists()


def test_bad_adapter_exports_and_imports_are_refused_in_one_line(tuned, adapter, tmp_path,
                                                                capsys):
    _, imported, new = tuned
    assert hub.main(["export", "--run", str(imported), "--out", str(tmp_path / "x"),
                     "--adapter"]) == 2
    assert "has no adapters" in capsys.readouterr().err
    other_name = tmp_path / "renamed"
    shutil.copytree(adapter, other_name)
    config = json.loads((other_name / peft.CONFIG).read_text())
    (other_name / peft.CONFIG).write_text(json.dumps(
        {**config, "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    bigger = tmp_path / "bigger"
    config, w = llama_checkpoint(L=2, V=4096, D=128, N=8, K=2, F=96)
    write_hf(tmp_path / "hf-bigger", config, w, tokenizer="tinystories-4k")
    assert hub.main(["import", str(tmp_path / "hf-bigger"), "--out", str(bigger)]) == 0
    shutil.copytree(adapter, tmp_path / "nameless")
    config = json.loads((tmp_path / "nameless" / peft.CONFIG).read_text())
    (tmp_path / "nameless" / peft.CONFIG).write_text(json.dumps(
        {**config, "base_model_name_or_path": None}))
    capsys.readouterr()
    for folder, base, message in [
            (other_name, imported, "made for 'meta-llama/Llama-3.2-1B'"),
            (tmp_path / "nameless", bigger, "made for another base model"),
            (adapter, new, "carries adapters of its own")]:
        refused(capsys, hub.main(["import", str(folder), "--base", str(base), "--out",
                                  str(tmp_path / "never")]), message)
        assert not (tmp_path / "never").exists()
