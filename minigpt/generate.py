"""Telling stories and chatting: the Python API and `python -m minigpt.generate`.

The prompts go to the decoding engine (`minigpt.decoding`), which every door shares: the
prompt is run once (prefill) to fill each layer's key/value cache, after which every new token
costs one position of compute; the engine draws the tokens, and its text stream turns them into
text (a chat through the model's own chat template, `chat`). For the same prompt and settings,
`generate_tokens(..., rng=jax.random.key(S))`, `python -m minigpt.generate --seed S` and the
server's `"seed": S` give the same tokens, whatever else is decoded beside them: a prompt's
k-th batch row draws with `fold_in(rng, k)` (the first with `rng` itself).

Length rule: the model sees at most its context. A prompt of more than context - 1 tokens is
refused. A story may grow past the context: when a row's tokens fill it, that row goes on from
its last `window_keep(context)` tokens (three quarters of the context), prefilled afresh at
positions 0, 1, ..., like a reader who remembers the last pages. Each row crops only when it
is itself full, so a row's story does not depend on the other rows of its batch, and
`generate_recompute` follows the same rule the slow way.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minigpt import CallableModule, chat_template, sharding
from minigpt.config import DTYPES
from minigpt.decoding import GREEDY_BELOW, Settings, TextStream, decode_all, key_data
from minigpt.errors import UserError, exit_code
from minigpt.models import DecoderLM
from minigpt.runs import RunDir, load_run, with_recorded_template
from minigpt.runtime import (
    plain_warnings,
    relaunch_with_huge_pages,
    set_gpu_flags,
    set_simulated_devices,
)
from minigpt.tokenizer import load_tokenizer


class GenerationError(UserError, ValueError):
    """A request the model cannot serve (prompt too long, bad sampling values, bad run)."""


def window_keep(context: int) -> int:
    """How many of its last tokens a row keeps when its tokens fill the context."""
    return context - max(1, context // 4)


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int,
                   top_p: float, min_p: float = 0.0) -> None:
    """Refuse sampling settings that mean nothing (GenerationError): they are finite and in
    range before anything is loaded or compiled."""
    if not (math.isfinite(temperature) and temperature >= 0 and top_k >= 0
            and 0.0 < top_p <= 1.0 and 0.0 <= min_p <= 1.0 and max_new_tokens >= 1):
        raise GenerationError(f"need a finite temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                              f"0 <= min_p <= 1 and max_new_tokens >= 1 (got temperature "
                              f"{temperature}, top_k {top_k}, top_p {top_p}, min_p {min_p}, "
                              f"max_new_tokens {max_new_tokens})")


def check_request(context: int, prompt_lengths: Sequence[int], *, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float, has_rng: bool,
                  min_p: float = 0.0) -> None:
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
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, min_p=min_p)
    if temperature > 0 and not has_rng:
        raise GenerationError("sampling with temperature > 0 needs an rng key (or a --seed)")


def row_keys(rng: jax.Array | Sequence[jax.Array] | None, rows: int) -> list[tuple[int, int]]:
    """Each batch row's key as threefry's two words: `rng` for the first row and
    fold_in(rng, k) for row k (or, for a list, one key per row)."""
    if rng is None:
        return [(0, 0)] * rows
    if isinstance(rng, list | tuple):
        if len(rng) != rows:
            raise GenerationError(f"{len(rng)} keys for {rows} prompts: give one key, or one "
                                  f"per prompt")
        return [tuple(int(w) for w in key_data(k)) for k in rng]
    first = tuple(int(w) for w in key_data(rng))
    if rows == 1:
        return [first]
    others = jax.vmap(lambda k: jax.random.fold_in(rng, k))(jnp.arange(1, rows))
    return [first, *(tuple(int(w) for w in key_data(k)) for k in others)]


def generate_tokens(model: DecoderLM, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int = 200, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0,
                    rng: jax.Array | Sequence[jax.Array] | None = None,
                    eot_id: int | None = None, stop_ids: Sequence[int] = (),
                    on_token: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
    """New token ids for each prompt, stopping at any of `stop_ids` (or `eot_id`; the stop
    token not included) or after `max_new_tokens`; `rng` is one key (row k draws with
    fold_in(rng, k), the first row with rng itself) or one key per prompt.

    `on_token`, if given, receives a single prompt's tokens as they are drawn, each as an
    array [1] (for streaming). Past the context, rows go on in windows (the module
    docstring's length rule).
    """
    context = model.config.context_len
    temperature = 0.0 if 0 <= temperature < GREEDY_BELOW else temperature
    check_request(context, [len(p) for p in prompts], max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  has_rng=rng is not None)
    if on_token is not None and len(prompts) != 1:
        raise GenerationError("streaming works with a single prompt")
    stops = tuple(stop_ids) or (() if eot_id is None else (eot_id,))
    top_k = 0 if top_k >= model.config.vocab_size else top_k  # all of them: no cut to make
    settings = [Settings(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                         min_p=float(min_p), key=key) for key in row_keys(rng, len(prompts))]
    shown = None if on_token is None else (
        lambda i, ids: [on_token(np.asarray([t], np.int32)) for t in ids])
    return decode_all(model, prompts, max_new=max_new_tokens, settings=settings,
                      stop_ids=stops, slide=window_keep(context), on_tokens=shown)


def _streamed(tokenizer, prompt: list[int], on_text: Callable[[str], None] | None):
    """A text stream for one continuation of `prompt` and the token callback that feeds it."""
    if on_text is None:
        return None, None
    stream = TextStream(tokenizer, context=prompt)

    def on_token(tokens: np.ndarray) -> None:
        text = stream.add([int(t) for t in tokens])
        if text:
            on_text(text)

    return stream, on_token


def generate(model: DecoderLM, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 200,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             rng: jax.Array | Sequence[jax.Array] | None = None,
             on_text: Callable[[str], None] | None = None) -> list[str]:
    """Continue each prompt (encoded as the model's tokenizer encodes a prompt: its begin token
    too, where it has one) until one of the tokenizer's stop tokens or `max_new_tokens`;
    returns prompt + continuation texts, special tokens left out.

    `on_text` streams the text of a single prompt as tokens arrive.
    """
    if on_text is not None and len(prompts) != 1:
        raise GenerationError("streaming works with a single prompt")
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    stream, on_token = _streamed(tokenizer, encoded[0] if encoded else [], on_text)
    new = generate_tokens(model, encoded, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          rng=rng, stop_ids=tokenizer.stop_tokens, on_token=on_token)
    if stream is not None and (rest := stream.finish()):
        on_text(rest)
    return [tokenizer.decode(p + n, skip_special_tokens=True) for p, n in zip(encoded, new)]


def chat(model: DecoderLM, tokenizer, messages: Sequence[dict[str, str]], *,
         max_new_tokens: int = 200, temperature: float = 0.0, top_k: int = 0,
         top_p: float = 1.0, min_p: float = 0.0, rng: jax.Array | None = None,
         on_text: Callable[[str], None] | None = None) -> str:
    """The model's reply to a conversation: `messages` ({"role": "system" | "user" |
    "assistant", "content": ...}) rendered by its chat template as transformers'
    `apply_chat_template(..., add_generation_prompt=True)` renders them, then generated until an
    end-of-turn token; only the reply is returned (and streamed to `on_text`)."""
    prompt = tokenizer.encode_ordinary(tokenizer.render_chat(
        list(messages), max_chars=model.config.context_len * chat_template.CHARS_PER_TOKEN))
    stream, on_token = _streamed(tokenizer, [], on_text)
    new = generate_tokens(model, [prompt], max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          rng=rng, stop_ids=tokenizer.stop_tokens, on_token=on_token)[0]
    if stream is not None and (rest := stream.finish()):
        on_text(rest)
    return tokenizer.decode(new, skip_special_tokens=True)


# One jitted forward for every call of generate_recompute, keyed on the preset's context: calls
# with the same model shape under the same settings reuse its compilation.
_full_forward = sharding.jit(lambda model, x: model(x))


def generate_recompute(model: DecoderLM, prompt: Sequence[int], *, max_new_tokens: int,
                       eot_id: int | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding the slow way, re-running the whole window for every token.

    The reference the cached decoder is tested against, windows included (the length rule in
    the module docstring); returns the new tokens and the logits that chose each of them.
    """
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
        logits = np.asarray(_full_forward(model, jnp.asarray(x))[0, len(window) - 1])
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
    return loaded.model, loaded.tokenizer, loaded.layout.preset, loaded.layout.mesh, loaded.step


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minigpt.generate",
                                description="Tell stories from a run's latest checkpoint, or "
                                            "chat with an imported instruct model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="run directory written by minigpt.train or "
                                                "minigpt.hub import")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="what the model computes in: float32, as transformers does (exact to "
                        "1e-4), bfloat16 (half the bytes a step reads, float32 accumulation) "
                        "or auto (bfloat16 on an accelerator, float32 on a CPU)")
    p.add_argument("--chat", metavar="MESSAGE", help="send MESSAGE through the model's chat "
                                                     "template and print only its reply")
    p.add_argument("--system", metavar="MESSAGE", help="a system message before --chat's")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8,
                   help=f"0 (or below {GREEDY_BELOW:g}) for greedy decoding")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest (0, or the vocabulary size or more: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="leave out tokens less likely than min-p times the likeliest, in [0, 1]")
    p.add_argument("--seed", type=int, default=0,
                   help="in [0, 2^32); sample i draws with seed + i, as the server's n choices")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--preset", default="dp", help="how to lay the model out on the devices")
    p.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.system is not None and args.chat is None:
        p.error("--system goes with --chat")
    if args.chat is not None and not args.chat.strip():
        print("error: --chat needs a message, and it is empty: give the words to send (or "
              "--prompt TEXT to continue a text)", file=sys.stderr)
        return 2
    if args.devices:
        set_simulated_devices(args.devices)
    with plain_warnings():
        return exit_code(lambda: _tell(args))


def _tell(args: argparse.Namespace) -> None:
    check_sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if not 0 <= args.seed < 2**32 or args.num_samples < 1:
        raise GenerationError(f"need 0 <= --seed < 2^32 and --num-samples >= 1 (got "
                              f"{args.seed} and {args.num_samples})")
    # The request is checked against the run's config and tokenizer (its chat template
    # rendered, bounded) before any weights are loaded.
    saved = RunDir(args.run).read()
    cfg = saved.model
    tokenizer = with_recorded_template(load_tokenizer(cfg.tokenizer), saved)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": args.chat})
    chars = cfg.context_len * chat_template.CHARS_PER_TOKEN  # what a context can hold
    prompt = (tokenizer.encode_ordinary(tokenizer.render_chat(messages, max_chars=chars))
              if args.chat is not None else tokenizer.encode_prompt(args.prompt))
    check_request(cfg.context_len, [len(prompt)], max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  min_p=args.min_p, has_rng=True)
    loaded = load_run(args.run, args.preset, dtype=args.dtype)
    model, tokenizer, step = loaded.model, loaded.tokenizer, loaded.step
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    keys = [jax.random.key(args.seed + i) for i in range(args.num_samples)]
    stream = args.num_samples == 1
    show = (lambda text: print(text, end="", flush=True)) if stream else None
    with loaded.layout.active():
        if stream and not args.chat:
            print(args.prompt, end="", flush=True)
        texts = [chat(model, tokenizer, messages, rng=key, on_text=show, **sampling)
                 for key in keys] if args.chat else generate(
            model, tokenizer, [args.prompt] * args.num_samples, rng=keys, on_text=show,
            **sampling)
    if stream:
        print()
    else:
        for i, text in enumerate(texts):
            print(f"--- sample {i + 1} (step {step}) ---\n{text}\n")


sys.modules[__name__].__class__ = CallableModule  # minigpt.generate(...) calls generate(...)

if __name__ == "__main__":
    # A run that is not there is refused before the process restarts itself with huge pages
    # (which would import everything a second time to say the same).
    run = Path(_parser().parse_args().run)
    if not (run / "config.json").is_file():
        print(f"error: {run} is not a run directory (no config.json): give the --out of a "
              f"training run, or the --out of python -m minigpt.hub import", file=sys.stderr)
        sys.exit(2)
    relaunch_with_huge_pages()
    set_gpu_flags()  # before JAX starts its backends
    sys.exit(main())
