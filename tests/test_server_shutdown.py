"""Slow clients and shutdown (issue 22): a body sent half-way is timed out (408, connection closed),
idle connections and incomplete request heads are closed after the keep-alive timeout, and on
SIGTERM the server refuses new work with 503, lets running requests finish or fails them with an
error (an error event and [DONE] on a stream), and exits within --shutdown-timeout."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from speculant_server.cli import main as serve_main

from test_server_util import aiotest, assert_error, make_engine, post, serve, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


async def _read_all(reader, limit=10.0):
    """Everything the server sends until it closes the connection, and how long that took."""
    t = time.perf_counter()
    data = await asyncio.wait_for(reader.read(), limit)
    return data, time.perf_counter() - t


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"


@aiotest
async def test_half_sent_body_gets_408_and_the_connection_closes(model):
    async with serve(make_engine(model), body_timeout=0.5, keepalive_timeout=30) as c:
        reader, writer = await asyncio.open_connection(c.host, c.port)
        writer.write(HEAD + b'{"messages": [')
        data, seconds = await _read_all(reader)
        assert 0.4 < seconds < 3, seconds
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, data
        err = json.loads(body)["error"]
        assert err["code"] == 408 and "did not arrive within 0.5 s" in err["message"]
        writer.close()

        # a body trickled a byte at a time is cut off as well: the timeout is for the whole body
        reader, writer = await asyncio.open_connection(c.host, c.port)
        writer.write(HEAD)

        async def trickle():
            for _ in range(100):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.05)

        dribble = asyncio.ensure_future(trickle())
        data, seconds = await _read_all(reader)
        dribble.cancel()
        assert data.startswith(b"HTTP/1.1 408") and seconds < 3, (data, seconds)
        writer.close()

        # the server goes on serving
        status, body = await post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200, body


@aiotest
async def test_idle_and_incomplete_head_connections_close_after_keep_alive(model):
    async with serve(make_engine(model), keepalive_timeout=0.5) as c:
        idle = await asyncio.open_connection(c.host, c.port)
        partial = await asyncio.open_connection(c.host, c.port)
        partial[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
        for reader, writer in (idle, partial):
            data, seconds = await _read_all(reader)
            assert data == b"" and seconds < 3, (data, seconds)
            writer.close()
        # a connection reused within the timeout stays open
        reader, writer = await asyncio.open_connection(c.host, c.port)
        for _ in range(3):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            line = await asyncio.wait_for(reader.readline(), 5)
            assert line.startswith(b"HTTP/1.1 200"), line
            while (await reader.readline()) != b"\r\n":
                pass
            await reader.readexactly(len(json.dumps({"status": "ok"})))
            await asyncio.sleep(0.2)
        writer.close()


@aiotest
async def test_draining_server_refuses_new_work_with_503(model):
    async with serve(make_engine(model)) as c:
        from speculant_server.app import STATE

        c.server.app[STATE].worker.begin_shutdown()
        r = await c.get("/health")
        assert_error(r.status, await r.json(), 503, "shutting down")
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/completion", {"prompt": "hi"}), ("/slots/0?action=erase", {})):
            status, out = await post(c, path, body)
            assert_error(status, out, 503, "shutting down")


@pytest.mark.parametrize("argv, flag", [(["--timeout-body", "0"], "--timeout-body"),
                                        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive"),
                                        (["--shutdown-timeout", "nan"], "--shutdown-timeout")])
def test_bad_timeout_flags(capsys, argv, flag):
    assert serve_main(["-m", "x.gguf", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_help_lists_the_timeout_flags(capsys):
    assert serve_main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--timeout-body", "--timeout-keep-alive", "--shutdown-timeout"):
        assert flag in out


# --- SIGTERM on a real `speculant serve` --------------------------------------------------------------------
SLEEPY = '''
import time

from speculant import hookimpl


class Sleepy:
    """Makes every decoding step take 50 ms (drafts nothing), so that a stream is still running
    when the test sends SIGTERM."""

    spec_type = "sleepy"

    def __init__(self, config):
        pass

    @hookimpl
    def propose(self, seq, limits):
        time.sleep(0.05)
        return None


@hookimpl
def speculant_register_speculators(register):
    register("sleepy", Sleepy)
'''


class Server:
    """`speculant serve` on a tiny model with one slot, each token taking 50 ms."""

    def __init__(self, tmp_path, *flags):
        from fake_dists import write_dist
        from speculant.testing.tiny_gguf import write_tiny_model

        site = tmp_path / "site"
        site.mkdir()
        write_dist(site, "speculant-sleepy", "1.0", {"sleepy": "fakesleepy"}, {"fakesleepy.py": SLEEPY})
        model = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               "SPECULANT_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "speculant.cli", "serve", "-m", model, "--port", str(self.port), "-c", "256", "-np", "1",
             "--spec-type", "sleepy", "--no-spec-adaptive", *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise AssertionError("the server did not start: " + self.proc.communicate()[1][-2000:])

    def request(self, method, path, body=None, timeout=60):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()

    def stream(self, body, out: list):
        """POST a streaming chat request; appends its status, then each `data:` payload (decoded)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        out.append(r.status)
        try:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        except (OSError, http.client.HTTPException) as e:
            out.append(e)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate()


CHAT = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0}


def _wait_for_tokens(events, n=3, timeout=30):
    deadline = time.monotonic() + timeout
    while sum(isinstance(e, dict) for e in events) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sum(isinstance(e, dict) for e in events) >= n, events


def test_sigterm_fails_running_streams_with_an_error_event_and_exits_in_time(tmp_path):
    server = Server(tmp_path, "--shutdown-timeout", "2")
    try:
        events, waiting = [], []
        running = threading.Thread(target=server.stream, args=({**CHAT, "max_tokens": 230}, events))
        running.start()  # ~12 s of tokens
        _wait_for_tokens(events)
        queued = threading.Thread(target=lambda: waiting.append(server.request("POST", "/completion", {"prompt": "hi", "n_predict": 3})))
        queued.start()  # waits for the one slot
        time.sleep(0.3)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
        running.join(10)
        queued.join(10)
    finally:
        _, err = server.close()
    assert code == 0, err
    assert took < 2 + 0.75, (took, err)  # the timeout, plus the slack of a loaded machine
    # the waiting request: refused at once, in OpenAI's error shape
    status, body = waiting[0]
    assert_error(status, json.loads(body), 503, "shutting down")
    # the running stream: tokens, then an error event, then [DONE]
    assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
    last = events[-2]
    assert set(last) == {"error"}, last
    assert_error(last["error"]["code"], last, 503, "shutting down", "shutdown timeout")
    assert all("choices" in e for e in events[1:-2])
    assert "stopped running requests" in err and "finish_reason='shutdown'" in err, err.replace("\n", " | ")


def test_sigterm_lets_a_running_stream_finish_and_exits_when_it_has(tmp_path):
    server = Server(tmp_path, "--shutdown-timeout", "20")
    try:
        events = []
        running = threading.Thread(target=server.stream, args=({**CHAT, "max_tokens": 40}, events))
        running.start()  # ~2 s of tokens
        _wait_for_tokens(events)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
        running.join(10)
    finally:
        _, err = server.close()
    assert code == 0, err
    assert took < 8, took  # it waits for the stream (~2 s), not for the whole timeout
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events)
