"""`speculant serve`: an OpenAI- and llama-server-compatible HTTP server on aiohttp.

One engine thread owns the Engine and runs every active request's sequence in one batched step;
the event loop only parses, tokenizes (in an executor) and relays events. See docs/server.md.
The app is imported lazily, so `speculant`'s argument parser can add `serve` without loading aiohttp.
"""

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name):
    if name in __all__:
        from speculant_server import app

        return getattr(app, name)
    raise AttributeError(name)
