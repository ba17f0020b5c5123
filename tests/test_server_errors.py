"""Bad input, limits and failures: each gets an OpenAI-shaped JSON error and the server keeps serving."""
import pytest
import structlog

from test_server_util import Boom, Lookup, Slow, aiotest, assert_error, make_engine, post, serve, sse, tiny_model

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


async def still_serving(c):
    status, body = await post(c, "/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 4


BAD_REQUESTS = [
    # (path, raw body, words in the message)
    ("/v1/chat/completions", b'{"messages": [', ["not valid JSON"]),
    ("/v1/chat/completions", b"[1, 2]", ["JSON object"]),
    ("/completion", b"\xff\xfe", ["not valid JSON"]),
    ("/v1/chat/completions", {"messages": "hi"}, ["messages"]),
    ("/v1/chat/completions", {"messages": []}, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, ["content"]),
    ("/v1/chat/completions", {}, ["'messages' is required"]),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "10"}, ["'max_tokens' must be an integer"]),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, ["'max_tokens' must be an integer"]),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, ["'temperature' must be a number"]),
    ("/v1/chat/completions", {**CHAT, "temperature": True}, ["'temperature' must be a number"]),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, ["'top_p' must be in [0, 1]"]),
    ("/v1/chat/completions", {**CHAT, "seed": "x"}, ["'seed'"]),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, ["'stream' must be a boolean"]),
    ("/v1/chat/completions", {**CHAT, "stream_options": []}, ["stream_options"]),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, ["'stop'"]),
    ("/v1/chat/completions", {**CHAT, "n": 0}, ["'n' must be in [1, 8]"]),
    ("/v1/chat/completions", {**CHAT, "n": 9}, ["'n' must be in [1, 8]"]),
    ("/v1/chat/completions", {**CHAT, "n": 5}, ["more than this server's 4 slots"]),
    ("/completion", {"prompt": "hi", "n": 2}, ["'n' must be 1 on /completion"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, ["'logprobs' must be a boolean"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, ["'top_logprobs' must be in [0, 20]"]),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, ["'top_logprobs' needs 'logprobs': true"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, ["'logprobs' must be in [0, 20]"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, ["'logprobs' must be an integer"]),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, ["ask with 'logprobs'"]),
    ("/completion", {"prompt": "hi", "n_probs": -1}, ["'n_probs' must be in [0, 20]"]),
    ("/completion", {"prompt": "hi", "logprobs": True}, ["'n_probs'"]),
    ("/completion", {"prompt": "hi", "n_probs": 2, "post_sampling_probs": True}, ["'post_sampling_probs' is not supported"]),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, ["'max_tokens' must be >= 1"]),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, ["'max_tokens' must be >= 1"]),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 256}, ["beyond the context size of 256"]),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, ["beyond the context size"]),
    ("/v1/completions", {"prompt": 5}, ["'prompt' must be"]),
    ("/v1/completions", {"prompt": ["a", "b"]}, ["batches"]),
    ("/v1/completions", {"prompt": [1, 99999]}, ["out of range"]),
    ("/v1/completions", {"prompt": ""}, ["empty"]),
    ("/completion", {"prompt": "hi", "n_predict": 0}, ["'n_predict' must be >= 1"]),
    ("/completion", {"prompt": "hi", "n_predict": 1000}, ["beyond the context size"]),
    ("/completion", {"prompt": "hi", "speculative.n_max": "four"}, ["speculative.n_max"]),
    ("/completion", {"prompt": "hi", "speculative.n_max": 65}, ["speculative.n_max"]),
    ("/completion", {"prompt": "hi", "speculative.p_min": 2}, ["speculative.p_min"]),
    ("/completion", {"prompt": "hi", "speculative": 3}, ["'speculative' must be an object"]),
    ("/completion", {"prompt": "hi", "speculative.type": "warp-drive"}, ["unknown spec type 'warp-drive'"]),
    ("/completion", {"prompt": "hi", "speculative": {"type": ["test-unused"]}}, ["not enabled on this server"]),
    ("/completion", {"prompt": "hi", "speculative.type": 7}, ["speculative.type"]),
    ("/tokenize", {"content": 5}, ["'content' must be a string"]),
    ("/tokenize", {}, ["'content' is required"]),
    ("/detokenize", {"tokens": ["a"]}, ["'tokens'"]),
    ("/detokenize", {"tokens": [-1]}, ["out of range"]),
    ("/apply-template", {"messages": [{"content": "x"}]}, ["role"]),
]


@aiotest
async def test_each_bad_request_gets_a_400_and_the_server_keeps_serving(model):
    async with serve(make_engine(model, speculators=[Lookup()])) as c:
        for path, body, words in BAD_REQUESTS:
            status, r = await post(c, path, body)
            err = assert_error(status, r, 400, *words)
            assert err["type"] == "invalid_request_error", (path, body)
        # a streaming request with bad input gets a plain JSON error, not a stream
        status, events = await sse(c, "/v1/chat/completions", {**CHAT, "max_tokens": 0, "stream": True})
        assert_error(status, events[0], 400, "max_tokens")
        await still_serving(c)


@aiotest
async def test_prompt_longer_than_the_context_names_the_numbers(model):
    async with serve(make_engine(model, n_ctx=32)) as c:
        long_prompt = "hello world " * 40
        for path, body in [("/v1/completions", {"prompt": long_prompt}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]}),
                           ("/completion", {"prompt": long_prompt, "stream": True})]:
            status, r = await post(c, path, body)
            err = assert_error(status, r, 400, "the context holds: 32 tokens")
            n = len(model.tokenizer.encode(long_prompt))
            assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 32
            assert err["n_prompt_tokens"] >= n and f"the prompt has {err['n_prompt_tokens']} tokens" in err["message"]
        await still_serving(c)


@aiotest
async def test_body_over_the_size_limit_is_413(model):
    async with serve(make_engine(model), max_body_size=1000) as c:
        status, r = await post(c, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 4})
        assert_error(status, r, 413, "too large")
        await still_serving(c)


@aiotest
async def test_api_key(model):
    async with serve(make_engine(model), api_keys=("sekrit", "other")) as c:
        status, r = await post(c, "/v1/chat/completions", CHAT)
        assert assert_error(status, r, 401, "missing API key")["type"] == "authentication_error"
        status, r = await post(c, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer wrong"})
        assert_error(status, r, 401, "invalid API key")
        r = await c.get("/metrics")
        assert r.status == 401
        for key in ("sekrit", "other"):
            status, r = await post(c, "/v1/chat/completions", CHAT, headers={"Authorization": f"Bearer {key}"})
            assert status == 200
        status, r = await post(c, "/tokenize", {"content": "hi"}, headers={"X-Api-Key": "sekrit"})
        assert status == 200
        assert (await c.get("/health")).status == 200 and (await c.get("/v1/models")).status == 200  # public


@aiotest
async def test_unknown_path_and_method_are_json_errors(model):
    async with serve(make_engine(model)) as c:
        r = await c.get("/v2/nothing")
        assert_error(r.status, await r.json(), 404, "/v2/nothing")
        r = await c.get("/v1/chat/completions")
        assert_error(r.status, await r.json(), 405, "GET")


@aiotest
async def test_queue_full_is_503(model):
    engine = make_engine(model, speculators=[Slow(0.02)], adaptive=False)
    async with serve(engine, n_slots=1, queue_size=1) as c:
        import asyncio

        long = {**CHAT, "max_tokens": 60}
        first = asyncio.create_task(post(c, "/v1/chat/completions", long))
        await asyncio.sleep(0.3)  # running in the only slot
        second = asyncio.create_task(post(c, "/v1/chat/completions", long))  # waits in the queue
        await asyncio.sleep(0.1)
        status, r = await post(c, "/v1/chat/completions", long)
        err = assert_error(status, r, 503, "busy")
        assert err["type"] == "unavailable_error"
        text = await (await c.get("/metrics")).text()
        assert "speculant:requests_deferred 1.0" in text and "speculant:requests_processing 1.0" in text
        assert (await first)[0] == 200 and (await second)[0] == 200
        await still_serving(c)


@aiotest
async def test_raising_speculator_fails_over_to_plain_decoding_for_its_request_only(model):
    tok = model.tokenizer
    trigger = tok.encode("zebra")[0]
    plain = make_engine(model)
    want_bad = tok.decode(list(plain.generate(tok.encode("zebra crossing"), 10)), skip_special=True)
    engine = make_engine(model, speculators=[Boom(trigger)], adaptive=False)
    import asyncio

    with structlog.testing.capture_logs() as logs:
        async with serve(engine, n_slots=2) as c:
            bad, good = await asyncio.gather(
                post(c, "/completion", {"prompt": "zebra crossing", "n_predict": 10, "temperature": 0}),
                post(c, "/completion", {"prompt": "hello world", "n_predict": 10, "temperature": 0}))
            assert bad[0] == 200 and bad[1]["content"] == want_bad and bad[1]["timings"]["draft_n"] == 0
            assert good[0] == 200 and good[1]["timings"]["draft_n"] > 0  # Boom drafts (bad) tokens for it
            await still_serving(c)
    failures = [e for e in logs if e["event"].startswith("speculator failed")]
    assert len(failures) == 1 and failures[0]["error"] == "RuntimeError: boom"


@aiotest
async def test_engine_failure_fails_its_requests_and_the_server_goes_on(model):
    engine = make_engine(model)
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = flaky_step
    async with serve(engine) as c:
        status, r = await post(c, "/v1/chat/completions", {**CHAT, "max_tokens": 10})
        assert_error(status, r, 500, "device lost")
        status, events = await sse(c, "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert not engine.sequences  # the failed request's sequence was released
        await still_serving(c)
        slots = await (await c.get("/slots")).json()
        assert not any(s["is_processing"] for s in slots)


@aiotest
async def test_per_request_speculative_fields_are_honoured(model):
    tok = model.tokenizer
    prompt = "a b a b a b a b a b"
    want = tok.decode(list(make_engine(model).generate(tok.encode(prompt), 30)), skip_special=True)
    lookup = Lookup()
    engine = make_engine(model, speculators=[lookup, Lookup("test-slow")], adaptive=False, draft_n_max=16)
    async with serve(engine) as c:
        base = {"prompt": prompt, "n_predict": 30, "temperature": 0}
        _, full = await post(c, "/completion", base)
        _, capped = await post(c, "/completion", {**base, "speculative.n_max": 2})
        _, nested = await post(c, "/completion", {**base, "speculative": {"n_max": 2, "n_min": 1, "p_min": 0.5}})
        _, off = await post(c, "/completion", {**base, "speculative.type": "none"})
        _, zero = await post(c, "/completion", {**base, "speculative.n_max": 0})
        before = lookup.proposed
        _, other = await post(c, "/completion", {**base, "speculative.type": "test-slow"})
        assert lookup.proposed == before  # only the chosen speculator drafted
        _, chat = await post(c, "/v1/chat/completions", {**CHAT, "speculative.n_max": 1, "max_tokens": 20})
    for r in (full, capped, nested, off, zero, other):
        assert r["content"] == want
    assert full["timings"]["draft_n"] > 0
    assert 0 < capped["timings"]["draft_n"] <= 2 * capped["tokens_predicted"]
    assert capped["generation_settings"]["speculative.n_max"] == 2 and full["generation_settings"]["speculative.n_max"] == 16
    assert nested["generation_settings"]["speculative.p_min"] == 0.5
    assert off["timings"]["draft_n"] == 0 and off["generation_settings"]["speculative.types"] == "none"
    assert zero["timings"]["draft_n"] == 0
    assert other["timings"]["draft_n"] > 0 and other["generation_settings"]["speculative.types"] == "test-slow"
    assert chat["timings"]["draft_n"] <= chat["usage"]["completion_tokens"]
    assert full["generation_settings"]["speculative.types"] == "test-lookup,test-slow"
