"""A run served: its weights loaded, its engine started, uvicorn listening.

`open_service` loads a run's latest weights (adapters merged into them: one projection per
layer instead of two) under a preset and makes the decoding engine in the run's layout; the
`Service` it returns owns the engine's life (`with service:` starts its thread and compiles its
first programs, leaving stops it). `Server` binds the socket itself, so that a port in use is
one clear error and port 0 picks a free one, and runs uvicorn in a thread; `with server:` (or
`start`) returns once it accepts connections, `serve_forever` then waits for Ctrl-C. Anything
but a loopback address needs an API key: a server others can reach should not decode for
whoever finds it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from pathlib import Path

from minigpt.decoding import Engine
from minigpt.decoding.engine import TARGET_CALL_SECONDS
from minigpt.errors import UserError
from minigpt.models.execution import operand_dtype
from minigpt.runs import load_run
from minigpt.serve.service import Service

GRACE_SECONDS = 3  # how long Ctrl-C lets open streams end before it closes them


class ServeError(UserError):
    """The server cannot start as asked (an address taken, a non-loopback host without a key,
    a length past the context); the message says what to do."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: others may reach it
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond this machine without an API key (ServeError)."""
    if api_key is None and not is_loopback(host):
        raise ServeError(f"--host {host} can be reached from other machines: give an --api-key "
                         f"(or set MINIGPT_API_KEY) that clients must send, or serve on "
                         f"127.0.0.1")


def run_context(run):
    """The context the run's model runs in: its layout (mesh, rules, settings)."""
    return run.layout.active()


def check_port(port: int) -> None:
    """Refuse a port number no socket can have (ServeError), before anything is loaded."""
    if not 0 <= port <= 65535:
        raise ServeError(f"--port must be from 0 to 65535 (0: any free port), got {port}")


def open_service(run_dir: str | Path, *, preset: str = "dp", max_batch: int = 16,
                 max_len: int | None = None, api_key: str | None = None,
                 name: str | None = None, log=print, dtype: str = "float32") -> Service:
    """Load a run and make its engine: what the app serves (`with` it to run the engine)."""
    if max_batch < 1:
        raise ServeError(f"--max-batch must be at least 1, got {max_batch}")
    run = load_run(run_dir, preset, merge_adapters=True, dtype=dtype)
    context = run.model.config.context_len
    if max_len is not None and not 2 <= max_len <= context:
        raise ServeError(f"--max-len must be from 2 to the model's context ({context}), got "
                         f"{max_len}")
    engine = Engine(run.model, slots=max_batch, length=max_len, context=lambda: run_context(run),
                    log=log, call_seconds=TARGET_CALL_SECONDS, background=True)
    path = Path(run_dir)
    name = name or path.resolve().name
    created = int((path / "config.json").stat().st_mtime)
    return Service(engine=engine, tokenizer=run.tokenizer, name=name,
                   dtype=operand_dtype(dtype),
                   context=context, vocab_size=run.model.config.vocab_size,
                   max_batch=max_batch, api_key=api_key,
                   aliases=frozenset({str(run_dir), str(path.resolve())}), created=created)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), or ServeError: taken before the run is
    loaded, so that a port in use is said at once and nothing is left running."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound = socket.socket(family, socket.SOCK_STREAM)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        bound.bind((host, port))
    except OSError as error:
        bound.close()
        raise ServeError(f"cannot listen on {host}:{port} ({error.strerror}): choose another "
                         f"--port or --host") from None
    return bound


class Server:
    """uvicorn serving `service` on host:port (0: a free port; `port` says which), or on a
    socket `bind` made."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 8000, *,
                 bound: socket.socket | None = None):
        import uvicorn

        from minigpt.serve.api import create_app

        check_exposure(host, service.api_key)
        self.service, self.host = service, host
        self.socket = bound if bound is not None else bind(host, port)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(create_app(service), log_level="warning",
                                timeout_graceful_shutdown=GRACE_SECONDS, access_log=False)
        self.uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve until Ctrl-C (or SIGTERM, which the command line turns into an exit): open
        streams get a few seconds to end."""
        if self._thread is None:
            self.start()
        try:
            while self._thread.is_alive():
                self._thread.join(timeout=0.5)
        finally:
            self.stop()

    def start(self) -> Server:
        """Serve from a thread (signals stay the main thread's); returns once the server
        accepts connections."""
        self._thread = threading.Thread(target=self.uvicorn.run,
                                        kwargs={"sockets": [self.socket]}, daemon=True)
        self._thread.start()
        while not self.uvicorn.started and self._thread.is_alive():
            threading.Event().wait(0.02)
        if not self.uvicorn.started:
            self.stop()
            raise ServeError(f"the server on {self.url} did not start")
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)
        with contextlib.suppress(OSError):
            self.socket.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
