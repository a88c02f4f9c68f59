"""Serving a run: OpenAI's HTTP API with continuous batching, and a chat page.

`python -m minigpt.serve --run RUN` loads a run and serves it on the decoding engine every door
shares (`minigpt.decoding`: slots that requests join and leave call by call, run by a thread of
its own here): `protocol` (request bodies checked at one door, as pydantic models), `choices`
(one API call's sequences on the engine), `responses` (OpenAI's JSON), `service` (what is
served, its limits, and the engine's life), `api` (the FastAPI routes), `server` (loading the
run, the socket, uvicorn) and `cli`; the chat page is `static/`. The web stack is the `serve`
extra: `pip install "minigpt[serve]"`.
"""

from minigpt.decoding import Engine, Request
from minigpt.serve.protocol import RequestError
from minigpt.serve.server import ServeError, Server, open_service
from minigpt.serve.service import Service

__all__ = ["Engine", "Request", "RequestError", "ServeError", "Server", "Service",
           "open_service"]
