"""`speculant serve`: an OpenAI- and llama-server-compatible HTTP server on aiohttp.

One engine thread owns the Engine and runs every active request's sequence in one batched step;
the event loop only parses, tokenizes (in an executor) and relays events. See docs/server.md.
"""
from speculant_server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
