"""Requests as OpenAI's API defines them, checked at one door before anything runs.

A request body is untrusted: it must be one JSON object (no NaN or Infinity, which Python's
reader would otherwise accept), every field the type the API reference gives it and in its
range. The bodies are pydantic models in strict mode (a boolean is not a number, a float is not
a token count, null means the default), and a failed check becomes one `RequestError` naming
the field, which the web app sends as an OpenAI error object with its HTTP status. Fields that
would change what is computed and that minigpt does not implement (penalties, logit biases,
tools, beam search) are refused unless at their neutral value; vLLM's sampling extras `top_k`
(0 or -1: every token) and `min_p` are honoured; other fields (`user`, `metadata`) are ignored.
Limits that depend on the model (the context, the vocabulary, the number of slots) are checked
where the prompt is tokenized (`service`).

Seeds: any 64-bit integer, as OpenAI's clients send them, taken modulo 2^32 as
`jax.random.key` takes a seed, so that `"seed": S` draws what `python -m minigpt.generate --seed
S` and `jax.random.key(S)` draw (-1 and 2^32 - 1 are the same seed).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

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
               "response_format": ({"type": "text"},), "best_of": (1,),
               "repetition_penalty": (1, 1.0), "use_beam_search": (False,)}
# What a type error says the field must be.
KINDS = {"int_type": "an integer", "float_type": "a number", "finite_number": "a finite number",
         "bool_type": "true or false", "string_type": "a string", "model_type": "an object",
         "dict_type": "an object", "list_type": "a list"}


class RequestError(UserError):
    """A request the server refuses; `status` is its HTTP status, `param` the field at fault."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def _within(low, high, *, low_open: bool = False):
    def check(value):
        if value is not None and ((value <= low if low_open else value < low) or value > high):
            raise ValueError(f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
        return value

    return AfterValidator(check)


def _at_least(low):
    def check(value):
        if value is not None and value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value

    return AfterValidator(check)


def _stops(stop):
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) and s for s in stops)):
        raise ValueError(f"must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


def _is_id(value) -> bool:
    return type(value) is int


def _prompts(prompt) -> tuple[str | tuple[int, ...], ...]:
    kind = "a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(prompt, str):
        return (prompt,)
    if not (isinstance(prompt, list) and prompt):
        raise ValueError(f"must be {kind} (and not empty)")
    if all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif all(_is_id(t) for t in prompt):
        prompts = (tuple(prompt),)
    elif all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        prompts = tuple(tuple(p) for p in prompt)
    else:
        raise ValueError(f"must be {kind}")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"holds {len(prompts)} prompts: at most {MAX_PROMPTS} in one request")
    return prompts


Number = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-2**63, lt=2**64)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Body(BaseModel):
    """What both endpoints share: the model, how many tokens (None: the endpoint's default),
    how to draw them, how many choices, where to stop, and whether to stream."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    model: str | None = None
    max_tokens: Annotated[int | None, _at_least(0)] = None
    temperature: Annotated[Number, _within(0, 2)] = 1.0
    top_p: Annotated[Number, _within(0, 1, low_open=True)] = 1.0
    top_k: Annotated[int, _at_least(-1)] = 0  # vLLM's: -1 or 0 for every token
    min_p: Annotated[Number, _within(0, 1)] = 0.0
    n: Annotated[int, _at_least(1)] = 1
    seed: Seed | None = None
    stop: Annotated[Any, AfterValidator(_stops)] = ()
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's)
    ignore_eos: bool = False  # go on past the end token (vLLM's extension; for benchmarks)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        for name, neutral in UNSUPPORTED.items():
            if body.get(name) is not None and body[name] not in neutral:
                raise RequestError(f"{name} is not supported by this server; leave it out",
                                   param=name)
        return {k: v for k, v in body.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage

    @property
    def token_ids(self) -> bool:
        return self.return_tokens_as_token_ids

    @property
    def every_token(self) -> int:
        """top_k as the engine takes it: 0 for every token."""
        return max(self.top_k, 0)


class Completion(_Body):
    """A /v1/completions request: prompts as text or token ids."""

    prompt: Annotated[Any, AfterValidator(_prompts)]
    echo: bool = False
    logprobs: Annotated[int | None, _within(0, MAX_COMPLETION_LOGPROBS)] = None

    @property
    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        return self.prompt


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[tuple(ROLES)]
    content: str | list[_TextPart]

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": ROLES[self.role], "content": content}


class Chat(_Body):
    """A /v1/chat/completions request: the conversation as {"role", "content": text}.
    `max_completion_tokens` is the newer name of `max_tokens`; either may be given."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, _at_least(1)] = None
    max_tokens: Annotated[int | None, _at_least(1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int, _within(0, MAX_CHAT_LOGPROBS)] = 0

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> Chat:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def conversation(self) -> tuple[dict[str, str], ...]:
        return tuple(m.plain() for m in self.messages)


def _refusal(error: ValidationError) -> RequestError:
    """The first failed check as one line naming the field (and, for a message, its place)."""
    first = error.errors(include_url=False)[0]
    loc = first["loc"]  # the field, then (for a message) its place and its field
    param = str(loc[0]) if loc else None
    if param == "messages":
        where = "messages" if len(loc) < 2 else f"messages[{loc[1]}]"
        field = loc[2] if len(loc) > 2 else None
        text = ("must be a non-empty list of {role, content} objects" if len(loc) < 2 else
                f"needs a role among {', '.join(sorted(ROLES))}" if field in (None, "role") else
                'content must be text (a string, or a list of {"type": "text", "text": ...} '
                'parts)')
        return RequestError(f"{where} {text}" if field != "content" else f"{where}.{text}",
                            param="messages")
    if first["type"] == "value_error":
        said = str(first["ctx"]["error"])
    elif first["type"] == "missing":
        said = "is required"
    elif first["type"] in KINDS:
        said = f"must be {KINDS[first['type']]}, got {json.dumps(first['input'])[:80]}"
    else:
        said = first["msg"][0].lower() + first["msg"][1:]
    return RequestError(f"{param} {said}" if param else said, param=param)


def _checked(model: type[_Body], body: dict, max_n: int) -> Any:
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise _refusal(error) from None
    if request.n > max_n:
        raise RequestError(f"n is {request.n} but this server decodes at most {max_n} "
                           f"sequences at once (its --max-batch): ask for at most {max_n}",
                           param="n")
    return request


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or RequestError."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON ({error}): send one JSON "
                           f"object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not a "
                           f"{type(body).__name__}")
    return body


def parse_completion(body: dict, *, max_n: int) -> Completion:
    """A /v1/completions body, checked (RequestError)."""
    return _checked(Completion, body, max_n)


def parse_chat(body: dict, *, max_n: int) -> Chat:
    """A /v1/chat/completions body, checked (RequestError)."""
    return _checked(Chat, body, max_n)
