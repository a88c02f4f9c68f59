"""FP8 products (`model.fp8`, minigpt.models.fp8), emulated on the CPU: the formats' ranges, the
power-of-two scales, rounding and saturation; the product and both its gradients against float32
within FP8's error bound, and against an independent emulation; the layers and models that use
it; refusals; one step under dp and fsdp equal to one device's; LoRA and gradient accumulation;
(slow:) steps under dp_tp, pp and cp, 200 steps against bfloat16, and a run trained with FP8
resuming and generating without it."""

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import losses, random_batch, small_vocab
from flax import nnx

import minigpt.models.fp8 as fp8
from minigpt import sharding
from minigpt.config import ConfigError, TrainConfig
from minigpt.models import build_model
from minigpt.models.layers import Dense, Embedding

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# Half the spacing of FP8 values next to 1 (the largest relative rounding error of a normal
# value): 3 mantissa bits (e4m3), 2 (e5m2).
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3
# Half the smallest subnormal: the largest absolute rounding error below the normal range
# (2^-6 for e4m3, 2^-14 for e5m2), in units of the scaled tensor.
SUB_E4M3, SUB_E5M2 = 2.0**-10, 2.0**-17


def test_the_formats_ranges():
    assert float(jnp.finfo(fp8.E4M3).max) == E4M3_MAX
    assert float(jnp.finfo(fp8.E5M2).max) == E5M2_MAX
    assert float(jnp.finfo(fp8.E4M3).smallest_subnormal) == 2.0 * SUB_E4M3
    assert float(jnp.finfo(fp8.E5M2).smallest_subnormal) == 2.0 * SUB_E5M2
    assert jnp.finfo(fp8.E4M3).nmant == 3 and jnp.finfo(fp8.E5M2).nmant == 2


@pytest.mark.parametrize("dtype, top", [(fp8.E4M3, E4M3_MAX), (fp8.E5M2, E5M2_MAX)])
def test_scales_are_the_largest_powers_of_two_that_fit(dtype, top):
    amax = jnp.asarray([3e-7, 0.02, 1.0, 447.0, 448.0, 449.0, 5e4, 57344.0, 6e4, 3e30])
    scale = np.asarray(jax.jit(jax.vmap(lambda a: fp8.scale_for(a, dtype)))(amax))
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5)  # exact powers of two
    scaled = np.asarray(amax, np.float64) * scale
    assert np.all(scaled <= top) and np.all(scaled > top / 2)
    # Tiny maxima get the largest scale, 2^100, not an infinite one; an all-zero tensor a
    # finite one, and zeros; a maximum that is not finite a NaN.
    assert float(fp8.scale_for(jnp.float32(1e-35), dtype)) == 2.0**fp8.SCALE_EXPONENT
    q, zero_scale = fp8.quantize(jnp.zeros((4, 4)), dtype)
    assert np.isfinite(float(zero_scale)) and not np.any(np.asarray(q.astype(jnp.float32)))
    assert np.isnan(float(fp8.scale_for(jnp.float32(np.inf), dtype)))


@pytest.mark.parametrize("dtype, u, sub", [(fp8.E4M3, U_E4M3, SUB_E4M3),
                                           (fp8.E5M2, U_E5M2, SUB_E5M2)])
def test_quantizing_rounds_to_the_nearest_fp8_value(dtype, u, sub):
    x = jax.random.normal(jax.random.key(0), (64, 96)) * jnp.exp(
        jax.random.uniform(jax.random.key(1), (64, 96), minval=-12, maxval=3))
    q, scale = fp8.quantize(x, dtype)
    assert q.dtype == dtype
    back = np.asarray(fp8.dequantize(q, scale, jnp.float32))
    # The same rounding through ml_dtypes' own cast (round to nearest even), in numpy.
    s = float(scale)
    expected = (np.asarray(x) * s).astype(np.dtype(dtype)).astype(np.float32) / s
    np.testing.assert_array_equal(back, expected)
    err = np.abs(back - np.asarray(x))
    assert np.all(err <= np.maximum(u * np.abs(np.asarray(x)), sub / s))
    assert np.abs(np.asarray(x)).max() * s > float(jnp.finfo(dtype).max) / 2  # range used
    # In bfloat16 the round trip is the same: every scaled FP8 value is a bfloat16 value.
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(q, scale, jnp.bfloat16),
                                             np.float32), back)


@pytest.mark.parametrize("dtype, top", [(fp8.E4M3, E4M3_MAX), (fp8.E5M2, E5M2_MAX)])
def test_values_past_the_range_saturate_and_nan_stays_nan(dtype, top):
    x = jnp.asarray([0.5, -3.0, 1e6, -1e6, 1e38, jnp.inf, -jnp.inf, jnp.nan])
    q, _ = fp8.quantize(x, dtype, scale=jnp.float32(1.0))
    got = np.asarray(q.astype(jnp.float32))
    np.testing.assert_array_equal(got[:7], [0.5, -3.0, top, -top, top, top, -top])
    assert np.isnan(got[7])
    # A tensor's own scale never saturates it; a NaN in it makes its scale (so its product) NaN.
    q, scale = fp8.quantize(jnp.asarray([0.5, -3.0, 1e3, -1e3]), dtype)
    np.testing.assert_allclose(np.asarray(fp8.dequantize(q, scale, jnp.float32)),
                               [0.5, -3.0, 1e3, -1e3], rtol=U_E5M2)
    assert np.isnan(float(fp8.quantize(x, dtype)[1]))


def _emulated(a, a_dtype, b, b_dtype):
    """Each operand rounded to its FP8 format at its own power-of-two scale, in float64: an
    emulation written apart from minigpt.models.fp8 (numpy and ml_dtypes alone)."""
    out = []
    for t, dtype in ((a, a_dtype), (b, b_dtype)):
        t = np.asarray(t, np.float64)
        top = float(ml_dtypes.finfo(dtype).max)
        s = 2.0 ** np.floor(np.log2(top / np.abs(t).max()))
        out.append((t * s).astype(dtype).astype(np.float64) / s)
    return out


def _bound(a, a_scale, u_a, sub_a, b, b_scale, u_b, sub_b, spec):
    """The largest error rounding both operands can make in each element of einsum(spec, a, b):
    sum |a err| (|b| + |b err|) + |a| |b err|, each element's error at most u |t| or the
    half-subnormal at its scale."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    ea, eb = np.maximum(u_a * a, sub_a / a_scale), np.maximum(u_b * b, sub_b / b_scale)
    return np.einsum(spec, ea, b + eb) + np.einsum(spec, a, eb)


SPECS = [("BTD,DNH->BTNH", (4, 16, 64), (64, 4, 16)),  # the query heads
         ("BTNH,NHD->BTD", (4, 16, 4, 16), (4, 16, 32)),  # attention's output projection
         ("...D,VD->...V", (4, 16, 32), (128, 32))]  # a tied output head


@pytest.mark.parametrize("spec, x_shape, w_shape", SPECS)
def test_the_product_and_its_gradients_are_fp8_ones_within_fp8s_error(spec, x_shape, w_shape):
    x = jax.random.normal(jax.random.key(0), x_shape)
    w = jax.random.normal(jax.random.key(1), w_shape) * 0.05
    g = jax.random.normal(jax.random.key(2), jnp.einsum(spec, x, w).shape)
    assert fp8.suits(spec, x.shape, w.shape)
    y, pull_back = jax.vjp(lambda x, w: fp8.einsum(spec, x, w), x, w)
    d_x, d_w = pull_back(g)
    y32, pull_back32 = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    d_x32, d_w32 = pull_back32(g)
    flat = spec.replace("...", "YZ"[:len(x_shape) - 1])  # letters for what "..." covers
    xs, ws, ys = flat.replace("->", ",").split(",")
    spec_x, spec_w = f"{ys},{ws}->{xs}", f"{xs},{ys}->{ws}"
    # Against the emulation: the forward from e4m3 operands, the backward from an e5m2 gradient.
    xe, we = _emulated(x, ml_dtypes.float8_e4m3fn, w, ml_dtypes.float8_e4m3fn)
    ge, _ = _emulated(g, ml_dtypes.float8_e5m2, w, ml_dtypes.float8_e4m3fn)
    for got, want in ((y, np.einsum(flat, xe, we)), (d_x, np.einsum(spec_x, ge, we)),
                      (d_w, np.einsum(spec_w, xe, ge))):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max())
    # Against float32: within the bound rounding the operands allows, and not float32 itself.
    def scale(t, top):
        return 2.0 ** np.floor(np.log2(top / np.abs(np.asarray(t)).max()))

    sx, sw, sg = scale(x, E4M3_MAX), scale(w, E4M3_MAX), scale(g, E5M2_MAX)
    cases = ((y, y32, _bound(x, sx, U_E4M3, SUB_E4M3, w, sw, U_E4M3, SUB_E4M3, flat)),
             (d_x, d_x32, _bound(g, sg, U_E5M2, SUB_E5M2, w, sw, U_E4M3, SUB_E4M3, spec_x)),
             (d_w, d_w32, _bound(x, sx, U_E4M3, SUB_E4M3, g, sg, U_E5M2, SUB_E5M2, spec_w)))
    for got, want, bound in cases:
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        assert np.all(err <= bound * (1 + 1e-4) + 1e-5 * np.abs(np.asarray(want)).max())
        relative = np.linalg.norm(err) / np.linalg.norm(np.asarray(want))
        assert 1e-3 < relative < 0.1  # FP8's rounding, a few percent: not float32's
    assert d_x.dtype == x.dtype and d_w.dtype == w.dtype


def test_sizes_that_make_no_fp8_gemm_run_the_plain_product():
    x = jax.random.normal(jax.random.key(0), (2, 8, 64))
    assert not fp8.suits("BTD,DO->BTO", x.shape, (64, 1))  # one column (a shared expert's gate)
    assert not fp8.suits("BTD,DF->BTF", (1, 1, 64), (64, 128))  # one row (a decode step)
    assert not fp8.suits("BTD,DF->BTF", x.shape, (40, 128))  # contraction 40
    w = jax.random.normal(jax.random.key(1), (64, 1))
    np.testing.assert_array_equal(np.asarray(fp8.einsum("BTD,DO->BTO", x, w)),
                                  np.asarray(jnp.einsum("BTD,DO->BTO", x, w)))


def test_layers_use_fp8_products_only_inside_a_model_that_asks():
    rngs = nnx.Rngs(0)
    dense = Dense("BTD,DF->BTF", (64, 128), ("embed", "mlp"), init=nnx.initializers.lecun_normal(),
                  use_bias=True, dtype="float32", rngs=rngs)
    table = Embedding(256, 64, ("vocab", "embed"), init=nnx.initializers.normal(1.0),
                      dtype="float32", rngs=rngs)
    x = jax.random.normal(jax.random.key(0), (2, 16, 64))
    plain_y, plain_logits = dense(x), table.attend(x)
    with fp8.running(small_vocab("llama-tiny", fp8=True)):
        assert fp8.active()
        y, logits = dense(x), table.attend(x)
        with fp8.suspended():
            assert not fp8.active()
            np.testing.assert_array_equal(np.asarray(dense(x)), np.asarray(plain_y))
    assert not fp8.active()
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(fp8.einsum("BTD,DF->BTF", x, dense.kernel[...])
                                  + dense.bias[...]))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(
        fp8.einsum("...D,VD->...V", x, table.table[...])))
    assert not np.array_equal(np.asarray(y), np.asarray(plain_y))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(plain_logits), rtol=0.1,
                               atol=0.1 * float(jnp.abs(plain_logits).max()))


def _device(platform, capability=None, kind="NVIDIA A100-SXM4-40GB"):
    found = SimpleNamespace(platform=platform, device_kind=kind)
    if capability is not None:
        found.compute_capability = capability
    return found


def test_refusals_name_the_device_or_the_combination():
    cfg = small_vocab("llama-tiny", fp8=True)
    fp8.check(cfg, _device("cpu"))  # emulated
    fp8.check(cfg, _device("gpu", "8.9", "NVIDIA L4"))  # Ada
    fp8.check(cfg, _device("gpu", "9.0", "NVIDIA H100 80GB HBM3"))
    fp8.check(cfg, _device("gpu", "10.0", "NVIDIA B200"))
    fp8.check(dataclasses.replace(cfg, fp8=False), _device("gpu", "8.0"))  # not asked: fine
    with pytest.raises(ConfigError, match=r"compute capability 8.0.*drop model.fp8") as refused:
        fp8.check(cfg, _device("gpu", "8.0"))
    assert "\n" not in str(refused.value) and "A100" in str(refused.value)
    with pytest.raises(ConfigError, match="TPU"):
        fp8.check(cfg, _device("tpu", kind="TPU v5 lite"))
    with pytest.raises(ConfigError, match="mixture of experts"):
        fp8.check(small_vocab("moe-tiny", fp8=True), _device("gpu", "9.0"))
    # A model refuses when it runs, on this machine's own device (a mixture, here).
    moe = build_model(small_vocab("moe-tiny", fp8=True), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="mixture of experts"):
        moe(jnp.zeros((1, 16), jnp.int32))


VOCAB = 4096
TINY = small_vocab("llama-tiny", fp8=True, kernels="reference")
TRAIN = TrainConfig(steps=10, warmup_steps=2, batch_size=16, lr=3e-3)


def _step(cfg, preset_name=None, microbatches=1, adapters=None):
    """One train step of `cfg` on batch 16 x 32 (seed 0) from seed-0 weights: on one device
    outside any mesh, or laid out by a preset on the 8 simulated devices. Its metrics."""
    from minigpt.models import lora
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    def build():
        model = build_model(cfg, rngs=nnx.Rngs(0))
        if adapters:
            lora.attach(model, adapters, key=jax.random.key(1))
        return model, nnx.Optimizer(model, make_optimizer(TRAIN), wrt=lora.trainable(model))

    rates, batch = lr_schedule.lr_schedule(TRAIN), random_batch(VOCAB, 16, 32)
    if preset_name is None:
        model, optimizer = build()
        metrics = steps.train_step(model, optimizer, {k: jnp.asarray(v) for k, v in
                                                      batch.items()}, jax.random.key(7), rates,
                                   microbatches=microbatches)
        return {k: float(v) for k, v in metrics.items()}
    layout = sharding.Layout.make(preset_name).checked(
        model=cfg.arch, num_layers=cfg.num_layers, batch_size=16, seq_len=32)
    model, optimizer = sharding.create_sharded(build, layout)
    with layout.active():
        metrics = steps.train_step(model, optimizer, layout.put_batch(batch),
                                   jax.random.key(7), rates, microbatches=microbatches)
    return {k: float(v) for k, v in metrics.items()}


_one_device: dict = {}


def one_device(cfg):
    if cfg not in _one_device:
        _one_device[cfg] = _step(cfg)
    return _one_device[cfg]


# fsdp splits the weights and the batch (each tensor's maximum gathered across devices); dp, the
# batch alone. Each compiles two steps (about 13 s on 2 cores), so both run in the slow set; the
# default run checks FP8's step on one device (with adapters and accumulation, below).
@pytest.mark.parametrize("preset_name", [pytest.param("dp", marks=pytest.mark.slow),
                                         pytest.param("fsdp", marks=pytest.mark.slow)])
def test_one_step_under_a_preset_equals_one_devices(preset_name):
    # Each tensor's scale is its maximum over all of it, whichever devices hold its pieces, so
    # the same values round the same way: the forward agrees to float32's summation order. In
    # the backward that order moves a few gradient elements across a rounding boundary of e5m2,
    # whose steps are 12.5-25%: the gradient agrees to a fiftieth of FP8's own error (~10%).
    ref = one_device(TINY)
    got = _step(TINY, preset_name)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("model_name, preset_name", [("llama-tiny", "dp_tp"),
                                                     ("minigpt-tiny8", "pp"),
                                                     ("llama-tiny", "cp")])
def test_fp8_steps_under_tensor_pipeline_and_context_parallel_presets(model_name, preset_name):
    # Heads split over devices, layers in pipeline stages, sequences split: each step within
    # FP8's noise of the same step without it under the same preset.
    cfg = small_vocab(model_name, fp8=True, kernels="reference")
    fp8_step = _step(cfg, preset_name)
    plain_step = _step(dataclasses.replace(cfg, fp8=False), preset_name)
    assert fp8_step["loss"] == pytest.approx(plain_step["loss"], rel=1e-3)
    assert fp8_step["loss"] != plain_step["loss"]
    assert fp8_step["grad_norm"] == pytest.approx(plain_step["grad_norm"], rel=0.05)


def test_adapters_and_gradient_accumulation_train_in_fp8():
    from minigpt.models.lora import Adapters

    ref = one_device(TINY)
    # Accumulating two halves: each microbatch scales its own tensors, so rounding differs a bit.
    halves = _step(TINY, microbatches=2)
    assert halves["loss"] == pytest.approx(ref["loss"], rel=1e-2)
    assert halves["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.1)
    # Adapters (every projection but the head) over a frozen base whose products are FP8: within
    # FP8's noise of the same adapters over a plain base, and not equal to it.
    adapters = Adapters(rank=4, alpha=8.0, targets=("query", "key", "value", "out", "gate",
                                                    "up", "down"))
    with_adapters = _step(TINY, adapters=adapters, microbatches=2)
    plain_adapters = _step(dataclasses.replace(TINY, fp8=False), adapters=adapters,
                           microbatches=2)
    assert with_adapters["loss"] == pytest.approx(plain_adapters["loss"], rel=1e-2)
    assert with_adapters["loss"] != plain_adapters["loss"]
    assert with_adapters["grad_norm"] == pytest.approx(plain_adapters["grad_norm"], rel=0.1)
    assert all(math.isfinite(v) for v in with_adapters.values())


def _run(data_4k, out, cfg, resume=False, **changes):
    from minigpt import train

    settings = dict(preset="dp", model="llama-tiny", data=(str(data_4k),), out=str(out),
                    batch_size=8, seq_len=32, lr=3e-3, warmup_steps=10, log_every=1,
                    eval_every=10_000, eval_batches=1, save_every=10_000)
    config = TrainConfig(**{**settings, **changes})
    return train.train(cfg, config, resume=resume, sample=False)


@pytest.mark.slow
def test_200_steps_in_fp8_end_within_2_percent_of_bfloat16(data_4k, tmp_path, optimised):
    cfg = small_vocab("llama-tiny", dtype="bfloat16")
    _run(data_4k, tmp_path / "bf16", cfg, steps=200)
    _run(data_4k, tmp_path / "fp8", dataclasses.replace(cfg, fp8=True), steps=200)
    plain, quantized = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert len(plain) == len(quantized) == 200
    assert plain[-1] < plain[0] - 2.0  # it learned
    # The same batches in the same order: the last 20 steps' mean losses.
    end_plain, end_fp8 = np.mean(plain[-20:]), np.mean(quantized[-20:])
    assert abs(end_fp8 - end_plain) <= 0.02 * end_plain, (end_plain, end_fp8)


@pytest.mark.slow
def test_a_run_trained_in_fp8_resumes_and_generates_without_it(data_4k, tmp_path):
    from minigpt.generate import generate_tokens
    from minigpt.runs import load_run

    cfg = dataclasses.replace(TINY, kernels="auto")
    out = tmp_path / "run"
    _run(data_4k, out, cfg, steps=3, save_every=3, warmup_steps=1)
    trained = load_run(out)
    assert trained.model.config.fp8
    # Nothing of FP8 is state: the same parameters, all float32, as a model built without it.
    plain = build_model(dataclasses.replace(cfg, fp8=False), rngs=nnx.Rngs(0))
    state = nnx.state(trained.model, nnx.Param)
    assert jax.tree.structure(state) == jax.tree.structure(nnx.state(plain, nnx.Param))
    assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(state))
    # It resumes without FP8 (an execution field) from its step-3 checkpoint.
    summary = _run(data_4k, out, dataclasses.replace(cfg, fp8=False), resume=True, steps=5,
                   save_every=5, warmup_steps=1)
    assert summary["step"] == 5 and len(losses(out)) == 5
    assert all(map(math.isfinite, losses(out)))
    resumed = load_run(out)
    assert not resumed.model.config.fp8
    # Generation decodes with plain products whatever the run says: the tokens of a model
    # without FP8 holding the same weights.
    nnx.update(plain, nnx.state(resumed.model, nnx.Param))
    as_fp8 = build_model(cfg, rngs=nnx.Rngs(0))
    nnx.update(as_fp8, nnx.state(resumed.model, nnx.Param))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    assert generate_tokens(as_fp8, prompts, max_new_tokens=6, temperature=0.0) == \
        generate_tokens(plain, prompts, max_new_tokens=6, temperature=0.0)
