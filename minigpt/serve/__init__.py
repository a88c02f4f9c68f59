"""Serving a run: OpenAI's HTTP API with continuous batching, and a chat page.

`python -m minigpt.serve --run RUN` loads a run and serves it: `engine` (decode slots that
requests join and leave step by step, run by one thread) over `steps` (its compiled decode
steps and prefills) and `draw` (each slot's next token); `request` (one sequence to decode),
`protocol` (requests checked at one door), `text` (tokens to text, stop strings), `choices`
(one API call's sequences on the engine), `responses` (OpenAI's JSON), `service` (what is
served and its limits), `api` (the FastAPI routes), `server` (loading the run, uvicorn) and
`cli`; the chat page is `static/`. The web stack is the `serve` extra:
`pip install "minigpt[serve]"`.
"""

from minigpt.serve.engine import Engine
from minigpt.serve.protocol import RequestError
from minigpt.serve.request import Request
from minigpt.serve.server import ServeError, Server, open_service
from minigpt.serve.service import Service

__all__ = ["Engine", "Request", "RequestError", "ServeError", "Server", "Service",
           "open_service"]
