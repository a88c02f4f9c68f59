"""Requests as OpenAI's API defines them, checked at one door before anything runs.

A request body is untrusted: it must be one JSON object (no NaN or Infinity, which Python's
reader would otherwise accept), every field the type the API reference gives it (a boolean is
not a number, a float is not a token count) and in its range; fields that change what would be
computed and that minigpt does not implement (penalties, logit biases, tools) are refused rather
than ignored, and fields that only describe the caller (`user`) are ignored. What passes becomes
a frozen `Completion` or `Chat`; whatever fails raises `RequestError`, which the web app sends
as an OpenAI error object with its HTTP status. Limits that depend on the model (the context,
the vocabulary, the number of slots) are checked where the prompt is tokenized (`api`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from minigpt.errors import UserError

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_PROMPTS = 1024  # prompts in one completions request (lm-evaluation-harness batches them)
MAX_COMPLETION_LOGPROBS = 5  # alternatives per token: completions' limit; chat's is 20
MAX_CHAT_LOGPROBS = 20
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields that would change the output and are not implemented: refused unless at their neutral
# value, so that a caller never gets something other than what it asked for.
UNSUPPORTED = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
               "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
               "response_format": ({"type": "text"},), "best_of": (1,)}


class RequestError(UserError):
    """A request the server refuses; `status` is its HTTP status, `param` the field at fault."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What both endpoints share: how many tokens (None: the endpoint's default), how to draw
    them, how many choices, where to stop, and whether to stream."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's extension)
    ignore_eos: bool = False  # go on past the end token (vLLM's extension; for benchmarks)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A /v1/completions request: prompts as text or token ids."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling
    echo: bool = False
    logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class Chat:
    """A /v1/chat/completions request: the conversation as {"role", "content": text}."""

    model: str | None
    messages: tuple[dict[str, str], ...]
    sampling: Sampling
    logprobs: bool = False
    top_logprobs: int = 0


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or RequestError."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON ({error}): send one JSON "
                           f"object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not a "
                           f"{type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _field(body: dict, name: str, check, kind: str, default: Any = None) -> Any:
    """body[name] (None or absent: `default`) if `check` accepts it, else RequestError."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise RequestError(f"{name} must be {kind}, got {json.dumps(value)[:80]}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    return _field(body, name, lambda v: isinstance(v, bool), "true or false", False)


def _in_range(name: str, value, low, high, *, low_open: bool = False) -> None:
    if value is None:
        return
    if (value <= low if low_open else value < low) or value > high:
        left = "(" if low_open else "["
        raise RequestError(f"{name} must be in {left}{low}, {high}], got {value}", param=name)


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] is not None and body[name] not in neutral:
            raise RequestError(f"{name} is not supported by this server; leave it out",
                               param=name)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) and s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} "
                           f"of them", param="stop")
    return tuple(stops)


def _sampling(body: dict, *, max_n: int, tokens_field: str = "max_tokens",
              least_tokens: int = 0) -> Sampling:
    _refuse_unsupported(body)
    max_tokens = _field(body, tokens_field, _is_int, "an integer")
    if max_tokens is not None and max_tokens < least_tokens:
        raise RequestError(f"{tokens_field} must be at least {least_tokens}, got {max_tokens}",
                           param=tokens_field)
    temperature = _field(body, "temperature", _is_number, "a number", 1.0)
    _in_range("temperature", temperature, 0, 2)
    top_p = _field(body, "top_p", _is_number, "a number", 1.0)
    _in_range("top_p", top_p, 0, 1, low_open=True)
    n = _field(body, "n", _is_int, "an integer", 1)
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}", param="n")
    if n > max_n:
        raise RequestError(f"n is {n} but this server decodes at most {max_n} sequences at "
                           f"once (its --max-batch): ask for at most {max_n}", param="n")
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    return Sampling(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                    n=n, seed=_field(body, "seed", _is_int, "an integer"), stop=_stops(body),
                    stream=_flag(body, "stream"), include_usage=_flag(options, "include_usage"),
                    token_ids=_flag(body, "return_tokens_as_token_ids"),
                    ignore_eos=_flag(body, "ignore_eos"))


def _model(body: dict) -> str | None:
    return _field(body, "model", lambda v: isinstance(v, str), "a string")


def _prompts(body: dict) -> tuple[str | tuple[int, ...], ...]:
    prompt = body.get("prompt")
    kind = "a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts = tuple(prompt)
        elif all(_is_int(t) for t in prompt):
            prompts = (tuple(prompt),)
        elif all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            prompts = tuple(tuple(p) for p in prompt)
        else:
            raise RequestError(f"prompt must be {kind}", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts in one request, got "
                               f"{len(prompts)}", param="prompt")
        return prompts
    raise RequestError(f"prompt must be {kind} (and not empty)", param="prompt")


def parse_completion(body: dict, *, max_n: int) -> Completion:
    """A /v1/completions body, checked (RequestError)."""
    sampling = _sampling(body, max_n=max_n)
    logprobs = _field(body, "logprobs", _is_int, "an integer")
    _in_range("logprobs", logprobs, 0, MAX_COMPLETION_LOGPROBS)
    echo = _flag(body, "echo")
    return Completion(model=_model(body), prompts=_prompts(body), sampling=sampling, echo=echo,
                      logprobs=logprobs)


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{index}].content must be text (a string, or a list of "
                       f'{{"type": "text", "text": ...}} parts)', param="messages")


def _messages(body: dict) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise RequestError("messages must be a non-empty list of {role, content} objects",
                           param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a role among "
                               f"{', '.join(sorted(ROLES))}", param="messages")
        out.append({"role": ROLES[message["role"]], "content": _content(message, i)})
    return tuple(out)


def parse_chat(body: dict, *, max_n: int) -> Chat:
    """A /v1/chat/completions body, checked (RequestError). `max_completion_tokens` is the
    newer name of `max_tokens`; either may be given."""
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    sampling = _sampling(body, max_n=max_n, tokens_field=tokens_field, least_tokens=1)
    logprobs = _flag(body, "logprobs")
    top = _field(body, "top_logprobs", _is_int, "an integer", 0)
    _in_range("top_logprobs", top, 0, MAX_CHAT_LOGPROBS)
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return Chat(model=_model(body), messages=_messages(body), sampling=sampling,
                logprobs=logprobs, top_logprobs=top)
