"""The one sampler: each row's next token from its logits, every row with its own settings.

A row's settings (`Sampling`, arrays [S]) are a temperature (0: greedy, the argmax), top-k (0:
every token), top-p (1: every token), min-p (0: none) and a random key; token i of a request
is drawn with fold_in(key, i), so neither where a request sits in a batch nor what runs beside
it changes a draw. The filters apply in transformers' order (its logits warpers): temperature,
then the k likeliest, then the smallest set of those reaching top_p of their mass, then the
tokens at least min_p times as likely as the likeliest; the draw is the inverse of the
cumulative distribution at one uniform number per row.

Nothing here sorts: XLA's CPU sort took 31 ms for 16 rows of a 4,096-token vocabulary and
`lax.top_k` over GPT-2's 50,304 logits 14 ms a row (bench/RESULTS.md, 2026-11-27), far more than
a small model's step. The k-th largest logit and the nucleus's lowest logit are found by
bisection over float32's order written as unsigned integers, 32 halvings of a count or a mass
each, exactly (ties included); the draw goes block by block through the vocabulary. Each token
comes with its log-probability and, when asked, the `TOP` likeliest alternatives, from the
model's own distribution before temperature: what OpenAI's `logprobs` report.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

TOP = 20  # alternatives kept per token: chat's top_logprobs goes to 20, completions' to 5
# Temperatures below this decode greedily, as 0 does: sampling at them already picks the
# likeliest token (ahead by more than float32 logits resolve), and dividing logits by a far
# smaller one overflows to inf, which would sample garbage instead.
GREEDY_BELOW = 1e-6
BLOCK = 256  # tokens per block of the inverse-CDF draw


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampling:
    """How each row draws [S]: temperature (float32), top_k (int32, 0: off), top_p (float32),
    min_p (float32) and its key, threefry's two words [S, 2] (uint32)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    key: jax.Array

    @staticmethod
    def of(settings) -> Sampling:
        """Host arrays for a list of `Settings`-like records (temperature, top_k, top_p, min_p
        and key attributes)."""
        return Sampling(
            temperature=np.asarray([s.temperature for s in settings], np.float32),
            top_k=np.asarray([s.top_k for s in settings], np.int32),
            top_p=np.asarray([s.top_p for s in settings], np.float32),
            min_p=np.asarray([s.min_p for s in settings], np.float32),
            key=np.asarray([s.key for s in settings], np.uint32).reshape(len(settings), 2))


def seed_key(seed: int) -> np.ndarray:
    """A seed as the raw key data a row keeps: `jax.random.key(seed)`'s under threefry, which
    takes any integer modulo 2^32 ([0, seed mod 2^32]), written without a call to the device."""
    return np.asarray([0, seed % 2**32], np.uint32)


def key_data(key: jax.Array) -> np.ndarray:
    """A JAX random key (typed or raw) as threefry's two words: the key itself where it is a
    threefry key, else two words drawn from it."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return np.asarray(jax.random.bits(key, (2,), jnp.uint32))
        key = jax.random.key_data(key)
    data = np.asarray(key, np.uint32)
    if data.shape != (2,):
        raise ValueError(f"a random key of threefry's two words, got shape {data.shape}")
    return data


def _ordered(x: jax.Array) -> jax.Array:
    """float32 values as uint32 keys in the same order."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(0x80000000)
    return jnp.where(bits & sign, ~bits, bits | sign)


def _from_ordered(keys: jax.Array) -> jax.Array:
    sign = jnp.uint32(0x80000000)
    return jax.lax.bitcast_convert_type(jnp.where(keys & sign, keys ^ sign, ~keys), jnp.float32)


def _lowest_key(keys: jax.Array, fits) -> jax.Array:
    """Per row, the smallest key m with `fits(m)` [S] true, where fits is monotone (false
    below some key, true from it on, and true at the largest key): 32 halvings."""
    lo = jnp.zeros(keys.shape[:1], jnp.uint32)
    hi = jnp.full(keys.shape[:1], 0xFFFFFFFF, jnp.uint32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = fits(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def kth_largest(x: jax.Array, k) -> jax.Array:
    """The k-th largest value of each row of x [S, V] (counting repeats, as `lax.top_k`'s
    k-th value); k an int or [S], 1 <= k <= V."""
    keys = _ordered(x)
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), x.shape[:1])
    # the largest m with at least k keys >= m is the smallest m with fewer than k keys > m
    return _from_ordered(_lowest_key(keys, lambda m: jnp.sum(
        keys > m[:, None], axis=-1) < k))


def nucleus_floor(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row's lowest logit inside its top-p nucleus [S]: a token stays if the mass of the
    tokens strictly likelier than it is below the row's top_p, so the floor is the smallest
    logit whose strictly likelier tokens hold less than top_p."""
    keys = _ordered(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    return _from_ordered(_lowest_key(keys, lambda m: jnp.sum(
        jnp.where(keys > m[:, None], probs, 0.0), axis=-1) < top_p))


def filtered(logits: jax.Array, rows: Sampling, sampling: jax.Array) -> jax.Array:
    """Logits [S, V] at each sampling row's temperature with the tokens its top-k, top-p and
    min-p leave out at -inf (each filter computed only when some row asks for it)."""
    V = logits.shape[-1]
    scaled = logits / jnp.where(sampling, rows.temperature, 1.0)[:, None]

    def cut(x, floor, on):
        return jnp.where(on[:, None] & (x < floor[:, None]), -jnp.inf, x)

    on = sampling & (rows.top_k > 0) & (rows.top_k < V)
    scaled = jax.lax.cond(jnp.any(on), lambda x: cut(x, kth_largest(
        x, jnp.where(on, rows.top_k, V)), on), lambda x: x, scaled)
    on = sampling & (rows.top_p < 1.0)
    scaled = jax.lax.cond(jnp.any(on), lambda x: cut(x, nucleus_floor(
        x, jnp.where(on, rows.top_p, 1.0)), on), lambda x: x, scaled)
    on = sampling & (rows.min_p > 0.0)
    scaled = jax.lax.cond(jnp.any(on), lambda x: cut(x, jnp.max(x, axis=-1) + jnp.log(
        jnp.where(on, rows.min_p, 1.0)), on), lambda x: x, scaled)
    return scaled


def inverse_cdf(logits: jax.Array, u: jax.Array) -> jax.Array:
    """The token [S] at which each row's cumulative probability passes u [S] (in [0, 1)):
    which block of BLOCK tokens first, then which token in it."""
    S, V = logits.shape
    blocks = -(-V // BLOCK)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.pad(probs, ((0, 0), (0, blocks * BLOCK - V))).reshape(S, blocks, BLOCK)
    mass = jnp.cumsum(jnp.sum(probs, axis=-1), axis=-1)  # [S, blocks]
    target = u * mass[:, -1]
    block = jnp.minimum(jnp.sum(mass <= target[:, None], axis=-1), blocks - 1)  # [S]
    before = jnp.where(block > 0, jnp.take_along_axis(mass, jnp.maximum(block - 1, 0)[:, None],
                                                      axis=-1)[:, 0], 0.0)
    inside = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]  # [S, BLOCK]
    within = jnp.cumsum(inside, axis=-1)
    index = jnp.minimum(jnp.sum(within <= (target - before)[:, None], axis=-1), BLOCK - 1)
    token = jnp.minimum(block * BLOCK + index, V - 1)
    # Rounding may land on a token of no probability (past the last one): take the likeliest.
    possible = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] > -jnp.inf
    return jnp.where(possible, token, jnp.argmax(logits, axis=-1))


def uniforms(key: jax.Array, count: jax.Array) -> jax.Array:
    """Each row's uniform number in [0, 1) for its token number `count` [S]: from
    fold_in(key, count), key as threefry's raw words [S, 2]."""
    return jax.vmap(lambda k, i: jax.random.uniform(
        jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), i)))(key, count)


def choose(logits: jax.Array, rows: Sampling, count: jax.Array, active: jax.Array,
           want: int | jax.Array, *, sample: bool | None = None):
    """Each row's next token from float32 logits [S, V]: the argmax where its temperature is 0
    or it is not `active` (an idle or finished row, so that it never makes a step sample), else
    a draw from its filtered distribution with token number `count` [S]. Returns (token [S],
    its log-probability [S], the TOP likeliest tokens [S, TOP] and theirs); `want` says which
    are computed (0: the tokens alone, 1: their log-probabilities too, 2: and the
    alternatives), the others being zeros: each costs a pass over the vocabulary. `want` and
    `sample` (whether any row may sample) are decided when traced where they are Python
    values (a decode program of its own for each: no branch in every step), else at run time
    (`want` an int32, `sample` None)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = (rows.temperature > 0) & active

    def draw():
        drawn = inverse_cdf(filtered(logits, rows, sampling), uniforms(rows.key, count))
        return jnp.where(sampling, drawn.astype(jnp.int32), greedy)

    if sample is None:
        token = jax.lax.cond(jnp.any(sampling), draw, lambda: greedy)
    else:
        token = draw() if sample else greedy
    S = logits.shape[0]
    none = (jnp.zeros(S, jnp.float32), jnp.zeros((S, TOP), jnp.int32),
            jnp.zeros((S, TOP), jnp.float32))

    def reported(alternatives: bool | jax.Array):
        norm = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - norm

        def likeliest():
            k = min(TOP, logits.shape[-1])
            values, ids = jax.lax.top_k(logits, k)
            pad = ((0, 0), (0, TOP - k))
            return (jnp.pad(ids.astype(jnp.int32), pad),
                    jnp.pad(values - norm[:, None], pad, constant_values=-jnp.inf))

        if isinstance(alternatives, bool):
            return chosen, *(likeliest() if alternatives else none[1:])
        return chosen, *jax.lax.cond(alternatives, likeliest, lambda: none[1:])

    if isinstance(want, int):
        reports = reported(want > 1) if want else none
    else:
        reports = jax.lax.cond(want > 0, lambda: reported(want > 1), lambda: none)
    return token, *reports
