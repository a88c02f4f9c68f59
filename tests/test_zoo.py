"""The zoo beyond MiniGPT: GPT-2 and Llama, attention variants, rotary positions, scanned
layers, cached decoding and the trainer, for every architecture."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_vocab
from flax import nnx

from minigpt import sharding
from minigpt.generate import generate_recompute, generate_tokens
from minigpt.models import CONFIGS, build_model, count_params, get_config
from minigpt.models.__main__ import main as list_zoo
from minigpt.models.layers import apply_rope
from minigpt.models.masks import AttentionInputs

PROMPTS = [[464, 3797, 3332], list(range(100, 131)), [7]]


def test_gpt2_small_has_gpt2s_published_parameter_count():
    cfg = get_config("gpt2-small")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    assert count_params(model, cfg) == 124_439_808
    assert (cfg.num_layers, cfg.num_heads, cfg.embed_dim, cfg.context_len) == (12, 12, 768, 1024)


def test_gpt2_ties_its_head_to_the_token_embedding():
    model = build_model(small_vocab("gpt2-tiny"), rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2, 64))
    expected = model.final_norm(x) @ model.tokens.table[...].T
    np.testing.assert_allclose(np.asarray(model.head(x)), np.asarray(expected), rtol=1e-6)
    assert not any("output" in str(path) for path, _ in nnx.to_flat_state(nnx.state(model)))


def test_llama_15m_has_its_hand_counted_parameters_grouped_queries_and_no_biases():
    cfg = get_config("llama-15m")
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    # Two 50257 x 128 tables (untied); per layer: query and output 128 x 128, key and value
    # 128 x (4 heads x 16), SwiGLU 3 x 128 x 384, two RMSNorm scales; a final RMSNorm scale.
    D, F, V, KH = 128, 384, 50257, 4 * 16
    assert count_params(model, cfg) == 2 * V * D + 8 * (
        2 * D * D + 2 * D * KH + 3 * D * F + 2 * D) + D == 14_440_832
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


def test_grouped_query_attention_equals_multi_head_attention_with_repeated_kv_heads():
    """llama-tiny's first attention layer (16 query heads sharing 8 key/value heads, rotary
    positions) against its weights written out in NumPy as plain multi-head attention: each
    key/value head repeated for the query heads of its group (query head n uses head n // 2)."""
    cfg = small_vocab("llama-tiny")
    model = build_model(cfg, rngs=nnx.Rngs(3))
    graphdef, stacked = nnx.split(model.blocks.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))  # layer 0
    w = {name: np.asarray(getattr(block.attention, name).kernel[...], np.float64)
         for name in ("query", "key", "value", "out")}  # [D, N|K, H]; out [N, H, D]
    B, T, N, K, H = 2, 12, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    x = np.random.default_rng(0).normal(size=(B, T, cfg.embed_dim))

    def rotate(v):  # rotary positions on feature pairs (i, i + H/2)
        half = H // 2
        angle = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(half) / half)  # [T, H/2]
        cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
        a, b = v[..., :half], v[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    q = rotate(np.einsum("btd,dnh->btnh", x, w["query"]))
    k = np.repeat(rotate(np.einsum("btd,dkh->btkh", x, w["key"])), N // K, axis=2)
    v = np.repeat(np.einsum("btd,dkh->btkh", x, w["value"]), N // K, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), w["out"])
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    got, _ = block.attention(jnp.asarray(x, jnp.float32), AttentionInputs(positions))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


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


# The models decode with TinyStories' vocabulary (4,096): the prompts need no more, and the
# full recompute runs a context's logits per token. minigpt-tiny's cached decoding is checked
# against the recompute in tests/test_generate.py (these prompts among its own).
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "llama-tiny+qk_norm"])
def test_cached_greedy_decode_equals_full_recompute(name):
    model = build_model(small_vocab(name), rngs=nnx.Rngs(0))
    cached = generate_tokens(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, cached):
        assert tokens == generate_recompute(model, prompt, max_new_tokens=12)[0]


def test_rotary_model_decodes_past_its_context_as_the_reference_does():
    # llama-tiny (context 128): the new window starts its rotary positions at 0 again.
    model = build_model(small_vocab("llama-tiny"), rngs=nnx.Rngs(0))
    prompt = list(range(300, 420))
    tokens = generate_tokens(model, [prompt], max_new_tokens=44, temperature=0.0)[0]
    assert len(tokens) == 44
    assert tokens == generate_recompute(model, prompt, max_new_tokens=44)[0]


@pytest.mark.parametrize("name", [pytest.param("gpt2-tiny", marks=pytest.mark.slow), "llama-tiny"])
def test_scanned_and_unrolled_layers_share_parameters_and_compute_the_same(name):
    cfg = small_vocab(name, dropout=0.1)
    unrolled = build_model(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))
    scanned = build_model(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(0))
    for model in (unrolled, scanned):  # one layout: every block parameter stacked [L, ...]
        kernel = model.blocks.layers.attention.query.kernel
        assert kernel.get_metadata()["out_sharding"][0] == "layers" and kernel.shape[0] == 2
    same = jax.tree.map(np.array_equal, nnx.state(unrolled), nnx.state(scanned))
    assert all(jax.tree.leaves(same))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)), jnp.int32)
    key = jax.random.key(4)
    np.testing.assert_allclose(np.asarray(scanned(tokens, dropout_key=key)),
                               np.asarray(unrolled(tokens, dropout_key=key)), atol=1e-5)
    assert (generate_tokens(scanned, PROMPTS, max_new_tokens=8, temperature=0.0)
            == generate_tokens(unrolled, PROMPTS, max_new_tokens=8, temperature=0.0))


def test_scanned_model_shards_under_a_preset():
    cfg = small_vocab("llama-tiny", scan_layers=True)
    preset = sharding.load_preset("fsdp_tp")
    layout = sharding.Layout.make(preset)
    model = sharding.create_sharded(lambda: build_model(cfg, rngs=nnx.Rngs(0)), layout)
    kernel = model.blocks.layers.mlp.gate.kernel.get_value()  # [L, D, F]
    assert kernel.sharding.spec == jax.P(None, "fsdp", "model")
    with layout.active():
        tokens = generate_tokens(model, PROMPTS[:1], max_new_tokens=4, temperature=0.0)
    assert len(tokens[0]) == 4
