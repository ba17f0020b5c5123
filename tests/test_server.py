"""`speculant serve` endpoints on a tiny model, through aiohttp's test client on a real socket."""
import asyncio
import json

import pytest

from speculant.sampling import SamplingParams
from speculant_server.text import StopMatcher

from test_server_util import Lookup, aiotest, chat_text, make_engine, post, serve, sse, tiny_model

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


def reference(model, prompt_ids, n, n_ctx=256):
    """Greedy tokens and text straight from the engine."""
    ids = list(make_engine(model, n_ctx).generate(prompt_ids, n, SamplingParams()))
    return ids, model.tokenizer.decode([t for t in ids if t not in model.tokenizer.eog_ids], skip_special=True)


def chat_ids(model, messages):
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


# --- the read-only endpoints -------------------------------------------------------------------------
@aiotest
async def test_health_models_props_slots(model):
    async with serve(make_engine(model), n_slots=2, alias="tiny") as c:
        r = await c.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok"}
        r = await c.get("/v1/models")
        data = await r.json()
        assert data["object"] == "list" and data["data"][0]["id"] == "tiny" and data["data"][0]["meta"]["n_vocab"] == 512
        props = await (await c.get("/props")).json()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 256
        assert "<|im_start|>" in props["chat_template"] and props["speculative"]["types"] == []
        slots = await (await c.get("/slots")).json()
        assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)


@aiotest
async def test_metrics_names_and_spec_counters(model):
    engine = make_engine(model, speculators=[Lookup()], adaptive=False)
    async with serve(engine) as c:
        text = await (await c.get("/metrics")).text()
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total"):
            assert f'speculant:{name}{{spec_type="test-lookup"}} 0.0' in text  # exported before any use
        status, body = await post(c, "/completion", {"prompt": "a b a b a b a b", "n_predict": 30, "temperature": 0})
        assert status == 200 and body["timings"]["draft_n"] > 0
        r = await c.get("/metrics")
        assert r.headers["Content-Type"].startswith("text/plain")
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in (await r.text()).splitlines() if line and not line.startswith("#")}
        t = body["timings"]
        assert samples['speculant:spec_decode_num_draft_tokens_total{spec_type="test-lookup"}'] == t["draft_n"]
        assert samples['speculant:spec_decode_num_accepted_tokens_total{spec_type="test-lookup"}'] == t["draft_n_accepted"]
        assert samples['speculant:spec_decode_num_drafts_total{spec_type="test-lookup"}'] == t["draft_rounds"] >= 1
        assert t["draft_ms"] > 0
        per_pos = [v for k, v in samples.items() if k.startswith("speculant:spec_decode_num_accepted_tokens_per_pos_total")]
        assert sum(per_pos) == t["draft_n_accepted"]
        assert samples["speculant:tokens_predicted_total"] == 30 and samples["speculant:requests_finished_total"] == 1
        assert samples["speculant:prompt_tokens_total"] == body["tokens_evaluated"]


# --- generation ------------------------------------------------------------------------------------------
@aiotest
async def test_chat_completion_equals_the_engine(model):
    ids, text = reference(model, chat_ids(model, CHAT["messages"]), 12)
    async with serve(make_engine(model)) as c:
        status, body = await post(c, "/v1/chat/completions", CHAT)
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(chat_ids(model, CHAT["messages"])), "completion_tokens": 12,
                             "total_tokens": len(chat_ids(model, CHAT["messages"])) + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a fresh server has nothing cached
    t = body["timings"]
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n",
            "draft_n_accepted"} <= set(t)
    assert t["predicted_n"] == 12 and t["prompt_n"] == body["usage"]["prompt_tokens"] and t["draft_n"] == 0


@aiotest
async def test_chat_stream_sse_shape(model):
    async with serve(make_engine(model)) as c:
        _, whole = await post(c, "/v1/chat/completions", CHAT)
        status, events = await sse(c, "/v1/chat/completions", {**CHAT, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        _, no_usage = await sse(c, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == chunks[0]["id"] for e in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat_text(chunks) == whole["choices"][0]["message"]["content"]
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert final["timings"]["predicted_n"] == 12
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    # the same prompt again: all of it but its last token comes from the first request's state
    n_prompt = whole["usage"]["prompt_tokens"]
    assert usage["choices"] == [] and usage["usage"] == {**whole["usage"], "prompt_tokens_details": {"cached_tokens": n_prompt - 1}}
    assert no_usage[-1] == "[DONE]" and all("usage" not in e for e in no_usage[:-1])
    assert no_usage[-2]["choices"][0]["finish_reason"] == "length"


@aiotest
async def test_completions_text_tokens_and_stream(model):
    tok = model.tokenizer
    prompt = "def add(a, b):"
    ids, text = reference(model, tok.encode(prompt), 10)
    async with serve(make_engine(model)) as c:
        status, body = await post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 10
        status, by_ids = await post(c, "/v1/completions", {"prompt": tok.encode(prompt), "max_tokens": 10, "temperature": 0})
        assert by_ids["choices"][0]["text"] == text
        status, events = await sse(c, "/v1/completions", {"prompt": [prompt], "max_tokens": 10, "temperature": 0,
                                                         "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 10
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == text
    assert events[-3]["choices"][0]["finish_reason"] == "length"


@aiotest
async def test_llama_completion_shape(model):
    tok = model.tokenizer
    prompt = "class Model:"
    _, text = reference(model, tok.encode(prompt), 8)
    async with serve(make_engine(model)) as c:
        status, body = await post(c, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "top_k": 1})
        assert status == 200
        assert body["content"] == text and body["stop"] is True and body["stop_type"] == "limit"
        assert body["tokens_predicted"] == 8 and body["tokens_evaluated"] == len(tok.encode(prompt))
        assert body["generation_settings"]["n_predict"] == 8 and body["generation_settings"]["top_k"] == 1
        assert body["timings"]["predicted_n"] == 8 and body["id_slot"] == 0
        status, events = await sse(c, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "stream": True})
    assert "[DONE]" not in events  # llama-server's /completion stream has no end marker
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == text
    assert events[-1]["timings"]["predicted_n"] == 8 and events[-1]["stop_type"] == "limit"


@aiotest
async def test_stop_strings_cut_the_text_and_end_generation(model):
    tok = model.tokenizer
    prompt = "def add(a, b):"
    _, text = reference(model, tok.encode(prompt), 40)
    stop = text[10:13]
    assert len(stop) == 3 and text.find(stop) >= 3
    want = text[: text.find(stop)]
    async with serve(make_engine(model)) as c:
        _, body = await post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                    "stop": ["\x00never", stop]})
        assert body["choices"][0]["text"] == want and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] < 40
        _, events = await sse(c, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop,
                                                    "stream": True})
        assert "".join(ch["text"] for e in events[:-1] for ch in e["choices"]) == want
        _, llama = await post(c, "/completion", {"prompt": prompt, "n_predict": 40, "temperature": 0, "stop": [stop]})
        assert llama["content"] == want and llama["stop_type"] == "word" and llama["stopping_word"] == stop
        slots = await (await c.get("/slots")).json()
        assert not any(s["is_processing"] for s in slots)


def test_stop_matcher_holds_back_possible_prefixes():
    m = StopMatcher(["</end>", "xyz"])
    assert m.push("hello <") == ("hello ", None)
    assert m.push("/e") == ("", None)
    assert m.push("nx") == ("</en", None)  # "x" may begin "xyz"
    assert m.push("x") == ("x", None)
    assert m.push("y") == ("", None)
    assert m.push("zzz") == ("", "xyz")
    m = StopMatcher(["ab"])
    assert m.push("a") == ("", None)
    assert m.flush() == "a"
    assert StopMatcher([]).push("abc") == ("abc", None)
    assert StopMatcher(["b", "abc"]).push("xabc") == ("x", "abc")  # the stop string that begins first wins


@aiotest
async def test_generation_reaching_the_context_end_stops_with_length(model):
    n_ctx = 40
    async with serve(make_engine(model, n_ctx=n_ctx)) as c:
        body = {"messages": CHAT["messages"], "temperature": 0}
        status, r = await post(c, "/v1/chat/completions", body)  # no max_tokens: until the context is full
        assert status == 200 and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["total_tokens"] == n_ctx
        status, r = await post(c, "/v1/chat/completions", {**body, "max_tokens": n_ctx - 1})  # fits the context, not the prompt
        assert status == 200 and r["usage"]["total_tokens"] == n_ctx and r["choices"][0]["finish_reason"] == "length"
        status, r = await post(c, "/completion", {"prompt": "hi", "n_predict": -1, "temperature": 0})
        assert status == 200 and r["tokens_predicted"] + r["tokens_evaluated"] == n_ctx and r["stop_type"] == "limit"
        assert (await c.get("/health")).status == 200


@aiotest
async def test_sampling_with_seed_is_reproducible(model):
    body = {**CHAT, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 16}
    async with serve(make_engine(model)) as c:
        outs = [(await post(c, "/v1/chat/completions", {**body, "seed": s}))[1]["choices"][0]["message"]["content"]
                for s in (1, 1, 2)]
    assert outs[0] == outs[1] and outs[0] != outs[2]


# --- tokenizer endpoints --------------------------------------------------------------------------------
@aiotest
async def test_tokenize_detokenize_apply_template(model):
    tok = model.tokenizer
    async with serve(make_engine(model)) as c:
        status, r = await post(c, "/tokenize", {"content": "hello world"})
        assert status == 200 and r["tokens"] == tok.encode("hello world") and r["tokens"]
        _, r2 = await post(c, "/detokenize", {"tokens": r["tokens"]})
        assert r2 == {"content": "hello world"}
        _, special = await post(c, "/tokenize", {"content": "<|im_start|>", "parse_special": True})
        assert special["tokens"] == [tok.encode("<|im_start|>")[0]] and len(special["tokens"]) == 1
        _, plain = await post(c, "/tokenize", {"content": "<|im_start|>", "parse_special": False})
        assert len(plain["tokens"]) > 1
        _, pieces = await post(c, "/tokenize", {"content": "hello", "with_pieces": True})
        assert "".join(p["piece"] for p in pieces["tokens"]) == "hello"
        _, tmpl = await post(c, "/apply-template", {"messages": CHAT["messages"]})
        assert tmpl["prompt"] == tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True)
        assert tmpl["prompt"].endswith("<|im_start|>assistant\n")
