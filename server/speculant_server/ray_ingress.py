"""The Ray Serve ingress: the one HTTP endpoint in front of the engine replicas.

Serve's proxy hands it each HTTP request. It reads the body (up to --max-body-size), works out
the conversation's routing keys (affinity.py) and calls a replica through a handle whose router
(ray_router.py) picks the replica holding that conversation. The replica answers with its own
app's status, headers and bytes, which go back as they come: JSON whole, SSE as a stream.

Failures: a replica that dies before its answer is complete (every non-streamed answer, and a
stream before its first byte) is retried on another replica, --ray-retries times; the client
gets one answer either way. A stream cut after it started cannot be sent again: it ends with an
OpenAI error event and ``data: [DONE]``, as the single server ends a stream that fails. Errors
of the ingress itself have OpenAI's JSON shape.

/metrics and /slots are fanned out to every replica and put together (ray_metrics.py). Nothing
here imports torch: the ingress starts in a second.
"""
from __future__ import annotations

import asyncio
import json
import time

import attrs

from speculant.logs import get_logger
from speculant_server.affinity import affinity_keys
from speculant_server.errors import ApiError
from speculant_server.ray_metrics import IngressStats, aggregate
from speculant_server.ray_router import REPLICA_KEY, ROUTERS

log = get_logger("speculant.server.ray")

REPLICA_HEADER = "x-speculant-replica"  # which replica answered: for clients, tests and debugging


@attrs.define
class IngressSettings:
    engine: str  # the engine deployment's name (its router is found by it)
    max_body_size: int = 16 * 2**20
    retries: int = 1  # times a request whose replica died before answering is sent again
    fanout_timeout: float = 10.0  # seconds a replica has to answer /metrics or /slots
    log_format: str = "console"


def _gone_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError

    return RayActorError, WorkerCrashedError  # RayActorError covers ActorDiedError and ActorUnavailableError


def error_response(status: int, message: str, type: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(ApiError(status, message, type).body(), status_code=status)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class Ingress:
    def __init__(self, engine_handle, settings: IngressSettings):
        from speculant_server.setup import configure_logging

        configure_logging(settings.log_format)
        self.engine = engine_handle
        self.settings = settings
        self.stats = IngressStats()
        self.gone = _gone_errors()

    async def __call__(self, request):
        method, path = request.method, request.url.path
        try:
            if method == "GET" and path == "/metrics":
                return await self.metrics(request)
            if method == "GET" and path == "/slots":
                return await self.slots(request)
            if path.startswith("/slots/"):
                raise ApiError(501, "slot save, restore and erase are per replica: not available through --ray "
                                    "(each replica keeps its own prompt cache)")
            body = await self.read_body(request)
        except ApiError as e:
            return error_response(e.status, e.message, e.type)
        keys = affinity_keys(method, path, request.headers, body)
        return await self.forward(keys, method, path, request.url.query, list(request.headers.items()), body)

    async def read_body(self, request) -> bytes:
        limit = self.settings.max_body_size
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is too large: {declared} bytes, the limit is {limit}")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"the request body is too large: more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _call(self, keys, method, path, query, headers, body):
        return self.engine.options(method_name="forward", stream=True).remote(keys, method, path, query, headers, body)

    async def forward(self, keys, method, path, query, headers, body):
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import Response, StreamingResponse

        t0 = time.perf_counter()
        for attempt in range(self.settings.retries + 1):
            stream = self._call(keys, method, path, query, headers, body)
            try:
                status, kept, replica = await stream.__anext__()
                self.stats.observe_routing(time.perf_counter() - t0)
                kept.append((REPLICA_HEADER, replica))
                content_type = next((v for k, v in kept if k.lower() == "content-type"), "")
                if content_type.startswith("text/event-stream"):
                    resp = StreamingResponse(self._relay(stream, replica), status_code=status)
                    _set_headers(resp, kept)
                    return resp
                data = b"".join([chunk async for chunk in stream])  # whole, so that a death before the end is retried
                resp = Response(data, status_code=status)
                _set_headers(resp, kept)
                return resp
            except self.gone as e:
                stream.cancel()
                self.stats.replica_deaths += 1
                log.warning("replica died before answering", path=path, attempt=attempt + 1, error=type(e).__name__,
                            retry=attempt < self.settings.retries)
                continue
            except BackPressureError:
                self.stats.rejected += 1
                return error_response(503, "the server is busy: every replica's queue is full; try again later")
            except asyncio.CancelledError:  # the client went away: so does the request on its replica
                stream.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - the relay in the replica failed (its app is gone, ...): not retried
                stream.cancel()
                self.stats.failed += 1
                log.exception("replica failed to relay", path=path)
                return error_response(500, f"internal error: the replica could not answer: {type(e).__name__}")
        self.stats.failed += 1
        return error_response(503, f"the replica serving the request died, {self.settings.retries + 1} time(s); "
                                   "Ray Serve is starting a new one: try again")

    async def _relay(self, stream, replica: str):
        """A stream's chunks; a replica that dies mid-stream ends it with an error event and [DONE]."""
        try:
            async for chunk in stream:
                yield chunk
        except self.gone as e:
            self.stats.replica_deaths += 1
            self.stats.failed += 1
            log.warning("replica died during a stream", replica=replica, error=type(e).__name__)
            yield _sse(ApiError(503, "the replica serving this stream died; the stream is incomplete").body())
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - headers are gone: the error travels as an event, as on one server
            self.stats.failed += 1
            log.exception("replica failed during a stream", replica=replica)
            yield _sse(ApiError(500, f"internal error: the stream broke off: {type(e).__name__}").body())
            yield b"data: [DONE]\n\n"

    # --- fan-out -----------------------------------------------------------------------------------------
    async def replica_ids(self) -> list[str]:
        router = ROUTERS.get(self.settings.engine)
        if router is None or not router.replica_ids():  # the handle's router starts with its first call
            await asyncio.wait_for(self.engine.options(method_name="whoami").remote([]), self.settings.fanout_timeout)
            router = ROUTERS.get(self.settings.engine)
        return router.replica_ids() if router is not None else []

    async def fan_out(self, request, path: str) -> list[tuple[str, int, list, bytes]]:
        """(replica, status, headers, body) of `path` on every live replica; a replica that does not
        answer within the fan-out timeout (dying, restarting) is left out."""
        headers = list(request.headers.items())

        async def one(replica: str):
            stream = self._call([REPLICA_KEY + replica], "GET", path, request.url.query, headers, b"")

            async def collect():
                status, kept, _ = await stream.__anext__()
                return replica, status, kept, b"".join([c async for c in stream])
            try:
                return await asyncio.wait_for(collect(), self.settings.fanout_timeout)
            except (asyncio.TimeoutError, *self.gone):
                stream.cancel()
                return None

        # One replica after another: calls made while serving one request share its internal
        # request id, by which Serve's router matches a chosen replica to its pending call, so
        # concurrent ones could be handed each other's replica.
        answers = [await one(r) for r in await self.replica_ids()]
        return [a for a in answers if a is not None]

    async def metrics(self, request):
        from starlette.responses import Response

        answers = await self.fan_out(request, "/metrics")
        for _, status, kept, body in answers:
            if status != 200:  # 401 without the API key: the replica's answer as it is
                return Response(body, status_code=status, media_type="application/json")
        router = ROUTERS.get(self.settings.engine)
        text = aggregate([body.decode() for *_, body in answers], self.stats, router.stats if router else None,
                         len(answers), router.load() if router else None)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def slots(self, request):
        from starlette.responses import JSONResponse, Response

        out = []
        for replica, status, _, body in await self.fan_out(request, "/slots"):
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
            out.extend({**slot, "replica": replica} for slot in json.loads(body))
        return JSONResponse(out)


def _set_headers(resp, headers: list[tuple[str, str]]) -> None:
    for k, v in headers:
        if k.lower() == "content-type":
            resp.headers["content-type"] = v
        else:
            resp.headers.append(k, v)
