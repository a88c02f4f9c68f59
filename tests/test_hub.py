"""Hugging Face checkpoints in and out (minigpt.hub, minigpt.weights).

The checkpoints are tiny random ones the tests write in the Hugging Face layout. The imported
models are checked against forward passes of the Hugging Face architectures written here in
NumPy, independently of minigpt's layers; with torch and transformers installed, also against
transformers itself (test_hub_transformers.py).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import refused
from flax import nnx
from hf_checkpoints import gpt2_checkpoint, llama_checkpoint, write_hf
from tokenizers import Tokenizer

from minigpt import hub
from minigpt.hub import safetensors as weights
from minigpt.runs import RunDir, load_run
from minigpt.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent


# --- the Hugging Face architectures, in NumPy ----------------------------------------------

def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attend(q, k, v):
    """Causal attention of q [T, N, H] over k, v [T, N, H] -> [T, N * H]."""
    T, N, H = q.shape
    scores = np.einsum("tnh,snh->nts", q, k) / math.sqrt(H)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    return np.einsum("nts,snh->tnh", _softmax(scores), v).reshape(T, N * H)


def gpt2_reference(config, w, ids):
    """GPT2LMHeadModel's logits [T, V] for one sequence, float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    D, N, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    T = len(ids)
    x = w["wte.weight"][ids] + w["wpe.weight"][:T]
    for i in range(config["n_layer"]):
        h = _layer_norm(x, w[f"h.{i}.ln_1.weight"], w[f"h.{i}.ln_1.bias"], eps)
        qkv = h @ w[f"h.{i}.attn.c_attn.weight"] + w[f"h.{i}.attn.c_attn.bias"]
        q, k, v = (a.reshape(T, N, D // N) for a in np.split(qkv, 3, axis=-1))
        x = x + _attend(q, k, v) @ w[f"h.{i}.attn.c_proj.weight"] + w[f"h.{i}.attn.c_proj.bias"]
        h = _layer_norm(x, w[f"h.{i}.ln_2.weight"], w[f"h.{i}.ln_2.bias"], eps)
        u = h @ w[f"h.{i}.mlp.c_fc.weight"] + w[f"h.{i}.mlp.c_fc.bias"]
        u = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        x = x + u @ w[f"h.{i}.mlp.c_proj.weight"] + w[f"h.{i}.mlp.c_proj.bias"]
    x = _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    return x @ w["wte.weight"].T


def _rotate(x, theta):
    """Rotary embedding as transformers applies it: x * cos + rotate_half(x) * sin."""
    T, _, H = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, H, 2) / H)
    freqs = np.arange(T)[:, None] * inv_freq[None]  # [T, H/2]
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]  # [T, 1, H]
    half = H // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def llama_reference(config, w, ids):
    """LlamaForCausalLM's logits [T, V] for one sequence, float64; with q_norm and k_norm
    weights, Qwen3ForCausalLM's (each query and key head RMS-normalised before the rotation)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    D, N, K = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    H = config.get("head_dim") or D // N
    theta = config.get("rope_parameters", {}).get("rope_theta") or config["rope_theta"]
    eps, T = config["rms_norm_eps"], len(ids)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        q = (h @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, N, H)
        k = (h @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, K, H)
        if f"{p}.self_attn.q_norm.weight" in w:
            q = _rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = _rotate(q, theta), _rotate(k, theta)
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, K, H)
        group = N // K  # query head n reads key/value head n // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        x = x + _attend(q, k, v) @ w[f"{p}.self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate = h @ w[f"{p}.mlp.gate_proj.weight"].T
        up = h @ w[f"{p}.mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ head.T


def minigpt_logits(run: Path, preset_name: str, ids: np.ndarray):
    """The imported run's logits [B, T, V] (padding dropped) under a preset, and the model."""
    loaded = load_run(run, preset_name)
    with loaded.layout.active():
        logits = nnx.jit(lambda m, t: m(t))(loaded.model, jnp.asarray(ids))
    return np.asarray(logits)[..., :loaded.config.vocab_size], loaded.model


IDS = np.random.default_rng(1).integers(0, 4096, size=(8, 24))


def _close(ours, reference):
    scale = np.abs(reference).max()
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * scale)


# --- import ------------------------------------------------------------------------------

def test_gpt2_import_matches_the_architecture_under_every_preset(tmp_path, gpt2):
    config, w = gpt2_checkpoint(D=96, N=12)  # 12 heads, as GPT-2's: they do not split 8 ways
    hf = write_hf(tmp_path / "hf", config, w)
    run = tmp_path / "run"
    assert hub.main(["import", str(hf), "--out", str(run)]) == 0
    saved = RunDir(run).read()
    assert saved.model.tokenizer == "gpt2" and saved.model.arch == "gpt2"
    assert saved.train is None and saved.imported["source"] == str(hf)
    reference = np.stack([gpt2_reference(config, w, row) for row in IDS])
    logits, _ = minigpt_logits(run, "dp", IDS)
    _close(logits, reference)
    # The same weights laid out by other presets: same logits, each device 1/N of a split table.
    for preset_name, ways in (("fsdp", 8), ("dp_tp", 2), ("pp", 8)):
        other, model = minigpt_logits(run, preset_name, IDS)
        np.testing.assert_allclose(other, logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())
        table = model.tokens.table.get_value() if preset_name != "pp" else \
            model.blocks.layers.mlp.up.kernel.get_value()
        assert table.addressable_shards[0].data.nbytes * ways == table.nbytes, preset_name


@pytest.mark.parametrize("tied,head_dim,dtype,qk_norm", [(False, None, np.float32, False),
                                                         (True, None, ml_dtypes.bfloat16, False),
                                                         (False, 32, np.float16, False),
                                                         (True, 16, np.float32, True)])
def test_llama_import_matches_the_architecture(tmp_path, tied, head_dim, dtype, qk_norm):
    config, w = llama_checkpoint(tied=tied, head_dim=head_dim, qk_norm=qk_norm)
    if tied:  # as transformers 5 writes it: the rotary settings in `rope_parameters`
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 7000.0}
        del config["rope_theta"], config["rope_scaling"]
    # A sharded checkpoint (an index and several files) where the tensors are float32.
    hf = write_hf(tmp_path / "hf", config, w, dtype=dtype, tokenizer="tinystories-4k",
                  max_file_bytes=2**20 if dtype == np.float32 else 2**31)
    assert (hf / weights.INDEX).is_file() == (dtype == np.float32)
    run = tmp_path / "run"
    assert hub.main(["import", str(hf), "--out", str(run), "--preset", "fsdp"]) == 0
    cfg = RunDir(run).read().model
    assert (cfg.tie_embeddings, cfg.num_kv_heads, cfg.head_dim) == (tied, 2, head_dim or 8)
    assert cfg.options.qk_norm == qk_norm
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (
        hf / "tokenizer.json").read_bytes()  # the checkpoint's own, byte for byte
    assert json.loads((run / "config.json").read_text())["model"]["tokenizer"] == "tokenizer"
    as_read = {k: v.astype(dtype).astype(np.float32) for k, v in w.items()}
    reference = np.stack([llama_reference(config, as_read, row) for row in IDS[:2]])
    logits, model = minigpt_logits(run, "dp", IDS[:2])
    _close(logits, reference)
    assert (model.output is None) == tied


@pytest.mark.parametrize("qk_norm", [False, True])
def test_import_then_export_gives_back_the_same_tensors(tmp_path, qk_norm):
    config, w = llama_checkpoint(L=2, qk_norm=qk_norm)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert hub.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                     "--max-file-size", str(2**20 / 2**30)]) == 0
    exported = weights.Checkpoint(tmp_path / "out")
    assert (tmp_path / "out" / weights.INDEX).is_file()  # above the size limit: several files
    assert sorted(exported.keys()) == sorted(w)
    for name, array in w.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("hidden_size", "num_key_value_heads", "rope_theta", "vocab_size",
                "tie_word_embeddings", "rms_norm_eps", "model_type", "architectures"):
        assert out_config[key] == config[key], key
    # its tokenizer is the checkpoint's, as it came in, and encodes as the run's does
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        hf / "tokenizer.json").read_bytes()
    text = "Once upon a time, 12 cats sat  on a mat.\n\nThe end."
    loaded = load_run(tmp_path / "run")
    exported = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert exported.encode(text).ids == loaded.tokenizer.encode_ordinary(text)
    assert exported.encode(text).ids == load_tokenizer("tinystories-4k").encode_ordinary(text)
    # import of the export: the same parameters, bit for bit
    assert hub.main(["import", str(tmp_path / "out"), "--out", str(tmp_path / "again")]) == 0
    first, second = loaded.model, load_run(tmp_path / "again").model
    for a, b in zip(jax.tree.leaves(nnx.state(first)), jax.tree.leaves(nnx.state(second))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gpt2_export_round_trip_and_minigpt_refused(tmp_path, gpt2):
    config, w = gpt2_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w)
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert hub.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    exported = weights.Checkpoint(tmp_path / "out")
    for name, array in w.items():
        if name.endswith(".attn.bias"):
            assert "transformer." + name not in exported  # buffers are not exported
            continue
        np.testing.assert_array_equal(exported["transformer." + name], array, err_msg=name)
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).is_file(), name


def test_export_refuses_the_minigpt_architecture(tmp_path, capsys):
    from minigpt.config import ModelConfig

    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).write(ModelConfig(arch="minigpt"), None)
    refused(capsys, hub.main(["export", "--run", str(run), "--out", str(tmp_path / "out")]),
            "'minigpt' model cannot be exported")
    assert not (tmp_path / "out").exists()


# --- bad input ----------------------------------------------------------------------------

def _broken(tmp_path, change):
    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    change(hf, config, w)
    return hf


def _edit_config(**fields):
    def change(hf, config, w):
        (hf / "config.json").write_text(json.dumps({**config, **fields}))
    return change


def _truncate(hf, config, w):
    path = hf / weights.SINGLE
    path.write_bytes(path.read_bytes()[:-1000])


def _wrong_shape(hf, config, w):
    w = dict(w, **{"model.layers.1.mlp.up_proj.weight": np.zeros((8, 64), np.float32)})
    weights.save(w, hf)


def _not_bpe(hf, config, w):
    (hf / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "Unigram", "vocab": [["<unk>", 0.0]]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}}))


@pytest.mark.parametrize("change,message", [
    (lambda hf, c, w: (hf / "config.json").unlink(), "has no config.json"),
    (_edit_config(model_type="phi"), "model_type 'phi'"),
    (_edit_config(rope_scaling={"type": "dynamic", "factor": 2.0}), 'rope_type "dynamic"'),
    (_edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5}),
     'rope_type "yarn"'),
    (_edit_config(rope_scaling=[2.0]), "expected an object"),
    # Llama's attention_bias means biases on all four projections, which these files lack
    (_edit_config(attention_bias=True), "lacks model.layers.0.self_attn.q_proj.bias"),
    # Mistral's sliding window imports (test_families.py); a negative one is no window
    (_edit_config(model_type="mistral", sliding_window=-64), "sliding_window = -64"),
    (_edit_config(model_type="qwen3", use_sliding_window=True), "use_sliding_window"),
    (_edit_config(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]),
     "layer_types"),
    # without head_dim a Qwen3 has heads of 128, which these 8-wide projections are not
    (_edit_config(model_type="qwen3"), "self_attn.q_proj.weight has shape"),
    (_edit_config(num_hidden_layers=3), "lacks model.layers.2"),
    (_wrong_shape, "model.layers.1.mlp.up_proj.weight has shape [8, 64]"),
    (_truncate, "is truncated"),
    (_not_bpe, "tokenizer"),
    (lambda hf, c, w: (hf / "tokenizer.json").unlink(), "has no tokenizer.json"),
])
def test_bad_checkpoints_are_refused_in_one_line(tmp_path, capsys, change, message):
    hf = _broken(tmp_path, change)
    out = tmp_path / "run"
    refused(capsys, hub.main(["import", str(hf), "--out", str(out)]), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no run, no leftovers


def test_import_never_overwrites_a_run(tmp_path, capsys):
    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert hub.main(["import", str(hf), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_the_imported_run_is_not_resumed_but_started_from(tmp_path, capsys):
    from minigpt.config import ConfigError
    from minigpt.train.cli import build_parser, resolve_configs

    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    run = tmp_path / "run"
    assert hub.main(["import", str(hf), "--out", str(run)]) == 0
    with pytest.raises(ConfigError, match="holds imported weights.*--init-from"):
        resolve_configs(build_parser().parse_args(["--out", str(run), "--resume"]))
    with pytest.raises(ConfigError, match="drop --model"):
        resolve_configs(build_parser().parse_args(["--init-from", str(run), "--model", "minigpt"]))
    with pytest.raises(ConfigError, match="not num_layers"):
        resolve_configs(build_parser().parse_args(["--init-from", str(run),
                                                   "--set", "model.num_layers=4"]))
    model_cfg, train_cfg = resolve_configs(build_parser().parse_args(
        ["--init-from", str(run), "--set", "model.dropout=0.1", "--out", str(tmp_path / "new")]))
    assert model_cfg.tokenizer == str((run / "tokenizer").absolute())
    assert (model_cfg.dropout, model_cfg.num_kv_heads, train_cfg.init_from) == (0.1, 2, str(run))


# --- the Hub ------------------------------------------------------------------------------

def _fake_cache(cache: Path, repo: str, commit: str, files: Path) -> None:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in files.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def _hub_import(args, cache, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "HF_HOME": str(tmp_path / "hf-home")}
    return subprocess.run([sys.executable, "-m", "minigpt.hub", "import", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_hub_ids_are_read_from_the_cache_offline(tmp_path):
    pytest.importorskip("huggingface_hub", reason="the Hub client is the [hub] extra")
    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    commit = "0123456789abcdef0123456789abcdef01234567"
    _fake_cache(tmp_path / "cache", "someone/tiny-llama", commit, hf)
    done = _hub_import(["someone/tiny-llama", "--revision", commit, "--out",
                        str(tmp_path / "run")], tmp_path / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    saved = RunDir(tmp_path / "run").read()
    assert saved.imported["source"] == "someone/tiny-llama"
    assert saved.imported["revision"] == commit
    missing = _hub_import(["someone/not-cached", "--out", str(tmp_path / "other")],
                          tmp_path / "cache", tmp_path)
    refused(missing, missing.returncode, "not in the Hugging Face cache")
    assert not (tmp_path / "other").exists()


# --- the safetensors format, against the safetensors package -------------------------------

def test_safetensors_files_agree_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="the safetensors package checks ours")
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float16), "c": np.arange(6, dtype=np.int64)}
    st.save_file(tensors, tmp_path / "theirs.safetensors")
    ours = weights.SafetensorsFile(tmp_path / "theirs.safetensors")
    for name, array in tensors.items():
        np.testing.assert_array_equal(ours[name], array)
    weights.save(tensors, tmp_path / "mine")
    theirs = st.load_file(tmp_path / "mine" / weights.SINGLE)
    for name, array in tensors.items():
        np.testing.assert_array_equal(theirs[name], array)
    # bfloat16 (which the package's NumPy API cannot hold) keeps its bits
    bf16 = rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)
    weights.save({"w": bf16}, tmp_path / "bf16")
    read = weights.SafetensorsFile(tmp_path / "bf16" / weights.SINGLE)["w"]
    np.testing.assert_array_equal(read.view(np.uint16), bf16.view(np.uint16))


# --- fine-tuning from imported weights -------------------------------------------------------

@pytest.mark.slow
def test_a_new_run_starts_from_imported_weights_and_resumes(tmp_path, small_stories, capsys):
    from minigpt.train import cli, train

    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    imported = tmp_path / "imported"
    assert hub.main(["import", str(hf), "--out", str(imported)]) == 0
    new = tmp_path / "tuned"
    argv = ["--init-from", str(imported), "--data", str(small_stories), "--preset", "dp_tp",
            "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-9",
            "--eval-every", "2", "--save-every", "2", "--no-sample", "--out", str(new),
            "--set", "train.data_root=" + str(tmp_path / "data"), "--set", "eval_batches=1"]
    assert cli.run(argv, train) == 0
    assert "starting from the weights of" in capsys.readouterr().out
    saved = json.loads((new / "config.json").read_text())
    assert saved["train"]["init_from"] == str(imported)
    assert saved["model"]["tokenizer"] == "tokenizer"  # its own copy of the tokenizer
    assert (new / "tokenizer" / "tokenizer.json").read_bytes() == (
        imported / "tokenizer" / "tokenizer.json").read_bytes()
    # two steps at a learning rate of 1e-9 leave the imported weights (a fresh model would not
    # be anywhere near them)
    start, tuned = load_run(imported).model, load_run(new)
    assert tuned.step == 2
    for a, b in zip(jax.tree.leaves(nnx.state(start)), jax.tree.leaves(nnx.state(tuned.model))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    # the command that started it, with --resume added and a new end, goes on
    assert cli.run([*argv, "--resume", "--steps", "3"], train) == 0
    assert load_run(new).step == 3


def test_a_vocabulary_without_endoftext_exports_with_its_own_end_token(tmp_path):
    config, w = llama_checkpoint(L=2)
    hf = write_hf(tmp_path / "hf", config, w, tokenizer="tinystories-4k")
    tokenizer = (hf / "tokenizer.json").read_text().replace("<|endoftext|>", "<|im_end|>")
    (hf / "tokenizer.json").write_text(tokenizer)
    assert hub.main(["import", str(hf), "--out", str(tmp_path / "run")]) == 0
    assert hub.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert generation["eos_token_id"] == 4095 and tokenizer_config["eos_token"] == "<|im_end|>"
