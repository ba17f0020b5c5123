"""`speculant serve`: flags (named like llama-server's) and start-up.

Also runnable as ``python -m speculant_server -m MODEL.gguf ...`` (the same flags).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys

from speculant.errors import SpeculantError
from speculant_server.setup import add_serve_args, api_keys, build_server, configure_logging

__all__ = ["add_parser", "add_serve_args", "build_server", "cmd_serve", "configure_logging", "main"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `speculant`'s subparsers."""
    p = sub.add_parser("serve", help="OpenAI- and llama-server-compatible HTTP server with speculative decoding")
    add_serve_args(p)
    return p


def cmd_serve(args) -> int:
    if getattr(args, "ray", False):  # replicas on Ray Serve: its own module, Ray imported only there
        from speculant_server.ray_app import cmd_serve_ray

        return cmd_serve_ray(args)

    from aiohttp import web

    from speculant.logs import get_logger
    from speculant.speculator import parse_spec_types

    from speculant_server.app import SHUTDOWN_FLUSH, STATE

    parse_spec_types(args.spec_type)  # an unknown spec type fails before the model loads
    try:  # a taken port fails before the model loads too
        with socket.create_server((args.host, args.port)) if args.port else socket.socket():
            pass
    except OSError as e:
        raise SpeculantError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None

    app, config = build_server(args)
    configure_logging(args.log_format)  # only now: the checks above fail in one plain line
    log = get_logger("speculant.server")
    keys = api_keys(args)
    worker = app[STATE].worker
    # A dead engine thread cannot be brought back in the process: stop, so that a supervisor
    # (systemd, Kubernetes) restarts the server; its in-flight requests have had their error.
    worker.on_death = lambda: os.kill(os.getpid(), signal.SIGTERM)

    def announce(message: str = "", *_):  # aiohttp's "Running on http://HOST:PORT" names the port bound
        found = re.search(r"https?://[^\s]+", str(message))
        log.info("listening", url=found.group(0) if found else f"http://{args.host}:{args.port}", model=args.model, n_ctx=config.n_ctx,
                 slots=args.parallel, spec_types=args.spec_type or "none", api_key=bool(keys))

    try:
        web.run_app(app, host=args.host, port=args.port, print=announce, handler_cancellation=True,
                    access_log=None,
                    # after the app's own drain (its on_shutdown): the handlers only send their last bytes
                    shutdown_timeout=max(0.05, min(SHUTDOWN_FLUSH, args.shutdown_timeout / 2) / 2))
    except OSError as e:
        raise SpeculantError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if worker.died is not None:
        print(f"speculant: error: the engine thread died ({worker.died}); exiting", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from speculant.flags import OneLineParser

    parser = OneLineParser(prog="python -m speculant_server", description="speculant serve")
    add_serve_args(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return cmd_serve(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
