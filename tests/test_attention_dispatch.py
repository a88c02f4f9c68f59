"""The attention dispatch (minigpt.models.kernels, minigpt.models.attention): what "auto" means
on each backend, the fused kernels' fallback to XLA (said once, with the reason), and that the
fallback, the CPU kernels and the plain reference train the same numbers for every
architecture, with documents packed in a window and grouped-query heads. Splash, the TPU kernel,
is checked in Pallas' interpreter."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt import explain, sharding
from minigpt.models import attention, build_model, execution, get_config, kernels
from minigpt.models.masks import AttentionInputs, document_positions

B, T, VOCAB = 2, 128, 256  # 2 of the CPU kernels' attention blocks, one of Splash's


def tiny(arch: str, layers: int = 2):
    """A small model of `arch` with grouped-query heads (4 query heads, 2 key/value)."""
    base = {"minigpt": "minigpt-tiny", "gpt2": "gpt2-tiny", "llama": "llama-tiny"}[arch]
    return dataclasses.replace(get_config(base), embed_dim=32, num_heads=4, num_kv_heads=2,
                               mlp_dim=64, vocab_size=VOCAB, dropout=0.0, num_layers=layers)


def packed_batch(seed: int = 0) -> dict[str, jax.Array]:
    """Random tokens in windows holding several documents (ids 1, 2, ...; a padded tail, 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    cuts = [np.sort(rng.choice(np.arange(1, T - 8), 3, replace=False)) for _ in range(B)]
    segments = np.stack([np.searchsorted(c, np.arange(T), side="right") + 1 for c in cuts])
    segments[:, -5:] = 0  # padding: attends to padding only, never trained
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": jnp.asarray(segments, jnp.int32)}


def loss_and_grads(cfg, batch):
    model = build_model(cfg, rngs=nnx.Rngs(1))
    loss, grads = nnx.value_and_grad(lambda m, b: m.loss(b))(model, batch)
    return float(loss), {k: np.asarray(v.get_value())
                         for k, v in nnx.to_flat_state(nnx.state(grads))}


@pytest.fixture(autouse=True)
def _fresh_fallbacks(monkeypatch):
    monkeypatch.setattr(kernels, "FALLBACKS", [])


def test_auto_means_each_backends_own_kernels_and_dtype(monkeypatch):
    assert execution.kernel_set("auto", "cpu") == "cpu"
    assert execution.compute_dtype("auto", "cpu") == "float32"
    for backend, kernel in (("gpu", "cudnn"), ("tpu", "splash"), ("METAL", "reference")):
        monkeypatch.setattr(kernels.jax, "default_backend", lambda b=backend: b)
        assert execution.kernel_set("auto") == kernel
        assert execution.compute_dtype("auto") == "bfloat16"
        assert execution.compute_dtype("float32") == "float32"  # the opt-out is kept
    assert kernels.describe("auto", "float32").startswith("kernels reference (auto: plain JAX")
    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
    assert kernels.describe("auto", "auto") == (
        "kernels cudnn (auto: cuDNN flash attention, XLA's where cuDNN refuses a call), "
        "computing in bfloat16 (auto)")


@pytest.mark.parametrize("arch, layers", [
    ("llama", 1), pytest.param("llama", 2, marks=pytest.mark.slow),
    pytest.param("minigpt", 2, marks=pytest.mark.slow),
    pytest.param("gpt2", 2, marks=pytest.mark.slow)])
def test_fused_fallback_cpu_kernels_and_reference_train_the_same(arch, layers, float32_compute):
    """cudnn on a CPU runs XLA's attention (said once); its loss and every gradient, the CPU
    kernels' and the reference's agree to 1e-5 with documents and grouped heads (in float32:
    on a GPU, where cuDNN refuses float32, the same holds of its fallback)."""
    batch = packed_batch()
    results = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for name in ("reference", "cpu", "cudnn"):
            cfg = dataclasses.replace(tiny(arch, layers), kernels=name)
            results[name] = loss_and_grads(cfg, batch)
    refusals = [str(w.message) for w in said if "refused" in str(w.message)]
    if jax.default_backend() == "cpu":  # a GPU refuses float32 in its own words
        assert refusals == [
            "cudnn attention refused this call (it runs on the gpu backend, and this one is "
            "cpu); XLA's attention runs instead"]
    ref_loss, ref_grads = results["reference"]
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    for name in ("cpu", "cudnn"):
        loss, grads = results[name]
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert grads.keys() == ref_grads.keys() and len(grads) > 8
        for path, g in grads.items():
            np.testing.assert_allclose(g, ref_grads[path], rtol=1e-5, atol=1e-5 * scale,
                                       err_msg=f"{name} {path}")


def qkv(seed=0, batch=B, heads=4, kv_heads=2, H=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(batch, T, n, H)), dtype)
                 for n in (heads, kv_heads, kv_heads))


def test_a_refusal_falls_back_to_xla_and_is_said_once(monkeypatch):
    """The kernel's own refusal, not ours: with the backend check passed, JAX's cuDNN path
    refuses this CPU (or, on a CUDA build, these float32 inputs) while tracing."""
    monkeypatch.setitem(kernels.FUSED_BACKENDS, "cudnn", jax.default_backend())
    q, k, v = qkv()
    segments = packed_batch()["segment_ids"]
    attn = AttentionInputs(document_positions(segments), segments)
    fused = kernels.get("cudnn")
    with pytest.warns(UserWarning, match=r"cudnn attention refused this call \(.*Error: .*\); "
                                         r"XLA's attention runs instead"):
        out = fused.causal_attention(q, k, v, attn)
    np.testing.assert_array_equal(out, kernels.get("reference").causal_attention(q, k, v,
                                                                                 attn))
    assert len(kernels.FALLBACKS) == 1 and kernels.FALLBACKS[0].startswith("cudnn: ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second refusal for the same reason is quiet
        fused.causal_attention(q, k, v, attn)
        mask = jnp.ones((B, 1, T, T), bool)  # the cache holds each KV head's keys together
        np.testing.assert_allclose(fused.cached_attention(q, k.swapaxes(1, 2),
                                                          v.swapaxes(1, 2), mask),
                                   jax.nn.dot_product_attention(q, k, v, mask=mask),
                                   rtol=1e-5, atol=1e-6)


def test_splash_refuses_what_does_not_fit_its_blocks():
    q, k, v = (x[:, :96] for x in qkv())
    with pytest.raises(attention.Refused, match="96 positions does not cut into Splash's 128"):
        attention.splash(q, k, v)


@pytest.mark.slow
def test_splash_in_the_interpreter_equals_the_reference_alone_and_under_a_preset():
    """The TPU kernel's wrapping (scaled queries, heads first, grouped heads, documents as
    segment ids, the shard_map over the batch and the heads) checked in Pallas' interpreter
    (the context's `splash_interpret`): outputs and gradients equal to the plain reference's."""
    q, k, v = qkv(batch=4)
    segments = jnp.concatenate([packed_batch(1)["segment_ids"]] * 2)
    attn = AttentionInputs(document_positions(segments), segments)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)

    def grads(ops):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(ops.causal_attention(q, k, v, attn)) * weights)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want = grads(kernels.get("reference"))
    preset = sharding.load_preset("dp_tp")  # batch over data=4, heads over model=2
    for context in (None, preset):
        if context is None:
            with sharding.running(splash_interpret=True):
                got = grads(kernels.get("splash"))
        else:
            with sharding.Layout.make(preset).active(), sharding.running(splash_interpret=True):
                got = grads(kernels.get("splash"))
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert kernels.FALLBACKS == []


def test_the_explainer_names_the_kernels_and_the_compute_dtype(capsys):
    assert explain.main(["--model", "minigpt-tiny", "--preset", "dp"]) == 0
    said = {"cpu": "kernels cpu (auto: CPU-tuned: blocked attention, fused loss, written-out "
                   "backward passes), computing in float32 (auto)",
            "gpu": "kernels cudnn (auto: cuDNN flash attention, XLA's where cuDNN refuses a "
                   "call), computing in bfloat16 (auto)"}
    assert said[jax.default_backend()] in capsys.readouterr().out
