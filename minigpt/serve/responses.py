"""The JSON the server answers with, shaped as OpenAI's API reference shapes it.

Completions (`text_completion` objects and their chunks) report log-probabilities the legacy
way (`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob} including the chosen token,
`text_offset`), which is what lm-evaluation-harness reads; chat completions
(`chat.completion`, `chat.completion.chunk`) the newer way (`content`: one record per token with
its bytes and `top_logprobs`). With `return_tokens_as_token_ids` (vLLM's extension) a token is
named `token_id:N`, so that a client can compare ids exactly.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from minigpt.serve.choices import Choice, Entry


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _name(text: str, token: int, token_ids: bool) -> str:
    return f"token_id:{token}" if token_ids else text


def completion_logprobs(entries: list[Entry], token_ids: bool) -> dict[str, Any]:
    top = []
    for e in entries:
        if e.top is None:
            top.append(None)
            continue
        alternatives = {_name(t, i, token_ids): lp for t, i, lp in e.top}
        alternatives.setdefault(_name(e.text, e.id, token_ids), e.logprob)
        top.append(alternatives)
    return {"tokens": [_name(e.text, e.id, token_ids) for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[Entry], token_ids: bool) -> dict[str, Any]:
    def record(text, token, logprob):
        name = _name(text, token, token_ids)
        return {"token": name, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**record(e.text, e.id, e.logprob),
                         "top_logprobs": [record(t, i, lp) for t, i, lp in e.top or ()]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(call_id: str, model: str, choices: list[Choice], *, logprobs: bool,
               token_ids: bool, prompt_tokens: int) -> dict[str, Any]:
    """A whole `text_completion`."""
    out = [{"index": c.index, "text": c.prefix + c.text, "finish_reason": c.finish_reason,
            "logprobs": completion_logprobs(c.entries, token_ids) if logprobs else None}
           for c in choices]
    return {"id": call_id, "object": "text_completion", "created": now(), "model": model,
            "choices": out,
            "usage": usage(prompt_tokens, sum(c.tokens for c in choices))}


def completion_chunk(call_id: str, model: str, choice: Choice, *, logprobs: bool,
                     token_ids: bool, first: bool) -> dict[str, Any] | None:
    """What is new in a choice as a streamed `text_completion` chunk (None: nothing is)."""
    text, entries = choice.take()
    if first:
        text = choice.prefix + text
    if not (text or entries or choice.finish_reason):
        return None
    return {"id": call_id, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": choice.index, "text": text,
                         "logprobs": completion_logprobs(entries, token_ids) if logprobs
                         else None, "finish_reason": choice.finish_reason}]}


def chat(call_id: str, model: str, choices: list[Choice], *, logprobs: bool, token_ids: bool,
         prompt_tokens: int) -> dict[str, Any]:
    """A whole `chat.completion`."""
    out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.entries, token_ids) if logprobs else None,
            "finish_reason": c.finish_reason} for c in choices]
    return {"id": call_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": out, "usage": usage(prompt_tokens, sum(c.tokens for c in choices))}


def chat_chunk(call_id: str, model: str, choice: Choice, *, logprobs: bool, token_ids: bool,
               first: bool) -> dict[str, Any] | None:
    """What is new in a choice as a `chat.completion.chunk` (the first names the role)."""
    text, entries = choice.take()
    if not (first or text or entries or choice.finish_reason):
        return None
    delta = {"role": "assistant", "content": text} if first else (
        {"content": text} if text else {})
    return {"id": call_id, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": choice.index, "delta": delta,
                         "logprobs": chat_logprobs(entries, token_ids) if logprobs else None,
                         "finish_reason": choice.finish_reason}]}


def usage_chunk(call_id: str, model: str, kind: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream that asked for `stream_options.include_usage`."""
    return {"id": call_id, "object": kind, "created": now(), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
