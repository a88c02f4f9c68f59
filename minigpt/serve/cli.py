"""`python -m minigpt.serve`: flags to a served run.

The command line is thin: refuse what cannot work before loading anything (a host others can
reach without an API key, a port no socket can have), load the run and compile its first
programs, listen, say where once connections are accepted, and serve until Ctrl-C, which closes
open streams within a few seconds and exits 0. A port already in use stops the engine it
started: nothing is left running.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from minigpt.config import DTYPES
from minigpt.errors import exit_code
from minigpt.runtime import log, plain_warnings, set_simulated_devices
from minigpt.serve.server import Server, bind, check_exposure, open_service


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minigpt.serve",
        description="Serve a run over OpenAI's HTTP API (/v1/completions, "
                    "/v1/chat/completions) with continuous batching, and a chat page at /.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="run directory written by minigpt.train or "
                                                "minigpt.hub import")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs --api-key")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--preset", default="dp", help="how to lay the model out on the devices")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="what the model computes in: float32 (exact), bfloat16 (half the bytes "
                        "a decode step reads) or auto (bfloat16 on an accelerator)")
    p.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    p.add_argument("--max-batch", type=int, default=16,
                   help="decode slots: sequences decoded at once (more wait in a queue)")
    p.add_argument("--max-len", type=int, default=None,
                   help="positions per slot, prompt and reply together (default: the model's "
                        "context); the key/value cache holds max-batch x max-len positions")
    p.add_argument("--api-key", default=os.environ.get("MINIGPT_API_KEY"),
                   help="the key clients send as 'Authorization: Bearer KEY' (default: "
                        "$MINIGPT_API_KEY)")
    p.add_argument("--name", help="the model's id in the API (default: the run's folder name)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.devices:
        set_simulated_devices(args.devices)
    # SIGTERM ends the server as Ctrl-C does: uvicorn closes it gracefully, then raises the
    # signal again, which lands here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with plain_warnings():
            return exit_code(lambda: _serve(args))
    except KeyboardInterrupt:  # Ctrl-C, while loading or after uvicorn's graceful shutdown
        return 0


def _serve(args: argparse.Namespace) -> int:
    check_exposure(args.host, args.api_key)
    bound = bind(args.host, args.port)
    try:
        service = open_service(args.run, preset=args.preset, max_batch=args.max_batch,
                               max_len=args.max_len, api_key=args.api_key, name=args.name,
                               log=log, dtype=args.dtype)
    except BaseException:
        bound.close()
        raise
    with service, Server(service, args.host, bound=bound) as server:
        log(f"serving {service.name} on {server.url} ({service.max_batch} slots of "
            f"{service.length} positions): chat at {server.url}/, OpenAI API at "
            f"{server.url}/v1{', API key required' if args.api_key else ''}; Ctrl-C stops")
        server.serve_forever()
    return 0
