"""logprobs / top_logprobs / n_probs and n > 1 through the server, on the tiny model."""
import math

import pytest

from speculant.sampling import SamplingParams

from test_server_util import Lookup, aiotest, assert_error, chat_text, make_engine, post, serve, sse, tiny_model

PROMPT = "a b a b a b a b a b"  # repetitive: the lookup speculator's drafts are accepted
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 60, "temperature": 0}  # drafts accepted


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


def engine_logprobs(model, prompt_ids, n, k, params=SamplingParams()):
    """Plain decoding's tokens and TokenLogprobs, straight from the engine."""
    engine = make_engine(model)
    seq = engine.add(prompt_ids, n, params, logprobs=k)
    while engine.active():
        engine.step()
    return seq.tokens[seq.n_prompt:], seq.logprobs


def token_text(model, t):
    return model.tokenizer.token_bytes(t, True).decode("utf-8", "replace")


def chat_ids(model, messages):
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


@aiotest
async def test_chat_logprobs_with_speculation_equal_plain_decoding(model):
    ids, want = engine_logprobs(model, chat_ids(model, CHAT["messages"]), 60, 3)
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False)) as c:
        status, body = await post(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
        assert status == 200, body
        assert body["timings"]["draft_n_accepted"] > 0  # the logprobs below came through verification rows
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"] == len(want)
        for entry, w in zip(content, want):
            assert entry["logprob"] == w.logprob
            assert entry["token"] == token_text(model, w.token)
            assert bytes(entry["bytes"]) == model.tokenizer.token_bytes(w.token, True)
            assert [t["logprob"] for t in entry["top_logprobs"]] == [lp for _, lp in w.top]
            assert [t["token"] for t in entry["top_logprobs"]] == [token_text(model, t) for t, _ in w.top]
            # greedy: the chosen token is the most likely one
            assert math.exp(entry["logprob"]) == pytest.approx(max(math.exp(t["logprob"]) for t in entry["top_logprobs"]))

        # streaming: each chunk carries its tokens' logprobs; together they are the whole list
        status, events = await sse(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3, "stream": True})
        assert status == 200
        streamed = [e for ev in events if isinstance(ev, dict) for ch in ev.get("choices", [])
                    for e in ((ch.get("logprobs") or {}).get("content") or [])]
        assert streamed == content
        assert chat_text(events) == body["choices"][0]["message"]["content"]

        # without logprobs: null, as before
        status, body = await post(c, "/v1/chat/completions", CHAT)
        assert body["choices"][0]["logprobs"] is None
        status, body = await post(c, "/v1/chat/completions", {**CHAT, "logprobs": True})
        assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])


@aiotest
async def test_completions_legacy_logprobs(model):
    prompt_ids = model.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    ids, want = engine_logprobs(model, prompt_ids, 16, 2)
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False)) as c:
        body_in = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2}
        status, body = await post(c, "/v1/completions", body_in)
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert lp["tokens"] == [token_text(model, w.token) for w in want]
        assert lp["token_logprobs"] == [w.logprob for w in want]
        for top, w in zip(lp["top_logprobs"], want):
            assert top[token_text(model, w.token)] == w.logprob  # the chosen token is always there
            assert len(top) <= 3 and max(top.values()) == w.top[0][1]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        status, events = await sse(c, "/v1/completions", {**body_in, "stream": True})
        chunks = [ch["logprobs"] for ev in events if isinstance(ev, dict) for ch in ev.get("choices", []) if ch.get("logprobs")]
        assert sum((x["token_logprobs"] for x in chunks), []) == lp["token_logprobs"]
        assert sum((x["text_offset"] for x in chunks), []) == lp["text_offset"]


@aiotest
async def test_llama_completion_n_probs(model):
    prompt_ids = model.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    ids, want = engine_logprobs(model, prompt_ids, 12, 4)
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False)) as c:
        status, body = await post(c, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 4})
        assert status == 200, body
        probs = body["completion_probabilities"]
        assert [p["id"] for p in probs] == ids
        for p, w in zip(probs, want):
            assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and p["logprob"] == w.logprob
            assert [(t["id"], t["logprob"]) for t in p["top_logprobs"]] == list(w.top)
            assert all(set(t) == {"id", "token", "bytes", "logprob"} for t in p["top_logprobs"])
        status, events = await sse(c, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "n_probs": 4,
                                                      "stream": True})
        assert sum((e.get("completion_probabilities", []) for e in events), []) == probs
        status, body = await post(c, "/completion", {"prompt": PROMPT, "n_predict": 4, "n_probs": 0})
        assert "completion_probabilities" not in body


# --- n > 1 ---------------------------------------------------------------------------------------------
@aiotest
async def test_n_choices(model):
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False), n_slots=4) as c:
        one = (await post(c, "/v1/chat/completions", CHAT))[1]
        status, body = await post(c, "/v1/chat/completions", {**CHAT, "n": 3})
        assert status == 200, body
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        # greedy: every choice is the n = 1 answer
        assert all(ch["message"] == one["choices"][0]["message"] for ch in body["choices"])
        u = body["usage"]
        assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
        assert u["completion_tokens"] == 3 * one["usage"]["completion_tokens"]

        # sampled with a seed: choice i is what seed + i gives alone
        sampled = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                   "cache_prompt": False}
        status, body = await post(c, "/v1/completions", {**sampled, "n": 3, "seed": 40, "logprobs": 1})
        assert status == 200, body
        for i, ch in enumerate(body["choices"]):
            alone = (await post(c, "/v1/completions", {**sampled, "seed": 40 + i, "logprobs": 1}))[1]["choices"][0]
            assert (ch["text"], ch["logprobs"]) == (alone["text"], alone["logprobs"]) and ch["index"] == i
        assert len({ch["text"] for ch in body["choices"]}) > 1

        # streaming: chunks of every index, each choice finished once, usage once at the end
        status, events = await sse(c, "/v1/chat/completions", {**CHAT, "n": 2, "stream": True,
                                                                "stream_options": {"include_usage": True}})
        assert status == 200 and events[-1] == "[DONE]"
        per_index = {0: "", 1: ""}
        finished = []
        for ev in events[:-1]:
            for ch in ev["choices"]:
                per_index[ch["index"]] += ch["delta"].get("content") or ""
                if ch["finish_reason"]:
                    finished.append(ch["index"])
        assert sorted(finished) == [0, 1] and per_index[0] == per_index[1] == one["choices"][0]["message"]["content"]
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]

        # more choices than slots: refused; the server goes on
        status, body = await post(c, "/v1/chat/completions", {**CHAT, "n": 5})
        assert_error(status, body, 400, "slots")
        assert (await post(c, "/v1/chat/completions", CHAT))[0] == 200
        slots = await (await c.get("/slots")).json()
        assert not any(s["is_processing"] for s in slots)


@aiotest
async def test_n_choices_prefill_the_prompt_once(model):
    engine = make_engine(model)
    rows = []
    real = model.forward

    def counting(batch, ctx, hidden_layers=()):
        rows.append(len(batch))
        return real(batch, ctx, hidden_layers)

    long_prompt = " ".join(f"w{i}" for i in range(60))
    n_prompt = len(model.tokenizer.encode(long_prompt, add_special=True, parse_special=True))
    model.forward = counting
    try:
        async with serve(engine, n_slots=3) as c:
            status, body = await post(c, "/v1/completions", {"prompt": long_prompt, "max_tokens": 3, "n": 3, "temperature": 0})
    finally:
        del model.forward
    assert status == 200, body
    # the prompt once, then the last prompt token of each other choice, then one row per choice per token
    assert sum(rows) == n_prompt + 2 + 3 * 2
    assert len({ch["text"] for ch in body["choices"]}) == 1


@aiotest
async def test_n_choices_wait_for_enough_free_slots(model):
    from test_server_util import Slow

    engine = make_engine(model, speculators=[Slow(0.01)], adaptive=False)
    async with serve(engine, n_slots=2) as c:
        import asyncio

        busy = asyncio.ensure_future(post(c, "/v1/chat/completions", {**CHAT, "max_tokens": 30}))
        await asyncio.sleep(0.1)
        status, body = await post(c, "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 4})
        assert status == 200 and len(body["choices"]) == 2
        assert (await busy)[0] == 200
