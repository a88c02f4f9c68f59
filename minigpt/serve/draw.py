"""How the engine draws each slot's next token, every slot with its own settings, in a few
passes over the vocabulary.

Greedy rows take the argmax, as `minigpt.models.sampling` does, so greedy tokens are
`minigpt.generate`'s. Sampled rows divide their logits by their own temperature, keep their own
top-p nucleus and draw with their own key folded with the token's index. XLA's CPU sort takes
31 ms for 16 rows of a 4,096-token vocabulary, its cumulative sum 16 ms for 16 x 49,152 and
`jax.random.categorical` draws one number per token, so none of them runs per step here: the
nucleus threshold comes from the 64 likeliest tokens (`lax.top_k`), or where they hold less
than top_p of the mass (a flat distribution), from a bisection over the logits; the draw is by
the inverse of the cumulative distribution, in blocks (one uniform number per row). Both are
exact up to float32 rounding and ties. Each token also comes with its log-probability and, when
a request asks, the `TOP` likeliest alternatives: the model's own distribution, before
temperature, which is what OpenAI's `logprobs` report.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOP = 20  # alternatives kept per token: chat's top_logprobs goes to 20, completions' to 5
CANDIDATES = 64  # the likeliest tokens a nucleus is first looked for among
BLOCK = 256  # tokens per block of the inverse-CDF draw
BISECTIONS = 24  # halvings of the logit range where the nucleus is wider than CANDIDATES


def _nucleus_by_bisection(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row's lowest kept logit [S]: the smallest logit l whose strictly likelier tokens
    hold less than top_p of the mass, found by halving [min, max] of the row's logits."""
    probs = jax.nn.softmax(logits, axis=-1)
    finite = jnp.where(jnp.isfinite(logits), logits, jnp.inf)

    def halve(_, bounds):
        low, high = bounds  # mass above `low` reaches top_p; above `high` it does not
        mid = (low + high) / 2
        above = jnp.sum(jnp.where(logits > mid[:, None], probs, 0.0), axis=-1)
        short = above < top_p
        return jnp.where(short, low, mid), jnp.where(short, mid, high)

    low0 = jnp.min(finite, axis=-1) - 1.0
    low, _ = jax.lax.fori_loop(0, BISECTIONS, halve, (low0, jnp.max(logits, axis=-1)))
    # Every logit above `low` is kept: the first one above it is the boundary token itself.
    return jnp.min(jnp.where(logits > low[:, None], logits, jnp.inf), axis=-1)


def nucleus(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits [S, V] with every token outside each row's top-p nucleus at -inf: a token stays
    if the mass of the tokens strictly likelier than it is below the row's top_p [S]."""
    k = min(CANDIDATES, logits.shape[-1])
    values, _ = jax.lax.top_k(logits, k)  # [S, k], likeliest first
    probs = jnp.exp(values - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(before < top_p[:, None], axis=-1)  # >= 1: the likeliest always stays
    threshold = jnp.take_along_axis(values, (kept - 1)[:, None], axis=-1)[:, 0]
    fits = jnp.sum(probs, axis=-1) >= top_p  # the k-th + 1 token is outside the nucleus
    threshold = jax.lax.cond(jnp.all(fits), lambda: threshold, lambda: jnp.where(
        fits, threshold, _nucleus_by_bisection(logits, top_p)))
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


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


def choose(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, key: jax.Array,
           count: jax.Array, active: jax.Array, want: jax.Array):
    """Each row's next token from float32 logits [S, V]: the argmax where its temperature is 0,
    else a draw at that temperature within its nucleus, keyed by fold_in(key, count) (raw key
    data [S, 2]). Rows not `active` [S] (idle slots) take the argmax, so that an idle slot that
    last sampled does not make every step sample. Returns (token [S], its log-probability [S],
    the TOP likeliest tokens [S, TOP] and theirs); `want` (int32) says which are computed
    (0: the tokens alone, 1: their log-probabilities too, 2: and the alternatives), the others
    being zeros: each costs a pass over the vocabulary."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = (temperature > 0) & active

    def draw():
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
        scaled = jax.lax.cond(jnp.any(sampling & (top_p < 1.0)), nucleus, lambda x, _: x,
                              scaled, top_p)
        u = jax.vmap(lambda k, i: jax.random.uniform(
            jax.random.fold_in(jax.random.wrap_key_data(k, impl="threefry2x32"), i)))(key, count)
        return jnp.where(sampling, inverse_cdf(scaled, u).astype(jnp.int32), greedy)

    token = jax.lax.cond(jnp.any(sampling), draw, lambda: greedy)
    S = logits.shape[0]

    def reported():
        norm = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - norm

        def alternatives():
            values, ids = jax.lax.top_k(logits, TOP)
            return ids.astype(jnp.int32), values - norm[:, None]

        return chosen, *jax.lax.cond(want > 1, alternatives, lambda: (
            jnp.zeros((S, TOP), jnp.int32), jnp.zeros((S, TOP), jnp.float32)))

    chosen, top_ids, top_logprobs = jax.lax.cond(want > 0, reported, lambda: (
        jnp.zeros(S, jnp.float32), jnp.zeros((S, TOP), jnp.int32),
        jnp.zeros((S, TOP), jnp.float32)))
    return token, chosen, top_ids, top_logprobs
