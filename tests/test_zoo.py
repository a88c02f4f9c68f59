"""The zoo beyond MiniGPT: GPT-2 and Llama, attention variants, rotary positions, scanned
layers, cached decoding and the trainer, for every architecture."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt import sharding
from minigpt.generate import generate_recompute, generate_tokens
from minigpt.models import CONFIGS, build_model, count_params, get_config
from minigpt.models.__main__ import main as list_zoo
from minigpt.models.layers import apply_rope

TINY = ["minigpt-tiny", "gpt2-tiny", "llama-tiny"]
PROMPTS = [[464, 3797, 3332], list(range(100, 131)), [7]]


def test_gpt2_small_has_gpt2s_published_parameter_count():
    cfg = get_config("gpt2-small")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    assert count_params(model, cfg) == 124_439_808
    assert (cfg.num_layers, cfg.num_heads, cfg.embed_dim, cfg.context_len) == (12, 12, 768, 1024)


def test_gpt2_ties_its_head_to_the_token_embedding():
    model = build_model(get_config("gpt2-tiny"), rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2, 64))
    expected = model.final_norm(x) @ model.tokens.table[...].T
    np.testing.assert_allclose(np.asarray(model.head(x)), np.asarray(expected), rtol=1e-6)
    assert not any("output" in str(path) for path, _ in nnx.to_flat_state(nnx.state(model)))


def test_llama_15m_is_about_15m_with_grouped_queries_and_no_biases():
    cfg = get_config("llama-15m")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    assert 14_000_000 < count_params(model, cfg) < 16_000_000
    assert cfg.kv_heads < cfg.num_heads
    names = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert not [n for n in names if n.endswith("bias")]
    assert model.blocks.layers.attention.key.kernel.shape == (8, 128, 4, 16)  # [L, D, K, H]


def test_the_zoo_lists_every_config_with_its_size(capsys):
    list_zoo()
    out = capsys.readouterr().out
    for name in CONFIGS:
        assert name in out
    assert "124,439,808" in out


def test_attention_with_as_many_kv_heads_as_query_heads_is_multi_head_attention():
    mha = dataclasses.replace(get_config("llama-tiny"), num_kv_heads=0)
    gqa = dataclasses.replace(mha, num_kv_heads=mha.num_heads)
    a, b = build_model(mha, rngs=nnx.Rngs(3)), build_model(gqa, rngs=nnx.Rngs(3))
    tokens = jnp.arange(40, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(a(tokens)), np.asarray(b(tokens)))


def test_rotary_embedding_keeps_norms_and_scores_depend_on_relative_position():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 32)), jnp.float32)

    def at(x, position):
        return apply_rope(x, jnp.asarray([[position]]), 10000.0)

    for p in (0, 3, 100):
        assert float(jnp.linalg.norm(at(q, p))) == pytest.approx(float(jnp.linalg.norm(q)), 1e-5)

    def score(m, n):
        return float(jnp.sum(at(q, m) * at(k, n)))

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(0, 0) == pytest.approx(score(50, 50), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


@pytest.mark.parametrize("name", TINY)
def test_cached_greedy_decode_equals_full_recompute(name):
    model = build_model(get_config(name), rngs=nnx.Rngs(0))
    cached = generate_tokens(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, cached):
        assert tokens == generate_recompute(model, prompt, max_new_tokens=12)[0]


@pytest.mark.parametrize("name", [pytest.param("gpt2-tiny", marks=pytest.mark.slow), "llama-tiny"])
def test_scanned_and_unrolled_layers_share_parameters_and_compute_the_same(name):
    cfg = dataclasses.replace(get_config(name), dropout=0.1)
    unrolled = build_model(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))
    scanned = build_model(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
    for model in (unrolled, scanned):  # one layout: every block parameter stacked [L, ...]
        kernel = model.blocks.layers.attention.query.kernel
        assert kernel.get_metadata()["out_sharding"][0] == "layers" and kernel.shape[0] == 2
    same = jax.tree.map(np.array_equal, nnx.state(unrolled), nnx.state(scanned))
    assert all(jax.tree.leaves(same))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50257, (2, 32)), jnp.int32)
    key = jax.random.key(4)
    np.testing.assert_allclose(np.asarray(scanned(tokens, dropout_key=key)),
                               np.asarray(unrolled(tokens, dropout_key=key)), atol=1e-5)
    assert (generate_tokens(scanned, PROMPTS, max_new_tokens=8, temperature=0.0)
            == generate_tokens(unrolled, PROMPTS, max_new_tokens=8, temperature=0.0))


def test_scanned_model_shards_under_a_preset():
    cfg = dataclasses.replace(get_config("llama-tiny"), scan_layers=True)
    preset = sharding.load_preset("fsdp_tp")
    model = sharding.create_sharded(lambda: build_model(cfg, rngs=nnx.Rngs(0)), preset,
                                    sharding.make_mesh(preset))
    kernel = model.blocks.layers.mlp.gate.kernel.get_value()  # [L, D, F]
    assert kernel.sharding.spec == jax.P(None, "fsdp", "model")
    with sharding.use_preset(preset, sharding.make_mesh(preset)):
        tokens = generate_tokens(model, PROMPTS[:1], max_new_tokens=4, temperature=0.0)
    assert len(tokens[0]) == 4
