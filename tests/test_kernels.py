"""Kernels: the CPU-tuned forms compute what the plain reference forms compute, loss and every
gradient, for every architecture; and only the kernels module asks which backend is running."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_batch, zoo_config
from flax import nnx

from minigpt.config import ConfigError
from minigpt.models import build_model, execution, get_config, kernels
from minigpt.models.loss import _chunk_len, cross_entropy

PACKAGE = Path(__file__).resolve().parent.parent / "minigpt"


def loss_and_grads(cfg, batch):
    model = build_model(cfg, rngs=nnx.Rngs(1))
    loss, grads = nnx.value_and_grad(lambda m, b: m.loss(b))(model, batch)
    return float(loss), dict(nnx.to_flat_state(nnx.state(grads)))


def test_auto_means_cpu_kernels_on_a_cpu_and_names_are_checked():
    assert execution.kernel_set("auto", "cpu") == "cpu"
    assert kernels.get("auto") is kernels.get(execution.kernel_set("auto"))
    assert type(kernels.get("reference")) is kernels.ReferenceKernels
    with pytest.raises(ConfigError, match="model.kernels must be one of"):
        dataclasses.replace(get_config("minigpt-tiny"), kernels="gpu")


# Sequence 128 = 2 attention blocks, so the blocked attention (not its fallback) is compared;
# 3 x 7 has a chunk length that divides nothing evenly in the fused loss; llama-tiny with
# TinyStories' vocabulary takes the small-vocabulary loss chunks and the gated activation (with
# query and key norms, as the stories-cpu recipe trains it: the norm kernel over head features).
# The default run takes llama-tiny's 128-long case and minigpt-tiny's odd one; -m slow the rest.
@pytest.mark.parametrize("name, batch, seq, vocab", [
    pytest.param("minigpt-tiny", 4, 128, 0, marks=pytest.mark.slow),
    pytest.param("gpt2-tiny", 4, 128, 0, marks=pytest.mark.slow),
    ("llama-tiny+qk_norm", 4, 128, 4096),
    pytest.param("llama-tiny", 4, 128, 4096, marks=pytest.mark.slow), ("minigpt-tiny", 3, 7, 0)])
def test_cpu_kernels_give_the_reference_loss_and_every_gradient(name, batch, seq, vocab):
    cfg = dataclasses.replace(zoo_config(name), dropout=0.0)
    if vocab:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
        assert _chunk_len(batch, seq, cfg.padded_vocab) * batch == 128
    data = {k: jnp.asarray(v) for k, v in random_batch(cfg.vocab_size, batch, seq, 5).items()}
    ref_loss, ref_grads = loss_and_grads(dataclasses.replace(cfg, kernels="reference"), data)
    cpu_loss, cpu_grads = loss_and_grads(dataclasses.replace(cfg, kernels="cpu"), data)
    # float32's sums in another order; an accelerator's reductions order them differently
    # again: 1.4e-6 apart on an H200 (2026-11-27)
    assert cpu_loss == pytest.approx(ref_loss, rel=1e-6 if jax.default_backend() == "cpu"
                                     else 1e-5)
    assert ref_grads.keys() == cpu_grads.keys() and len(ref_grads) > 10
    # The key bias's true gradient is zero (it shifts every score of a query alike), so what
    # both compute there is float noise: the absolute tolerance is taken from the largest
    # gradient of the model, not of each parameter.
    scale = max(float(np.abs(g.get_value()).max()) for g in ref_grads.values())
    for path, g in ref_grads.items():
        g, c = np.asarray(g.get_value()), np.asarray(cpu_grads[path].get_value())
        np.testing.assert_allclose(c, g, rtol=1e-4, atol=1e-6 * scale, err_msg=path)


def test_cpu_attention_and_gated_activation_gradients_match_the_reference():
    """The written-out backward passes against autodiff of the plain forms, on their own."""
    rng = np.random.default_rng(1)
    B, T, N, K, H, D, F = 2, 192, 4, 2, 8, 16, 24  # 3 attention blocks, grouped heads
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(D, F)) / 4, jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    ref, cpu = kernels.get("reference"), kernels.get("cpu")

    def attention_loss(ops):
        return lambda q, k, v: jnp.sum(jnp.sin(ops.causal_attention(q, k, v)) * weights)

    def mlp_loss(ops):
        return lambda x, a, b: jnp.sum(jnp.sin(ops.gated_activation(x, a, b)))

    for loss, args in ((attention_loss, (q, k, v)), (mlp_loss, (x, w_gate, w_up))):
        want = jax.grad(loss(ref), argnums=(0, 1, 2))(*args)
        got = jax.grad(loss(cpu), argnums=(0, 1, 2))(*args)
        assert float(loss(cpu)(*args)) == pytest.approx(float(loss(ref)(*args)), rel=1e-5)
        for w, g in zip(want, got):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads(ops):
    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 128, 8, 2, 16
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    grouped = kernels.get(ops).causal_attention(q, k, v)
    # Plain multi-head attention written out, every query head with its group's key/value head.
    kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(H)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    plain = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), vr)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(plain), atol=2e-6)


@pytest.mark.parametrize("ops", ["reference", "cpu"])
def test_norms_match_their_textbook_formulas_and_gradients(ops):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=16), jnp.float32)
    bias = jnp.asarray(rng.normal(size=16), jnp.float32)
    k = kernels.get(ops)

    def layer_norm(x, scale, bias):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias

    def rms_norm(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale

    weights = jnp.asarray(rng.normal(size=x.shape), jnp.float32)  # a non-trivial cotangent

    def grads(f, args):
        return jax.grad(lambda *a: jnp.sum(f(*a) * weights), argnums=tuple(range(len(args))))(
            *args)

    for got, want, args in [(lambda *a: k.normalize(*a, 1e-5, True), layer_norm, (x, scale, bias)),
                            (lambda x, s: k.normalize(x, s, None, 1e-5, False), rms_norm,
                             (x, scale))]:
        np.testing.assert_allclose(got(*args), want(*args), rtol=1e-5, atol=1e-5)
        for a, b in zip(grads(got, args), grads(want, args)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_cross_entropy_ignores_vocabulary_padding():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 12, (2, 5)))
    padded = jnp.where(jnp.arange(16) < 12, logits, -jnp.inf)
    # -log softmax over the 12 real entries, by hand
    real = np.asarray(logits[..., :12], np.float64)
    log_z = np.log(np.exp(real).sum(-1))
    expected = np.mean(log_z - np.take_along_axis(real, np.asarray(targets)[..., None], -1)[..., 0])
    assert float(cross_entropy(padded, targets)) == pytest.approx(expected, rel=1e-6)
    grads = jax.grad(lambda x: cross_entropy(jnp.where(jnp.arange(16) < 12, x, -jnp.inf),
                                             targets))(logits)
    assert np.all(np.asarray(grads[..., 12:]) == 0)


def test_only_the_execution_module_asks_for_the_backend():
    """Which backend runs decides what "auto" means, in one place (`models.execution`); the
    kernels and everything else ask it."""
    asking = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if "default_backend" in p.read_text())
    assert asking == ["models/execution.py"]
