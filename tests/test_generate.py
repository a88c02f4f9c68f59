"""KV-cache generation: exact agreement with full recompute, sampling rules, length rule, CLI.

The model is the tiny one, untrained, with the TinyStories vocabulary: what is checked is how
tokens are chosen and cached, which no vocabulary changes, and a small output layer makes each
of the many full forward passes of the slow reference cheap."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_vocab
from flax import nnx

from minigpt import sharding
from minigpt.decoding.programs import in_compute_dtypes
from minigpt.decoding.sampler import Sampling, choose, kth_largest, seed_key
from minigpt.generate import (
    GenerationError,
    generate_recompute,
    generate_tokens,
    main,
    window_keep,
)
from minigpt.models import build_model

TINY = small_vocab("minigpt-tiny")
PROMPTS = [[464, 3797, 3332], list(range(100, 137)), [7], list(range(2000, 2017))]


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def greedy(model):
    return generate_tokens(model, PROMPTS, max_new_tokens=24, temperature=0.0)


def test_cached_greedy_equals_full_recompute_for_a_mixed_batch(model, greedy):
    for prompt, tokens in zip(PROMPTS, greedy):
        reference, _ = generate_recompute(model, prompt, max_new_tokens=24)
        assert tokens == reference
        assert len(tokens) == 24


def test_each_row_continues_its_own_prompt(model, greedy):
    alone = [generate_tokens(model, [p], max_new_tokens=24, temperature=0.0)[0]
             for p in PROMPTS[:2]]
    assert alone == greedy[:2]


def test_a_decode_step_reads_the_cache_without_transposing_it(model):
    """Laid out [B, S, K, H], the cache was transposed whole by XLA's CPU backend at every
    layer of every step (two cache-sized transposes in this model's compiled step); kept [B,
    K, S, H], the attention's products read it as it lies."""
    cache = model.init_cache(4, 64)
    graphdef, state = nnx.split(model)

    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state).decode(tokens, positions, cache)

    hlo = jax.jit(step).lower(state, jnp.zeros((4, 1), jnp.int32), jnp.full((4, 1), 5, jnp.int32),
                              cache).compile().as_text()
    size = math.prod(cache[0].shape[1:])  # one layer's keys
    transposes = [line for line in hlo.splitlines()
                  if (found := re.search(r"= \w+\[([\d,]*)\]\{[\d,]*\} transpose\(", line))
                  and math.prod(map(int, found.group(1).split(","))) == size]
    assert not transposes, transposes[:2]


def test_cached_logits_match_the_full_forward_pass(model):
    # Compiled, as generation runs them (and one compilation serves every single-token step).
    forward = nnx.jit(lambda m, x: m(x))
    decode = nnx.jit(lambda m, x, positions, cache: m.decode(x, positions, cache))
    tokens = jnp.asarray([list(range(300, 340))], jnp.int32)
    full = np.asarray(forward(model, tokens))[0]  # [T, V]
    cache = model.init_cache(1, 64)
    prefill = 25
    positions = jnp.arange(prefill, dtype=jnp.int32)[None]
    logits, cache = decode(model, tokens[:, :prefill], positions, cache)
    got = [np.asarray(logits)[0]]
    for t in range(prefill, 40):
        logits, cache = decode(model, tokens[:, t:t + 1], jnp.asarray([[t]], jnp.int32), cache)
        got.append(np.asarray(logits)[0])
    got = np.concatenate(got)
    real = slice(0, TINY.vocab_size)
    np.testing.assert_allclose(got[:, real], full[:, real], rtol=1e-5, atol=1e-5)


def test_sharded_model_generates_the_same_tokens(greedy):
    layout = sharding.Layout.make("dp_tp")
    sharded = sharding.create_sharded(lambda: build_model(TINY, rngs=nnx.Rngs(0)), layout)
    with layout.active():
        tokens = generate_tokens(sharded, PROMPTS, max_new_tokens=24, temperature=0.0)
    assert tokens == greedy


def test_same_seed_same_text_different_seed_different_text(model):
    def draw(seed):
        return generate_tokens(model, PROMPTS[:2], max_new_tokens=16, temperature=1.0,
                               rng=jax.random.key(seed))
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def draw(logits, seed, *, temperature, top_k=0, top_p=1.0, min_p=0.0, count=0):
    """The sampler's tokens for logits [S, V], every row with these settings and its own key."""
    S = logits.shape[0]
    rows = Sampling(temperature=np.full(S, temperature, np.float32),
                    top_k=np.full(S, top_k, np.int32), top_p=np.full(S, top_p, np.float32),
                    min_p=np.full(S, min_p, np.float32),
                    key=np.stack([seed_key(seed + row) for row in range(S)]))
    return np.asarray(jax.jit(choose)(jnp.asarray(logits, jnp.float32), rows,
                                      np.full(S, count, np.int32), np.ones(S, bool),
                                      np.int32(0))[0])


def test_top_k_never_samples_outside_the_k_likeliest():
    logits = np.random.default_rng(0).normal(size=(4, 100))
    allowed = np.argsort(-logits, axis=-1)[:, :5]
    for i in range(50):
        tokens = draw(logits, i, temperature=2.0, top_k=5)
        for row in range(4):
            assert tokens[row] in allowed[row]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.log([[0.05, 0.5, 0.15, 0.3]])
    seen = {p: set() for p in (0.5, 0.7, 0.9, 1.0)}
    for i in range(200):
        for p in seen:
            seen[p].add(int(draw(probs, i, temperature=1.0, top_p=p)[0]))
    assert seen[0.5] == {1}
    assert seen[0.7] == {1, 3}
    assert seen[0.9] == {1, 3, 2}
    assert seen[1.0] == {0, 1, 2, 3}


def test_greedy_is_temperature_zero():
    assert int(draw(np.asarray([[0.1, 3.0, 2.9]]), 0, temperature=0.0)[0]) == 1


def test_generation_stops_at_end_of_text(model, greedy):
    eot = greedy[0][5]
    first = greedy[0].index(eot)
    tokens = generate_tokens(model, PROMPTS[:1], max_new_tokens=24, temperature=0.0,
                             eot_id=eot)[0]
    assert tokens == greedy[0][:first]


def test_streaming_sees_every_token_in_order(model):
    # The second reuses the compilation with a new callback; the third goes past the context.
    for prompt, count in ((PROMPTS[0], 10), (PROMPTS[2], 10), (PROMPTS[2], 140)):
        seen = []
        tokens = generate_tokens(model, [prompt], max_new_tokens=count, temperature=0.0,
                                 on_token=lambda t, seen=seen: seen.append(int(t[0])))
        assert seen == tokens[0] and len(seen) == count


def test_length_rule_refuses_long_prompts(model):
    with pytest.raises(GenerationError, match="context is 128"):
        generate_tokens(model, [[1] * 128], max_new_tokens=4, temperature=0.0)


def test_stories_go_on_past_the_context_in_windows(model):
    # Context 128, windows keep the last 96 tokens. Row 0 fills the context after 8 new tokens
    # and then every 32; row 1 first after 125. Each must be what the slow reference, and the
    # row alone, give.
    assert window_keep(128) == 96
    prompts = [list(range(200, 320)), [7, 8, 9]]
    tokens = generate_tokens(model, prompts, max_new_tokens=150, temperature=0.0)
    assert [len(t) for t in tokens] == [150, 150]
    for prompt, row in zip(prompts, tokens):
        assert row == generate_recompute(model, prompt, max_new_tokens=150)[0]
    assert generate_tokens(model, prompts[1:], max_new_tokens=150, temperature=0.0) == tokens[1:]


def test_sampling_needs_a_key(model):
    with pytest.raises(GenerationError, match="rng"):
        generate_tokens(model, [[1, 2]], max_new_tokens=4, temperature=0.7)


def test_cli_refuses_a_missing_run(tmp_path, capsys):
    assert main(["--run", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_refuses_a_run_without_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(
        {"model": {"arch": "minigpt", "embed_dim": 64, "num_heads": 8}, "train": {},
         "tokenizer": "gpt2"}))
    assert main(["--run", str(run)]) == 2
    assert "no checkpoints" in capsys.readouterr().err


def test_cli_refuses_a_run_trained_with_another_vocabulary(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(
        {"model": {"arch": "minigpt", "vocab_size": 32000}, "train": {}, "tokenizer": "gpt2"}))
    assert main(["--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert "32000" in err and "50257" in err


def test_the_bisected_kth_largest_is_top_ks():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(4, 4096)) * 3,
            np.round(rng.normal(size=(4, 4096)) * 2) / 2,  # many ties
            np.concatenate([rng.normal(size=(4, 100)), np.full((4, 28), -np.inf)], axis=1),
            np.array([[1.0, 1.0, -0.0, 0.0, -2.5, 3.0e38, -3.0e38, 1e-40]]),  # signs, extremes
            np.zeros((2, 64))]
    for x in map(lambda r: jnp.asarray(r, jnp.float32), rows):
        ks = sorted({k for k in (1, 2, 5, 50) if k < x.shape[1]} | {x.shape[1] - 1, x.shape[1]})
        for k in ks:
            want = np.asarray(jax.lax.top_k(x, k)[0][:, -1])
            np.testing.assert_array_equal(np.asarray(kth_largest(x, k)), want, err_msg=str(k))
        per_row = np.resize(ks, x.shape[0])  # a k of its own for each row
        np.testing.assert_array_equal(
            np.asarray(kth_largest(x, jnp.asarray(per_row))),
            [np.asarray(jax.lax.top_k(x[r:r + 1], int(k))[0][0, -1]) for r, k in
             enumerate(per_row)])


def test_decoding_casts_the_weights_once_to_what_each_layer_computes_in():
    # What the decode loop carries: each projection's and table's weights in its layer's dtype
    # (the router of a mixture stays in float32, as it computes), norms untouched; a model made
    # of them computes the same logits, bit for bit.
    from minigpt.models.layers import Dense, Embedding

    for name in ("minigpt-tiny", "moe-tiny"):
        model = build_model(small_vocab(name, dtype="bfloat16"), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        cast = in_compute_dtypes(model, state)
        originals = dict(nnx.to_flat_state(state))
        layers = {path: layer for path, layer in nnx.iter_graph(model)
                  if isinstance(layer, Dense | Embedding)}
        for path, variable in nnx.to_flat_state(cast):
            layer = layers.get(tuple(path[:-1]))
            original = originals[path].get_value()
            if layer is not None:
                want = layer.operands if path[-1] == "kernel" else layer.dtype
                assert variable.get_value().dtype == want, path
                np.testing.assert_array_equal(np.asarray(variable.get_value(), np.float32),
                                              np.asarray(original.astype(want),
                                                         np.float32))
            else:
                assert variable.get_value() is original, path
        assert any(layer.operands == jnp.float32
                   for layer in layers.values()) == (name == "moe-tiny")
        decode = nnx.jit(lambda m, x, positions, cache: m.decode(x, positions, cache)[0])
        tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
        positions = jnp.arange(4, dtype=jnp.int32)[None]
        cache = model.init_cache(1, 8, dtype=jnp.bfloat16)
        np.testing.assert_array_equal(
            np.asarray(decode(nnx.merge(graphdef, cast), tokens, positions, cache)),
            np.asarray(decode(model, tokens, positions, cache)))
