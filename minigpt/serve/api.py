"""The web app: OpenAI's routes, the health check and the chat page, on FastAPI.

Every route that computes is under /v1 and, where the server has an API key, asks for it
(`Authorization: Bearer KEY`, 401 otherwise). A request is read with a size limit, parsed and
checked (`protocol`), tokenized off the event loop (a chat template renders in a process of its
own), checked against the context, and becomes one engine request per prompt and sample
(`choices`); the answer is one JSON object, or with `stream` server-sent events ending
`data: [DONE]`. Whatever a client sends wrong is an OpenAI error object with a 4xx status and
touches nothing else; a client that goes away mid-answer frees its slots at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

import minigpt.serve.responses as responses
from minigpt.serve.choices import Call
from minigpt.serve.protocol import RequestError, parse_chat, parse_completion, parse_json
from minigpt.serve.service import Service
from minigpt.tokenizer import TokenizerError

MAX_BODY = 32 << 20  # bytes: lm-evaluation-harness sends batches of long prompts


async def _body(request: Request) -> dict:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise RequestError(f"the request body is over {MAX_BODY >> 20} MiB", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise RequestError(f"the request body is over {MAX_BODY >> 20} MiB", status=413)
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(RequestError(message, status=status, code=code).body(),
                        status_code=status)


def create_app(service: Service) -> FastAPI:
    """The app serving `service` (its engine already started)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def post(events):
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, events)

        service.engine.post = post
        yield

    app = FastAPI(title="minigpt", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(TokenizerError)
    async def unreadable(request: Request, error: TokenizerError):
        # a prompt spelling a token the model cannot read (one past its embedding rows)
        return JSONResponse(RequestError(str(error), param="prompt").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return _error(error.status_code, str(error.detail))

    async def authorized(request: Request) -> None:
        if service.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {service.api_key}".encode()):
            raise RequestError("a valid API key is needed: send Authorization: Bearer KEY "
                               "with the key the server was started with (--api-key)",
                               status=401, code="invalid_api_key")

    app.include_router(_openai_routes(service, Depends(authorized)))
    app.include_router(_tokenizer_routes(service, Depends(authorized)))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.name, "dtype": service.dtype,
                **service.engine.health()}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("minigpt.serve").joinpath("static", "index.html").read_text()

    app.mount("/static", StaticFiles(packages=[("minigpt.serve", "static")]), name="static")
    return app


def _openai_routes(service: Service, authorized) -> APIRouter:
    """/v1: the models, completions and chat completions."""
    v1 = APIRouter(prefix="/v1", dependencies=[authorized])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return service.model_card()

    @v1.post("/completions")
    async def completions(request: Request):
        req = parse_completion(await _body(request), max_n=service.max_batch)
        service.check_model(req.model)
        choices, prompt_tokens = await run_in_threadpool(service.completion_choices, req)
        options = dict(logprobs=req.logprobs is not None, token_ids=req.token_ids)
        call, call_id = Call(service.engine, choices), responses.new_id("cmpl")
        if req.stream:
            return _stream(call, lambda c, first: responses.completion_chunk(
                call_id, service.name, c, first=first, **options), call_id, service.name,
                "text_completion", prompt_tokens, req.include_usage)
        await _finish(call, request)
        return responses.completion(call_id, service.name, choices, prompt_tokens=prompt_tokens,
                                    **options)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await _body(request), max_n=service.max_batch)
        service.check_model(req.model)
        choices, prompt_tokens = await run_in_threadpool(service.chat_choices, req)
        options = dict(logprobs=req.logprobs, token_ids=req.token_ids)
        call, call_id = Call(service.engine, choices), responses.new_id("chatcmpl")
        if req.stream:
            return _stream(call, lambda c, first: responses.chat_chunk(
                call_id, service.name, c, first=first, **options), call_id, service.name,
                "chat.completion.chunk", prompt_tokens, req.include_usage)
        await _finish(call, request)
        return responses.chat(call_id, service.name, choices, prompt_tokens=prompt_tokens,
                              **options)

    return v1


def _tokenizer_routes(service: Service, authorized) -> APIRouter:
    """vLLM's tokenizer routes, which lm-evaluation-harness's local-completions model uses
    (tokenizer_backend=remote) to count and cut prompts as the server does."""
    tokens = APIRouter(dependencies=[authorized])

    @tokens.get("/tokenizer_info")
    async def tokenizer_info():
        return service.tokenizer_info()

    @tokens.post("/tokenize")
    async def tokenize(request: Request):
        return await run_in_threadpool(service.tokenize, await _body(request))

    @tokens.post("/detokenize")
    async def detokenize(request: Request):
        return service.detokenize(await _body(request))

    return tokens


def _deliver(events) -> None:
    for request, event in events:
        request.sink(event)


async def _finish(call: Call, request: Request) -> None:
    """Run a call that does not stream to its end (or until its client leaves)."""
    async for _ in call.updates(gone=request.is_disconnected):
        pass
    failed = next((c.error for c in call.choices if c.error), None)
    if failed:
        raise RequestError(failed, status=500, kind="server_error")


def _stream(call: Call, chunk, call_id: str, model: str, kind: str, prompt_tokens: int,
            include_usage: bool) -> EventSourceResponse:
    """The call as server-sent events: a chunk per choice per batch of tokens, a usage chunk
    if asked for, then `[DONE]`."""
    async def events():
        first: dict[int, bool] = {}
        async for changed in call.updates():
            for choice in changed:
                data = chunk(choice, first.setdefault(choice.index, True))
                first[choice.index] = False
                if data is not None:
                    yield json.dumps(data, separators=(",", ":"))
            failed = next((c.error for c in changed if c.error), None)
            if failed:
                yield json.dumps(RequestError(failed, status=500, kind="server_error").body())
                break
        if include_usage:
            yield json.dumps(responses.usage_chunk(call_id, model, kind, prompt_tokens,
                                                   call.completion_tokens))
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", ping=15)

