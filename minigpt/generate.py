"""Telling stories: KV-cache sampling, its Python API and `python -m minigpt.generate`.

The prompt is run once (prefill) to fill each layer's key/value cache; after that every new
token costs one position of compute. The whole decode loop is one compiled `while_loop`.

Batches of prompts of different lengths are right-padded; row b writes its new tokens at its own
positions len_b, len_b + 1, ..., and a key is visible to a query only at or before the query's
position, so padding is never attended to.

Length rule: the model sees at most its context. A prompt of more than context - 1 tokens is
refused. A story may grow past the context: when a row's tokens fill it, that row goes on from
its last `window_keep(context)` tokens (three quarters of the context), prefilled afresh at
positions 0, 1, ..., like a reader who remembers the last pages. Each row crops only when it
is itself full, so a row's story does not depend on the other rows of its batch, and
`generate_recompute` follows the same rule the slow way.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from minigpt import CallableModule, sharding
from minigpt.models import DecoderLM
from minigpt.runs import LOAD_ERRORS, load_run
from minigpt.runtime import relaunch_with_huge_pages, set_simulated_devices


class GenerationError(ValueError):
    """A request the model cannot serve (prompt too long, bad sampling values, bad run)."""


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float, top_k: int,
                  top_p: float) -> jax.Array:
    """Draw one token per row from logits [B, V]; temperature 0 means greedy."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        # Keep the smallest set of tokens whose probability reaches top_p: a token stays if the
        # mass of the tokens strictly more likely than it is below top_p.
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("max_new", "cache_len", "temperature", "top_k",
                                             "top_p", "eot_id", "stream"))
def _decode(model: DecoderLM, tokens: jax.Array, lengths: jax.Array, rng: jax.Array,
            limit: jax.Array, start: jax.Array, done: jax.Array, *, max_new: int, cache_len: int,
            temperature: float, top_k: int, top_p: float, eot_id: int, stream: bool):
    """Prefill right-padded prompts [B, P] and sample up to `limit` (<= max_new) tokens per row;
    rows already `done` give eot_id. New token i of this call is token `start + i` of the story:
    its key is fold_in(rng, start + i), so where a story's windows begin changes no draw."""
    B, P = tokens.shape
    cache = model.init_cache(B, cache_len, dtype=jnp.dtype(model.config.dtype))
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, cache = model.decode(tokens, positions, cache)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    out = jnp.full((B, max_new), eot_id, jnp.int32)
    # The loop body is a trace of its own, which NNX modules must not cross: the weights ride
    # along in the loop state and the body rebuilds the model from them.
    graphdef, weights = nnx.split(model)

    def keep_going(state):
        i, _, _, _, done, _ = state
        return (i < limit) & ~jnp.all(done)

    def step(state):
        i, last, cache, out, done, weights = state
        token = sample_logits(last, jax.random.fold_in(rng, start + i), temperature=temperature,
                              top_k=top_k, top_p=top_p)
        token = jnp.where(done, eot_id, token)
        out = out.at[:, i].set(token)
        if stream:
            # Ordered effects are unsupported across devices; the step index lets the host put
            # tokens back in order should they ever arrive out of it.
            jax.debug.callback(_stream, start + i, token)
        done = done | (token == eot_id)
        logits, cache = nnx.merge(graphdef, weights).decode(token[:, None],
                                                            (lengths + i)[:, None], cache)
        return i + 1, logits[:, 0], cache, out, done, weights

    _, _, _, out, _, _ = jax.lax.while_loop(keep_going, step,
                                            (0, last, cache, out, done, weights))
    return out


def window_keep(context: int) -> int:
    """How many of its last tokens a row keeps when its tokens fill the context."""
    return context - max(1, context // 4)


def check_request(context: int, prompt_lengths: Sequence[int], *, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float, has_rng: bool) -> None:
    """Refuse what the model cannot serve (GenerationError).

    Callers that show the prompt before its continuation check first, so that a refused
    prompt is never echoed.
    """
    if not prompt_lengths or min(prompt_lengths) == 0:
        raise GenerationError("every prompt needs at least one token")
    longest = max(prompt_lengths)
    if longest > context - 1:
        raise GenerationError(
            f"the prompt has {longest} tokens but the model's context is {context}: shorten it "
            f"to at most {context - 1} tokens to leave room for a new one")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0 or max_new_tokens < 1:
        raise GenerationError("need temperature >= 0, top_k >= 0, 0 < top_p <= 1 and "
                              "max_new_tokens >= 1")
    if temperature > 0 and not has_rng:
        raise GenerationError("sampling with temperature > 0 needs an rng key (or a --seed)")


def generate_tokens(model: DecoderLM, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, rng: jax.Array | None = None, eot_id: int | None = None,
                    on_token: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
    """New token ids for each prompt, stopping at `eot_id` (not included) or `max_new_tokens`.

    `on_token`, if given, receives each step's tokens [B] as they are drawn (for streaming).
    Past the context, rows go on in windows (the module docstring's length rule): one compiled
    loop per window, the first sized to the request, the later ones compiled once.
    """
    context = model.config.context_len
    check_request(context, [len(p) for p in prompts], max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, top_p=top_p, has_rng=rng is not None)
    eot = -1 if eot_id is None else eot_id
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                    eot_id=eot, stream=on_token is not None)
    rng = jax.random.key(0) if rng is None else rng
    windows = [list(p) for p in prompts]  # what each row's model sees now
    new = [[] for _ in prompts]
    done, produced = np.zeros(len(prompts), bool), 0
    with _stream.to(on_token) if on_token else contextlib.nullcontext():
        while produced < max_new_tokens and not done.all():
            longest = max(len(w) for w in windows)
            count = min(max_new_tokens - produced, context - longest)
            # Round the padded prompt length up so prompts of similar length share one
            # compilation. The first window's loop is sized to the request, later ones to the
            # context, so they compile once; rows that stopped keep their place (giving eot_id).
            padded = min(-(-longest // 16) * 16, context)
            first = produced == 0
            tokens = np.zeros((len(prompts), padded), np.int32)
            for row, window in enumerate(windows):
                tokens[row, :len(window)] = window
            out = _decode(model, jnp.asarray(tokens),
                          jnp.asarray([len(w) for w in windows], np.int32), rng,
                          jnp.int32(count), jnp.int32(produced), jnp.asarray(done),
                          max_new=count if first else context,
                          cache_len=min(context, padded + count) if first else context,
                          **sampling)
            for row, drawn in enumerate(_to_host(out)[:, :count].tolist()):
                if done[row]:
                    continue
                if eot in drawn:
                    drawn, done[row] = drawn[:drawn.index(eot)], True
                new[row] += drawn
                windows[row] += drawn
                if len(windows[row]) >= context:
                    windows[row] = (list(prompts[row]) + new[row])[-window_keep(context):]
            produced += count
    return new


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host, also when other processes of a multi-process job hold parts."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class _StreamRouter:
    """Forwards each decode step's tokens to the current generation's callback, in step order.

    The compiled decode loop holds this one object, so a cached compilation reaches the callback
    of whichever call is running now rather than the callback of the call that compiled it.
    """

    def __init__(self):
        self.target: Callable[[np.ndarray], None] | None = None
        self.next, self.waiting = 0, {}

    @contextlib.contextmanager
    def to(self, target: Callable[[np.ndarray], None]):
        self.target, self.next, self.waiting = target, 0, {}
        try:
            yield
        finally:
            self.target = None

    def __call__(self, index, tokens) -> None:
        self.waiting[int(index)] = np.asarray(tokens)
        while self.next in self.waiting:
            tokens = self.waiting.pop(self.next)
            if self.target is not None:
                self.target(tokens)
            self.next += 1


_stream = _StreamRouter()


def generate(model: DecoderLM, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 200,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             rng: jax.Array | None = None, on_text: Callable[[str], None] | None = None
             ) -> list[str]:
    """Continue each prompt; returns prompt + continuation texts.

    `on_text` streams the text of a single prompt as tokens arrive.
    """
    if on_text is not None and len(prompts) != 1:
        raise GenerationError("streaming works with a single prompt")
    encoded = [tokenizer.encode_ordinary(p) for p in prompts]
    on_token = None
    if on_text is not None:
        eot = tokenizer.eot_token

        def on_token(tokens: np.ndarray) -> None:
            if int(tokens[0]) != eot:
                on_text(tokenizer.decode([int(tokens[0])]))

    new = generate_tokens(model, encoded, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, rng=rng,
                          eot_id=tokenizer.eot_token, on_token=on_token)
    return [tokenizer.decode(p + n) for p, n in zip(encoded, new)]


def generate_recompute(model: DecoderLM, prompt: Sequence[int], *, max_new_tokens: int,
                       eot_id: int | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding the slow way, re-running the whole window for every token.

    The reference the cached decoder is tested against, windows included (the length rule in
    the module docstring); returns the new tokens and the logits that chose each of them.
    """
    forward = nnx.jit(lambda m, x: m(x))
    context = model.config.context_len
    tokens, chosen, start = list(prompt), [], 0
    for _ in range(max_new_tokens):
        if len(tokens) - start >= context:
            start = len(tokens) - window_keep(context)
        window = tokens[start:]
        # Pad to the full context (causality keeps the padding invisible) so one compilation
        # serves every step.
        x = np.zeros((1, context), np.int32)
        x[0, :len(window)] = window
        logits = np.asarray(forward(model, jnp.asarray(x))[0, len(window) - 1])
        token = int(np.argmax(logits))
        chosen.append(logits)
        if token == eot_id:
            break
        tokens.append(token)
    return tokens[len(prompt):], chosen


def load_for_generation(run: str | Path, preset_name: str = "dp"):
    """The earlier spelling of `minigpt.runs.load_run`, kept for scripts that use it: the
    run's (model, tokenizer, preset, mesh, step)."""
    loaded = load_run(run, preset_name)
    return loaded.model, loaded.tokenizer, loaded.preset, loaded.mesh, loaded.step


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minigpt.generate",
                                description="Tell stories from a run's latest checkpoint.")
    p.add_argument("--run", required=True, help="run directory written by minigpt.train")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--preset", default="dp", help="how to lay the model out on the devices")
    p.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    args = p.parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    with warnings.catch_warnings():
        warnings.showwarning = _print_warning
        return _tell(args)


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning on the command line: one line on stderr, not the source line behind it."""
    print(f"warning: {message}", file=sys.stderr)


def _tell(args: argparse.Namespace) -> int:
    try:
        loaded = load_run(args.run, args.preset)
        model, tokenizer, step = loaded.model, loaded.tokenizer, loaded.step
        prompts = [args.prompt] * args.num_samples
        rng = jax.random.key(args.seed)
        stream = args.num_samples == 1
        check_request(model.config.context_len, [len(tokenizer.encode_ordinary(args.prompt))],
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, has_rng=True)
        with sharding.use_preset(loaded.preset, loaded.mesh):
            if stream:
                print(args.prompt, end="", flush=True)
            stories = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, rng=rng,
                               on_text=(lambda t: print(t, end="", flush=True)) if stream
                               else None)
        if stream:
            print()
        else:
            for i, story in enumerate(stories):
                print(f"--- sample {i + 1} (step {step}) ---\n{story}\n")
    except (GenerationError, *LOAD_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


sys.modules[__name__].__class__ = CallableModule  # minigpt.generate(...) calls generate(...)

if __name__ == "__main__":
    relaunch_with_huge_pages()
    sys.exit(main())
