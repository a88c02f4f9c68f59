"""FP8 matrix products (`model.fp8`): the blocks' projections and the output head as 8-bit
floating-point dot products, for the FP8 matrix units of NVIDIA GPUs from Ada and Hopper on.

Each product quantizes both operands to `float8_e4m3fn` (3 mantissa bits, range +-448), runs the
dot with float32 accumulation and rescales the result into the compute dtype; its backward pass
quantizes the incoming gradient to `float8_e5m2` (2 mantissa bits, range +-57,344: gradients
need range more than precision) and forms both operand gradients as FP8 products of it with
the forward's quantized operands, which are what the forward keeps for it (a byte an element).

**Current scaling.** Every tensor is scaled by its own absolute maximum at the moment it is
quantized (one scale per tensor), not by an amax history from earlier steps (delayed scaling).
Delayed scaling saves a reduction over each operand but needs state: a history per projection
per layer, updated by every step, which would live beside the parameters, be skipped by the
optimizer, ride through the layer scan, gradient accumulation (whose microbatch updates it?) and
pipeline stages, and be checkpointed, and it saturates when a tensor's range jumps between
steps. Current scaling needs none of that: parameters, optimizer state and checkpoints are
exactly those of a run without FP8, so a run moves in and out of FP8 between resumes, and no
value is ever clipped. The price is one pass over each operand for its maximum, which XLA can
fuse into the operand's producer.

Scales are powers of two (the largest that keeps amax x scale within the format's maximum), so
scaling and unscaling are exact and the only error is the FP8 rounding itself; the operand then
uses between half and all of the format's range.

The quantized operands are dequantized (converted back up and multiplied by the inverse scale)
right before a dot in the compute dtype: the pattern XLA's GPU compiler rewrites into one FP8
GEMM (cuBLASLt) with the scales as its arguments (not yet seen on a GPU: no FP8 run of minigpt
has been measured); elsewhere (a CPU) XLA computes the same casts and the same float32
accumulation, so the tests check the numerics there. Products whose sizes are
not multiples of 16 (what an FP8 GEMM needs) run as plain products, as do those of KV-cache
decoding (`suspended`): a step of one token per row is bound by reading the weights, and
quantizing them afresh each step would only read them more.

`running(cfg)` enters a model's choice (the decoder's entry points call it, as they enter their
kernel choice) and `active()` tells the layers (`minigpt.models.layers.Dense`, `Embedding.attend`)
whether to use `einsum` here. `check(cfg)` refuses in one line what cannot run: a GPU without
FP8 (compute capability under 8.9), a TPU, a mixture of experts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from minigpt.config import ConfigError, ModelConfig

E4M3 = jnp.float8_e4m3fn  # forward operands: activations and weights
E5M2 = jnp.float8_e5m2  # gradients
# An FP8 GEMM wants each of its sizes (rows, contraction, columns) a multiple of this.
GEMM_MULTIPLE = 16
# The first NVIDIA compute capability with FP8 matrix units (Ada; Hopper is 9.0).
FP8_COMPUTE_CAPABILITY = (8, 9)
# Scales stay within 2^+-SCALE_EXPONENT: a tensor of tiny values gets a finite one.
SCALE_EXPONENT = 100

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("minigpt.fp8", default=False)
_suspended: contextvars.ContextVar[bool] = contextvars.ContextVar("minigpt.fp8.suspended",
                                                                  default=False)


def active() -> bool:
    """Whether the running model asked for FP8 products (and they are not suspended)."""
    return _enabled.get()


@contextlib.contextmanager
def running(cfg: ModelConfig) -> Iterator[None]:
    """Run a model's code with its FP8 choice in the context (checked first: `check`)."""
    on = cfg.fp8 and not _suspended.get()
    if on:
        check(cfg)
    token = _enabled.set(on)
    try:
        yield
    finally:
        _enabled.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Plain products inside, whatever the models' `fp8` says (KV-cache decoding)."""
    token, enabled = _suspended.set(True), _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(enabled)
        _suspended.reset(token)


def check(cfg: ModelConfig, device: jax.Device | None = None) -> None:
    """Refuse `model.fp8` (ConfigError, one line) where it cannot run: on a GPU before Ada
    (compute capability under 8.9), on a TPU, and for a mixture of experts. A CPU runs it
    emulated (the same numbers, no faster)."""
    if not cfg.fp8:
        return
    if cfg.num_experts:
        raise ConfigError(
            f"model.fp8 with a mixture of experts (model.num_experts {cfg.num_experts}): the "
            f"experts' grouped products (jax.lax.ragged_dot) have no FP8 form here, so most of "
            f"its matmuls would not run in FP8; train it without model.fp8")
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        raise ConfigError("model.fp8 is for NVIDIA GPUs with FP8 matrix units (compute "
                          "capability 8.9 or later: Ada, Hopper, Blackwell); this TPU has none "
                          "XLA uses for these products: drop model.fp8")
    capability = getattr(device, "compute_capability", None)
    if device.platform in ("gpu", "cuda") and capability is not None:
        found = tuple(int(part) for part in str(capability).split(".")[:2])
        if found < FP8_COMPUTE_CAPABILITY:
            raise ConfigError(
                f"model.fp8 needs FP8 matrix units (compute capability 8.9 or later: Ada, "
                f"Hopper, Blackwell); this {device.device_kind} has compute capability "
                f"{capability}: drop model.fp8 (bfloat16 is what it runs fastest)")


# Quantizing ---------------------------------------------------------------------------------


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """The power-of-two scale that maps a tensor of absolute maximum `amax` into FP8 `dtype`:
    the largest 2^k with amax x 2^k <= the format's maximum (a float32 scalar; NaN where amax is
    not finite, so that the product is NaN too). Found from the exponents alone (frexp, ldexp):
    log2 and exp2 are not exact in float32 (exp2(30) came out below 2^30 on XLA's CPU)."""
    top_mantissa, top_exponent = math.frexp(float(jnp.finfo(dtype).max))  # 448: 0.875 x 2^9
    mantissa, exponent = jnp.frexp(amax.astype(jnp.float32))
    k = top_exponent - exponent - (mantissa > top_mantissa).astype(exponent.dtype)
    scale = jnp.ldexp(jnp.float32(1.0), jnp.clip(k, -SCALE_EXPONENT, SCALE_EXPONENT))
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def quantize(x: jax.Array, dtype, scale: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """x as FP8 `dtype` and its scale: q = x x scale, rounded to the nearest FP8 value and
    saturated at the format's maximum (a finite value never becomes NaN or infinity); q / scale
    approximates x. The scale is x's own (`scale_for` its absolute maximum) unless given."""
    if scale is None:
        scale = scale_for(jnp.max(jnp.abs(x)), dtype)
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """An FP8 tensor back in `dtype`: q / scale (exact in bfloat16 and float32, whose exponent
    range holds every scaled FP8 value)."""
    return q.astype(dtype) * (1.0 / scale).astype(dtype)


# The product --------------------------------------------------------------------------------


def _parse(spec: str) -> tuple[str, str, str]:
    inputs, y = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, y


def _letters(subscripts: str, leading: int) -> list[str]:
    """One name per dimension, "..." standing for `leading` leading dimensions."""
    if "..." not in subscripts:
        return list(subscripts)
    return [f".{i}" for i in range(leading)] + list(subscripts.replace("...", ""))


def suits(spec: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> bool:
    """Whether the product `spec` of x and w makes an FP8 GEMM: a projection (x's rows times
    w's columns, contracted over what they share) whose row, contraction and column sizes are
    multiples of `GEMM_MULTIPLE`."""
    xs, ws, ys = _parse(spec)
    if "..." in ws:
        return False
    leading = len(x_shape) - len(xs.replace("...", ""))  # the dimensions "..." covers
    x_letters, w_letters = _letters(xs, leading), list(ws)
    y_letters = set(_letters(ys, leading))
    if not set(w_letters) <= set(x_letters) | y_letters:
        return False
    sizes = dict(zip(x_letters, x_shape)) | dict(zip(w_letters, w_shape))
    rows = math.prod(sizes[a] for a in x_letters if a not in w_letters)
    inner = math.prod(sizes[a] for a in x_letters if a in w_letters and a not in y_letters)
    columns = math.prod(sizes[a] for a in w_letters if a not in x_letters)
    return all(n % GEMM_MULTIPLE == 0 for n in (rows, inner, columns))


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` as an FP8 product (e4m3 operands, float32 accumulation, e5m2
    gradients, per-tensor current scaling), in x's dtype; a plain product where the sizes make
    no FP8 GEMM (`suits`). `spec` is a projection's: "BTD,DNH->BTNH", "...D,VD->...V"."""
    if not suits(spec, x.shape, w.shape):
        return jnp.einsum(spec, x, w)
    return _fp8_einsum(spec, x, w)


def _product(spec: str, a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
             dtype) -> jax.Array:
    """Two FP8 tensors dequantized into `dtype` and contracted, accumulating in float32."""
    return jnp.einsum(spec, dequantize(a, a_scale, dtype), dequantize(b, b_scale, dtype),
                      preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return _fp8_einsum_fwd(spec, x, w)[0]


def _fp8_einsum_fwd(spec, x, w):
    xq, x_scale = quantize(x, E4M3)
    wq, w_scale = quantize(w, E4M3)
    y = _product(spec, xq, x_scale, wq, w_scale, x.dtype).astype(x.dtype)
    # Scalars of x's and w's dtypes: the gradients must come back in them.
    like = (jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))
    return y, (xq, x_scale, wq, w_scale, like)


def _fp8_einsum_bwd(spec, residuals, g):
    xq, x_scale, wq, w_scale, (like_x, like_w) = residuals
    xs, ws, ys = _parse(spec)
    gq, g_scale = quantize(g, E5M2)
    # The product's two transposes: y's gradient against w gives x's, x against it gives w's
    # ("..." in x and y summed over for w's).
    d_x = _product(f"{ys},{ws}->{xs}", gq, g_scale, wq, w_scale, g.dtype)
    d_w = _product(f"{xs},{ys}->{ws}", xq, x_scale, gq, g_scale, g.dtype)
    return d_x.astype(like_x.dtype), d_w.astype(like_w.dtype)


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)
