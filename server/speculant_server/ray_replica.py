"""One Ray Serve replica of the engine: `speculant serve`'s own app, in-process.

The replica builds the model, engine and aiohttp app from serve's flags exactly as `speculant
serve` does (cli.build_server), and runs the app on its own event loop thread, listening on a
Unix socket in a private folder. Requests arrive through Serve (the ingress calls `forward`)
and are relayed to that socket as they came; the answer goes back as a stream: first
(status, headers, replica id), then the body's bytes as the app writes them. So every endpoint,
error, SSE stream and limit behaves as on a single server, from one implementation, and the
relay costs a local socket round trip.

The engine never sees Ray. A dead engine thread fails `check_health`, and Serve replaces the
replica.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading

# Hop-by-hop headers, and those the relay sets itself.
DROP_REQUEST = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
                          "trailer", "accept-encoding", "proxy-connection", "proxy-authorization"})
DROP_RESPONSE = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


FOLDER_PREFIX = "speculant-replica-"  # then the replica's pid: a killed replica's folder is removed by a later one


def remove_stale_folders() -> None:
    """Socket folders of replicas that were killed (no graceful shutdown removed them)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(FOLDER_PREFIX):].split("-", 1)[0] if name.startswith(FOLDER_PREFIX) else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # alive, someone else's
            pass


class AppThread(threading.Thread):
    """An aiohttp app served on a Unix socket by a loop of its own (not Serve's)."""

    def __init__(self, app, path: str, shutdown_timeout: float):
        super().__init__(name="speculant-app", daemon=True)
        self.app, self.path, self.shutdown_timeout = app, path, shutdown_timeout
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._quit: asyncio.Event | None = None

    def run(self):
        from aiohttp import web

        from speculant_server.app import SHUTDOWN_FLUSH

        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=max(0.05, min(SHUTDOWN_FLUSH, self.shutdown_timeout / 2) / 2))
        try:
            self._quit = asyncio.Event()
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.UnixSite(runner, self.path).start())
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's thread
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        try:
            loop.run_until_complete(self._quit.wait())
        finally:
            loop.run_until_complete(runner.cleanup())  # the app's drain: running requests may finish
            loop.close()

    def stop(self, timeout: float):
        if self._loop is not None and self._quit is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._quit.set)
        self.join(timeout)


class EngineReplica:
    """The engine deployment's class (ray_app.py makes it a Serve deployment)."""

    def __init__(self, args):
        from ray import serve

        from speculant_server.app import STATE
        from speculant_server.setup import build_server, configure_logging

        configure_logging(args.log_format)
        app, _ = build_server(args)
        self.worker = app[STATE].worker
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        remove_stale_folders()
        self._folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        self._socket = os.path.join(self._folder, "app.sock")
        self._thread = AppThread(app, self._socket, args.shutdown_timeout)
        self._shutdown_timeout = args.shutdown_timeout
        self._thread.start()
        self._thread.ready.wait()
        if self._thread.error is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise RuntimeError(f"the replica's app did not start: {self._thread.error}")
        self._session = None
        self._closing = False

    def _client(self):
        from aiohttp import ClientSession, ClientTimeout, UnixConnector

        if self._session is None or self._session.closed:  # made on Serve's loop, where it is used
            self._session = ClientSession(connector=UnixConnector(path=self._socket),
                                          timeout=ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def forward(self, keys: list[str], method: str, path: str, query: str, headers: list[tuple[str, str]],
                      body: bytes):
        """Relay one request to the app; yield (status, headers, replica id), then the body's
        chunks. `keys` are the router's (ray_router.py), unused here."""
        from yarl import URL

        url = URL("http://replica" + path + ("?" + query if query else ""), encoded=True)
        sent = [(k, v) for k, v in headers if k.lower() not in DROP_REQUEST]
        async with self._client().request(method, url, headers=sent, data=body or None,
                                          allow_redirects=False, auto_decompress=False) as resp:
            kept = [(k, v) for k, v in resp.headers.items() if k.lower() not in DROP_RESPONSE]
            yield resp.status, kept, self.replica_id
            async for chunk in resp.content.iter_any():
                yield chunk

    async def whoami(self, keys: list[str] | None = None) -> str:
        return self.replica_id

    def check_health(self):
        """Serve's health check: a dead engine thread or app loop cannot come back in the process."""
        if self.worker.died is not None or not self.worker.alive:
            raise RuntimeError(f"the engine thread is not running ({self.worker.died})")
        if not self._thread.is_alive():
            raise RuntimeError("the replica's app loop has stopped")

    def __del__(self):
        """Serve's graceful shutdown calls this and awaits what it returns: the app drains
        (running requests may finish within --shutdown-timeout), then the socket's folder goes.
        Python calls it again when the object goes, or first if Serve never did (a constructor
        that failed halfway): then it cleans up at once."""
        if getattr(self, "_closing", True):  # closed already, or never built
            return None
        self._closing = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not from Serve's loop: no one would await a coroutine
            self._thread.stop(self._shutdown_timeout + 1)
            shutil.rmtree(self._folder, ignore_errors=True)
            return None
        return self._close()

    async def _close(self):
        if self._session is not None:
            await self._session.close()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.stop, self._shutdown_timeout + 1)
        shutil.rmtree(self._folder, ignore_errors=True)
