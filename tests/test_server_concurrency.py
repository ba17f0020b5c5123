"""Slots and concurrency: batched requests equal one-at-a-time ones, disconnects free their slot,
/health answers during a long generation."""
import asyncio
import json
import time

import aiohttp
import pytest

from test_server_util import Lookup, Slow, aiotest, make_engine, post, serve, tiny_model

WORDS = ["def", "add", "class", "hello", "world", "return", "model", "total", "print", "values"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


def requests_32():
    out = []
    for i in range(32):
        words = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 5))
        if i % 3 == 0:
            out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                                 "max_tokens": 6 + i % 7, "temperature": 0}))
        elif i % 3 == 1:
            out.append(("/v1/completions", {"prompt": words + " " + words, "max_tokens": 6 + i % 5, "temperature": 0}))
        else:
            out.append(("/completion", {"prompt": words, "n_predict": 5 + i % 6, "temperature": 0, "stream": i % 2 == 0}))
    return out


async def run_one(client, path, body):
    """(text, completion tokens) of a request, streamed or not."""
    async with client.post(path, json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            data = await r.json()
            if "choices" in data:
                c = data["choices"][0]
                return (c.get("message") or {}).get("content", c.get("text")), data["usage"]["completion_tokens"]
            return data["content"], data["tokens_predicted"]
        text, n = [], None
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                text.append(ev["content"])
                n = ev.get("tokens_predicted", n)
        return "".join(text), n


@pytest.mark.parametrize("speculate", [False, True])
@aiotest
async def test_32_concurrent_requests_on_4_slots_equal_one_at_a_time(model, speculate):
    reqs = requests_32()
    specs = [Lookup()] if speculate else []
    async with serve(make_engine(model, speculators=specs, adaptive=False), n_slots=4) as c:
        alone = [await run_one(c, p, b) for p, b in reqs]
        t0 = time.perf_counter()
        together = await asyncio.gather(*(run_one(c, p, b) for p, b in reqs))
        elapsed = time.perf_counter() - t0
        metrics = await (await c.get("/metrics")).text()
        slots = await (await c.get("/slots")).json()
    assert together == alone
    assert all(n > 0 for _, n in alone)
    busy = float(next(l for l in metrics.splitlines() if l.startswith("speculant:n_busy_slots_per_decode")).split()[1])
    assert busy > 1.0  # the concurrent run really batched sequences into one step
    if speculate:
        drafts = float(next(l for l in metrics.splitlines() if l.startswith("speculant:spec_decode_num_drafts_total")).split()[1])
        assert drafts > 0
    assert not any(s["is_processing"] for s in slots)
    assert elapsed < 60


async def _wait_idle(c, timeout=3.0):
    """Seconds until no slot is busy."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        slots = await (await c.get("/slots")).json()
        if not any(s["is_processing"] for s in slots):
            return time.perf_counter() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"a slot is still busy after {timeout} s: {slots}")


@aiotest
async def test_disconnect_mid_stream_frees_the_slot(model):
    engine = make_engine(model, speculators=[Slow(0.02)], adaptive=False)
    async with serve(engine, n_slots=1) as c:
        url = str(c.make_url("/v1/chat/completions"))
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as s:
            r = await s.post(url, json=body)
            got = 0
            async for raw in r.content:
                if raw.startswith(b"data: "):
                    got += 1
                if got == 4:
                    break
            slots = await (await c.get("/slots")).json()
            assert slots[0]["is_processing"] and slots[0]["next_token"]["n_decoded"] >= 3
            r.close()  # hang up mid-stream
        t_freed = await _wait_idle(c)
        assert t_freed < 1.0
        assert not engine.sequences
        metrics = await (await c.get("/metrics")).text()
        assert "speculant:requests_cancelled_total 1.0" in metrics
        # the slot serves the next request
        status, r = await post(c, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 3})
        assert status == 200 and r["usage"]["completion_tokens"] == 3


@aiotest
async def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_the_slot(model):
    engine = make_engine(model, speculators=[Slow(0.02)], adaptive=False)
    async with serve(engine, n_slots=1) as c:
        url = str(c.make_url("/completion"))
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(url, json={"prompt": "hello", "n_predict": 200}, timeout=aiohttp.ClientTimeout(total=0.3))
        t_freed = await _wait_idle(c)
        assert t_freed < 1.0 and not engine.sequences


@aiotest
async def test_health_answers_within_100ms_during_a_long_generation(model):
    # Every engine step spins 30 ms in Python holding the GIL: the worst case for the event loop.
    engine = make_engine(model, speculators=[Slow(0.03, spin=True)], adaptive=False)
    async with serve(engine, n_slots=1) as c:
        gen = asyncio.create_task(post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 60, "temperature": 0}))
        await asyncio.sleep(0.2)
        latencies = []
        while not gen.done():
            t0 = time.perf_counter()
            r = await c.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert r.status == 200
            await asyncio.sleep(0.05)
        status, body = await gen
    assert status == 200 and body["usage"]["completion_tokens"] == 60
    assert len(latencies) >= 5
    assert max(latencies) < 0.1, latencies
    print(f"/health latency during generation: max {max(latencies) * 1e3:.1f} ms over {len(latencies)} calls")
