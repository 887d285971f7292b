"""`trellis serve -m DIR [--port P] [--host H] [--api-key KEY]`: the OpenAI-compatible API.

Binds 127.0.0.1 unless told otherwise: a local model server should not be reachable from the
network by accident. The listening socket is bound before the model loads, so a busy port is
reported at once, and the line "serving ... at http://HOST:PORT/v1" on stderr says the server
is ready (with --port 0 it names the port the system picked).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from engine.errors import TrellisError

DEFAULT_PORT = 8000


def register(subparsers) -> None:
    sp = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                               description="Serve a model over an OpenAI-compatible HTTP API "
                                           "(/v1/models, /v1/chat/completions, /v1/completions, /v1/tokenize).")
    sp.add_argument("-m", "--model", required=True, type=Path, help="model folder")
    sp.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--api-key", default=os.environ.get("TRELLIS_API_KEY"),
                    help="require `Authorization: Bearer KEY` (default: $TRELLIS_API_KEY; none: no key)")
    sp.add_argument("--model-id", default=None, help="model name clients send (default: the folder name)")
    sp.add_argument("--max-context", type=int, default=0, help="context length in tokens (default: the model's)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    sp.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body accepted (default 16)")
    sp.set_defaults(func=run)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TrellisError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def run(args: argparse.Namespace) -> int:
    if not args.model.is_dir():
        raise TrellisError(f"model folder not found: {args.model}")
    if not 0 <= args.port <= 65535:
        raise TrellisError(f"--port must be between 0 and 65535 (got {args.port})")
    import uvicorn

    from engine.worker import protocol as p
    from engine.worker.api import ServerSettings, create_app
    from engine.worker.host import ModelHost, WorkerError
    from engine.worker.jobs import EngineQueue

    sock = bind_socket(args.host, args.port)
    host = ModelHost()
    try:
        host.load(p.Load(model_dir=str(args.model), max_context=args.max_context, device=args.device))
    except WorkerError as e:
        sock.close()
        raise TrellisError(str(e)) from None
    engine = EngineQueue(name="serve-engine")
    model_id = args.model_id or args.model.resolve().name
    settings = ServerSettings(model_id=model_id, api_key=args.api_key or None,
                              max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    app = create_app(host, engine, settings)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"trellis: serving {model_id} at http://{shown}:{bound_port}/v1"
          + (" (API key required)" if settings.api_key else ""), file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=5)
    return 0
