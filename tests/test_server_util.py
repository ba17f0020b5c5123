"""Helpers for the server tests (no tests here): a tiny model, test speculators, an app on a test server."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time

import torch

from speculant import Draft, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model

_models: dict = {}


def tiny_model(tmp_dir) -> object:
    """The qwen2 tiny model (gpt2 vocabulary, ChatML template), loaded once per process."""
    if "qwen2" not in _models:
        path = write_tiny_model(tmp_dir / "tiny-qwen2.gguf", "qwen2")
        _models["qwen2"] = load_model(path, progress=False)
    torch.set_num_threads(1)  # the CPU backend sets all cores when it is created
    return _models["qwen2"]


def aiotest(fn):
    """Run an async test function in a fresh event loop (pytest-asyncio is not installed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


# --- test speculators ------------------------------------------------------------------------------
class Lookup:
    """Prompt lookup: find the last occurrence of the last two tokens earlier in the history and
    draft what followed it. Real drafts with real (partial) acceptance on repetitive text."""

    def __init__(self, spec_type="test-lookup"):
        self.spec_type = spec_type
        self.proposed = 0

    @hookimpl
    def propose(self, seq, limits):
        toks = seq.tokens
        if len(toks) < 3:
            return None
        key = toks[-2:]
        for i in range(len(toks) - 3, 0, -1):
            if toks[i - 1 : i + 1] == key:
                follow = toks[i + 1 : i + 1 + limits.n_max]
                if follow:
                    self.proposed += 1
                    return Draft(tuple(follow), self.spec_type)
        return None


class Slow:
    """No drafts; makes every engine step take `seconds`: sleeping (GIL released) or spinning in
    Python (GIL held, the worst case for the event loop). Use it with adaptive=False: the adaptive
    controller soon stops asking a speculator that costs time and drafts nothing."""

    def __init__(self, seconds=0.02, spin=False, spec_type="test-slow"):
        self.seconds, self.spin, self.spec_type = seconds, spin, spec_type

    @hookimpl
    def propose(self, seq, limits):
        if self.spin:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(self.seconds)
        return None


class Boom:
    """Raises in propose for prompts containing `trigger` (a token id); drafts garbage otherwise."""

    def __init__(self, trigger, spec_type="test-boom"):
        self.trigger, self.spec_type = trigger, spec_type

    @hookimpl
    def propose(self, seq, limits):
        if self.trigger in seq.tokens[: seq.n_prompt]:
            raise RuntimeError("boom")
        return Draft((0,) * min(2, limits.n_max), self.spec_type)


KNOWN = ["test-boom", "test-lookup", "test-slow", "test-unused"]


def make_engine(model, n_ctx=256, speculators=(), **config) -> Engine:
    return Engine(model, EngineConfig(n_ctx=n_ctx, **config), list(speculators))


@contextlib.asynccontextmanager
async def serve(engine, **config):
    """A TestClient on a real socket for an app around `engine` (ServerConfig fields as kwargs)."""
    from aiohttp.test_utils import TestClient, TestServer

    from speculant_server.app import ServerConfig, create_app

    app = create_app(engine, ServerConfig(**config), spec_known=KNOWN)
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def assert_error(status, body, want_status, *words):
    """An error response in OpenAI's shape, with `want_status` and each of `words` in its message."""
    assert status == want_status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == want_status
    assert isinstance(err["message"], str) and err["message"]
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


async def post(client, path, body, **kw):
    """(status, JSON) of a POST."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with client.post(path, data=data, **kw) as r:
        return r.status, await r.json()


async def sse(client, path, body, **kw):
    """(status, list of decoded `data:` payloads; the [DONE] marker as the string "[DONE]")."""
    events = []
    async with client.post(path, json=body, **kw) as r:
        if r.status != 200:
            return r.status, [await r.json()]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return r.status, events


def chat_text(events) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for e in events if isinstance(e, dict)
                   for c in e.get("choices", []))
