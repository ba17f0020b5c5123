"""speculant_server as a speculant plugin (entry point `server`): it adds the `serve` command.

The server's modules load only when the command runs, so `speculant generate` does not pay for
aiohttp."""
from __future__ import annotations

from speculant import hookimpl


@hookimpl
def speculant_add_commands(subparsers, register):
    from speculant_server.cli import add_parser, cmd_serve

    add_parser(subparsers)
    register("serve", cmd_serve)
