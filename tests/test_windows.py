"""Sliding-window attention (`model.sliding_window`, `minigpt.models.masks.AttentionInputs`) on
every path that attends: the plain kernel against attention written out by hand, the CPU's
blocked kernel and the fused kernels' fallback against the plain one (values and gradients),
the ring and all-gather over a split sequence, a pipeline stage, and the cached decode against
recomputing the whole window, all with documents packed in the rows. That the windows equal
transformers' is test_families.py's (Gemma 3 and Mistral checkpoints)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt import parallel, sharding
from minigpt.config import ConfigError
from minigpt.generate import generate_recompute, generate_tokens
from minigpt.models import build_model, get_config, kernels, replaced
from minigpt.models.decoder import layer_windows
from minigpt.models.masks import AttentionInputs

B, T, N, K, H, W = 2, 128, 4, 2, 8, 20


def inputs(seed: int = 0):
    """q [B, T, N, H], k and v [B, T, K, H], two documents a row (split at 50 and 90), their
    ids and positions."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    ids = np.where(np.arange(T) < 50, 1, 2)[None].repeat(B, 0)
    ids[1, 90:] = 3
    starts = np.array([[0] * 50 + [50] * 78, [0] * 50 + [50] * 40 + [90] * 38])
    positions = np.arange(T)[None] - starts
    return q, k, v, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32)


def by_hand(q, k, v, ids, window):
    """Attention written out: each query's softmax over the keys of its document at or before
    it and at most `window` - 1 positions back."""
    q, k, v, ids = (np.asarray(a, np.float64) for a in (q, k, v, ids))
    k, v = (np.repeat(a, N // K, axis=2) for a in (k, v))
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(t + 1) if ids[b, s] == ids[b, t] and t - s < window]
            scores = np.einsum("nh,snh->ns", q[b, t], k[b, keys]) / np.sqrt(H)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, t] = np.einsum("ns,snh->nh", p / p.sum(-1, keepdims=True), v[b, keys])
    return out


def test_the_plain_kernel_is_attention_within_the_window_and_the_document():
    q, k, v, ids, positions = inputs()
    got = kernels.get("reference").causal_attention(q, k, v, AttentionInputs(positions, ids, W))
    np.testing.assert_allclose(np.asarray(got), by_hand(q, k, v, ids, W), atol=2e-5)
    # a window past the rows is no window at all
    wide = kernels.get("reference").causal_attention(q, k, v, AttentionInputs(positions, ids, T))
    plain = kernels.get("reference").causal_attention(q, k, v, AttentionInputs(positions, ids))
    np.testing.assert_allclose(np.asarray(wide), np.asarray(plain), atol=1e-6)


def value_and_grads(attend, q, k, v, attn):
    weights = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attend(q, k, v, attn)) * weights)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("kernel", ["cpu", "cudnn"])
def test_the_cpu_and_fused_kernels_give_the_plain_ones_values_and_gradients(kernel):
    """The CPU's blocked kernel (its written-out backward) and the fused set (on a CPU, its
    fallback to XLA's attention with the record's mask), with a window traced as a layer's."""
    q, k, v, ids, positions = inputs(1)
    attn = AttentionInputs(positions, ids, jnp.int32(W))  # traced, as inside a scan
    want = value_and_grads(kernels.get("reference").causal_attention, q, k, v, attn)
    got = value_and_grads(kernels.get(kernel).causal_attention, q, k, v, attn)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_attention_over_a_split_sequence_keeps_the_window(strategy):
    """The ring (and all-gather) over 4 devices: the positions travel with the keys, so a window
    reaching back across devices masks as on one device; values and gradients."""
    q, k, v, ids, positions = inputs(2)
    attn = AttentionInputs(positions, ids, W)
    want = value_and_grads(kernels.get("reference").causal_attention, q, k, v, attn)
    how = sharding.ContextParallel(strategy, tile=32)
    with sharding.Layout.make("dp_cp", context_parallel=how).active():
        order = parallel.sequence_order(T)
        got = value_and_grads(lambda q, k, v, a: parallel.causal_attention(q, k, v, a)[
            :, np.argsort(order)], q[:, order], k[:, order], v[:, order], attn.take(order))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    for w, g in zip(jax.tree.leaves(want[1]), jax.tree.leaves(got[1])):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(order)], np.asarray(w),
                                   rtol=1e-5, atol=1e-5)


def gemma(**changes):
    return replaced(get_config("gemma3-tiny"), vocab_size=256, **changes)


def test_the_layers_windows_follow_the_pattern_and_are_refused_where_they_mean_nothing():
    assert layer_windows(gemma()) == (16, 16, 16, 16, 16, 0)
    assert layer_windows(gemma(sliding_window_pattern=0)) == (16,) * 6
    assert layer_windows(gemma(sliding_window=0, sliding_window_pattern=0)) == (0,) * 6
    with pytest.raises(ConfigError, match="needs model.sliding_window"):
        gemma(sliding_window=0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        gemma(sliding_window=-1)


def test_cached_decoding_of_local_and_global_layers_is_recomputing_the_window():
    """Gemma 3's pattern, a window of 16 and a context of 48: the cache's mask keeps each local
    layer's window as the story grows past it and past the context (windows of the context)."""
    model = build_model(gemma(context_len=48), rngs=nnx.Rngs(0))
    prompt = [3, 17, 42, 5, 99, 120, 7]
    cached = generate_tokens(model, [prompt], max_new_tokens=60, temperature=0.0)[0]
    assert cached == generate_recompute(model, prompt, max_new_tokens=60)[0]


@pytest.mark.slow
def test_a_pipeline_stage_runs_each_layer_with_its_own_window():
    """Gemma 3's six layers over 2 stages of dp_pp (each stage a local layer and a global one
    among its three): the loss and gradients of the unsplit model."""
    cfg = gemma(context_len=64)
    batch = {"inputs": jnp.asarray(np.random.default_rng(3).integers(0, 256, (8, 64)),
                                   jnp.int32)}
    batch["targets"] = jnp.roll(batch["inputs"], -1, axis=1)
    grad = sharding.jit(lambda m, b: nnx.value_and_grad(lambda m, b: m.loss(b))(m, b))
    found = []
    for name, pipe in (("dp", sharding.Pipeline()), ("dp_pp", sharding.Pipeline(microbatches=2))):
        layout = sharding.Layout.make(name, pipeline=pipe)
        model = sharding.create_sharded(lambda: build_model(cfg, rngs=nnx.Rngs(0)), layout)
        with layout.active():
            found.append(grad(model, batch))
    np.testing.assert_allclose(float(found[1][0]), float(found[0][0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(found[0][1]), jax.tree.leaves(found[1][1])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
