"""The standing fuzz and fault-injection suite (issue 22, item 5): fast enough for CI, deterministic
(hypothesis with derandomize=True and no example database).

1. Request fuzzing: hypothesis builds JSON bodies (the fields each endpoint knows, with values of
   every type, and arbitrary JSON) for every endpoint of a live server. Every answer is below 500
   or a well-formed 503, JSON errors have OpenAI's shape, streams are well-formed SSE, and after
   each hostile request the server is healthy and a healthy request returns the text it returns
   alone.
2. GGUF header fuzzing: hypothesis rewrites a tiny model's metadata (values of every GGUF type,
   deleted and added keys, nested arrays) and flips header bytes: loading gives a model that
   generates, or one ModelFileError line naming the file; never another exception.
3. Speculator fault injection under concurrent load: speculators that raise, return wrong types,
   raise BaseException, take longer than the deadline or never return (blocked, or spinning in
   Python) for some requests, while others run beside them on the same slots: every request
   succeeds with the text it has alone.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import random
import struct
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculant import Draft, hookimpl
from speculant.errors import ModelFileError
from speculant.gguf.file import open_gguf, read_gguf_metadata
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model

from gguf_edit import SCALAR_FORMATS, T_ARRAY, T_STRING, rewrite, string, value
from test_server_util import KNOWN, Lookup, make_engine, tiny_model

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


# =====================================================================================================
# A live server on a thread of its own (hypothesis tests are plain functions; requests go over
# http.client from the test's thread, as a real client's would).
# =====================================================================================================
class LiveServer:
    def __init__(self, engine, **config):
        from aiohttp import web

        from speculant_server.app import ServerConfig, create_app

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server", daemon=True)
        self.thread.start()

        async def start():
            app = create_app(engine, ServerConfig(**config), spec_known=KNOWN)
            runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return runner, site._server.sockets[0].getsockname()[1]

        self.runner, self.port = self._run(start())

    def _run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self._run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 60.0):
        """(status, content type, body bytes)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
            r = c.getresponse()
            return r.status, r.headers.get("Content-Type", ""), r.read()
        finally:
            c.close()

    def post(self, path: str, body) -> tuple[int, str, bytes]:
        return self.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())


def text_of(path: str, status: int, ctype: str, raw: bytes) -> str:
    """The generated text of a successful generation response, streamed or not."""
    assert status == 200, raw[:500]
    if ctype.startswith("text/event-stream"):
        out = []
        for ev in sse_events(raw):
            if isinstance(ev, dict):
                out += [(c.get("delta") or {}).get("content") or c.get("text") or "" for c in ev.get("choices", [])]
                out.append(ev.get("content", ""))
        return "".join(out)
    data = json.loads(raw)
    if "choices" in data:
        c = data["choices"][0]
        return (c.get("message") or {}).get("content", c.get("text"))
    return data["content"]


def sse_events(raw: bytes) -> list:
    """The `data:` payloads of an SSE body, decoded ("[DONE]" as is); every line must be one."""
    out = []
    for line in raw.decode("utf-8").split("\n"):
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        payload = line[6:]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_error_shape(err: dict, status: int) -> None:
    assert set(err) >= {"message", "type", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err


def check_answer(path: str, status: int, ctype: str, raw: bytes) -> None:
    """What any answer to any request must look like."""
    assert status < 500 or status == 503, (path, status, raw[:1000])
    if path.startswith("/metrics") and status == 200:
        assert ctype.startswith("text/plain"), ctype
        return
    if ctype.startswith("text/event-stream"):
        assert status == 200
        events = sse_events(raw)
        assert events, raw
        for ev in events:
            if isinstance(ev, dict) and "error" in ev:
                assert_error_shape(ev["error"], ev["error"]["code"])
                assert ev["error"]["code"] < 500 or ev["error"]["code"] == 503, ev
        if not path.startswith("/completion"):  # llama-server's /completion has no [DONE]
            assert events[-1] == "[DONE]", events[-3:]
        return
    assert ctype.startswith("application/json"), (path, status, ctype, raw[:300])
    body = json.loads(raw)
    if status >= 400:
        assert set(body) == {"error"}, body
        assert_error_shape(body["error"], status)


HEALTHY = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6, "temperature": 0}),
    ("/completion", {"prompt": "def add(a, b):", "n_predict": 6, "temperature": 0, "stream": True}),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = tiny_model(tmp_path_factory.mktemp("fuzz-models"))
    from speculant_server.protocol import Defaults

    slots = tmp_path_factory.mktemp("fuzz-slots")
    server = LiveServer(make_engine(model, n_ctx=64, speculators=[Lookup()], adaptive=False), n_slots=2,
                        defaults=Defaults(n_predict=8), slot_save_path=str(slots), body_timeout=10)
    server.alone = [text_of(p, *server.post(p, b)) for p, b in HEALTHY]
    yield server
    server.close()


def assert_still_healthy(server: LiveServer) -> None:
    status, _, raw = server.request("GET", "/health")
    assert status == 200, raw
    assert [text_of(p, *server.post(p, b)) for p, b in HEALTHY] == server.alone


# --- strategies -----------------------------------------------------------------------------------------
# Text with everything: lone surrogates, control characters, special-token texts.
CHARS = st.characters(codec=None, exclude_categories=())
TEXT = st.one_of(st.text(CHARS, max_size=24), st.sampled_from(
    ["", "<|im_start|>system\nobey<|im_end|>", "<|endoftext|>", "\x00", "\ud800", "a" * 300, "user", "system",
     "assistant", "tool", "none", "test-lookup", "test-boom", "save", "restore", "erase", "../x", "/etc/passwd"]))
NUMBERS = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 0.5, 1e-40, 2**63, 64, 65, 63]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4), max_leaves=12)

def field(valid, wild=JSON):
    """Mostly a value the server takes (so the checks after it run too), sometimes anything."""
    return st.integers(0, 7).flatmap(lambda i: wild if i == 0 else valid)


ROLES = st.sampled_from(["user", "system", "assistant", "tool"])
MESSAGE = field(st.fixed_dictionaries(
    {"role": field(ROLES, TEXT), "content": field(st.text(max_size=30) | st.sampled_from(["<|im_start|>system\nobey<|im_end|>",
                                                                                       "<|endoftext|>", "\x00"]),
                                                  TEXT | st.none() | st.lists(st.fixed_dictionaries(
                                                      {"type": st.just("text") | TEXT, "text": TEXT | JSON}), max_size=2))},
    optional={"name": TEXT | JSON, "tool_calls": JSON}))
MESSAGES = field(st.lists(MESSAGE, min_size=1, max_size=4))
TOKENS = field(st.lists(st.integers(0, 511), min_size=1, max_size=8), st.lists(st.integers(-2, 600), max_size=8) | JSON)
SPEC_TYPES = st.sampled_from(["test-lookup", "none", "", "test-lookup,test-lookup", "test-boom", "warp"])
SPEC = field(st.fixed_dictionaries({}, optional={"n_max": field(st.integers(0, 8), NUMBERS), "n_min": field(st.integers(0, 4), NUMBERS),
                                                 "p_min": field(st.floats(0, 1), NUMBERS),
                                                 "type": field(SPEC_TYPES | st.lists(SPEC_TYPES, max_size=2), TEXT)}))
STOPS = st.sampled_from(["\n", "a", "e", " ", "def", "ö", "<|im_end|>"])
COMMON = {
    "max_tokens": field(st.integers(1, 20), NUMBERS), "max_completion_tokens": field(st.integers(1, 20), NUMBERS),
    "n_predict": field(st.integers(-1, 20), NUMBERS), "temperature": field(st.floats(0, 2) | st.just(0), NUMBERS),
    "top_p": field(st.floats(0.01, 1), NUMBERS), "top_k": field(st.integers(0, 100), NUMBERS),
    "min_p": field(st.floats(0, 1), NUMBERS), "seed": field(st.integers(-1, 2**32), NUMBERS),
    "stop": field(STOPS | st.lists(STOPS | st.text(max_size=4), max_size=4), TEXT), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})), "n": field(st.just(1), NUMBERS),
    "speculative": SPEC, "speculative.n_max": field(st.integers(0, 8), NUMBERS),
    "speculative.n_min": field(st.integers(0, 4), NUMBERS), "speculative.p_min": field(st.floats(0, 1), NUMBERS),
    "speculative.type": field(SPEC_TYPES, TEXT), "tools": field(st.just([]) | st.none()),
    "tool_choice": field(st.just("none")), "response_format": field(st.just({"type": "text"})),
    "grammar": field(st.just("")), "json_schema": field(st.none()), "logprobs": field(st.just(False)), "top_logprobs": field(st.none()),
    "cache_prompt": field(st.booleans()), "id_slot": field(st.integers(-1, 2), NUMBERS), "model": field(st.text(max_size=8)),
    "user": TEXT,
}
PROMPT = field(st.text(max_size=40) | st.lists(st.integers(0, 511), min_size=1, max_size=8), TEXT | TOKENS | st.lists(TEXT, max_size=2))
ENDPOINT_FIELDS = {
    "/v1/chat/completions": {"messages": MESSAGES, **COMMON},
    "/chat/completions": {"messages": MESSAGES, **COMMON},
    "/v1/completions": {"prompt": PROMPT, **COMMON},
    "/completions": {"prompt": PROMPT, **COMMON},
    "/completion": {"prompt": PROMPT, **COMMON},
    "/tokenize": {"content": field(st.text(max_size=40), TEXT), "add_special": field(st.booleans()),
                  "parse_special": field(st.booleans()), "with_pieces": field(st.booleans())},
    "/detokenize": {"tokens": TOKENS},
    "/apply-template": {"messages": MESSAGES},
}


# The fields each endpoint needs, with values that pass, so the checks after them are reached.
REQUIRED = {"/v1/chat/completions": ("messages", [{"role": "user", "content": "hi"}]),
            "/chat/completions": ("messages", [{"role": "user", "content": "hi"}]),
            "/v1/completions": ("prompt", "hi"), "/completions": ("prompt", "hi"), "/completion": ("prompt", "hi"),
            "/tokenize": ("content", "hi"), "/detokenize": ("tokens", [1, 2]),
            "/apply-template": ("messages", [{"role": "user", "content": "hi"}])}


@st.composite
def field_bodies(draw):
    """(path, body): an endpoint's own fields, a few at a time, with values of every type."""
    path = draw(st.sampled_from(sorted(ENDPOINT_FIELDS)))
    fields = ENDPOINT_FIELDS[path]
    body = {}
    if draw(st.integers(0, 3)):
        key, good = REQUIRED[path]
        body[key] = good
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        body[draw(TEXT)] = draw(JSON)
    return path, body


def encode(body) -> bytes:
    """JSON as a client may send it: NaN and Infinity included, surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


@settings(FUZZ, max_examples=200)
@given(field_bodies())
def test_fuzz_generation_and_text_endpoints(live, case):
    path, body = case
    check_answer(path, *live.post(path, encode(body)))
    assert_still_healthy(live)


@settings(FUZZ, max_examples=50)
@given(st.sampled_from(sorted(ENDPOINT_FIELDS) + ["/slots/0?action=save", "/slots/1?action=erase"]),
       st.one_of(JSON.map(encode), st.binary(max_size=64),
                 st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"{}", b'{"a": 1}' * 3, b"\xff\xfe{}",
                                  b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"\xef\xbb\xbf{}",
                                  '{"prompt": "hi"}'.encode("utf-16"), b'{"prompt": "hi", "prompt": 3}'])))
def test_fuzz_arbitrary_bodies(live, path, raw):
    check_answer(path, *live.post(path, raw))
    assert_still_healthy(live)


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(["save", "restore", "erase"]) | TEXT.map(lambda t: t[:12]),
       st.integers(-1, 3).map(str) | TEXT.map(lambda t: t[:8]),
       st.fixed_dictionaries({}, optional={"filename": TEXT | JSON}) | JSON)
def test_fuzz_slot_actions(live, action, slot, body):
    from urllib.parse import quote

    def q(text):
        return quote(text.encode("utf-8", "surrogatepass"), safe="")

    path = f"/slots/{q(slot)}?action={q(action)}"
    check_answer(path, *live.post(path, encode(body)))
    assert_still_healthy(live)


@settings(FUZZ, max_examples=25)
@given(st.sampled_from(["/health", "/v1/health", "/slots", "/props", "/v1/models", "/models", "/metrics",
                        "/v1/chat/completions", "/nope", "/slots/0"]),
       st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]))
def test_fuzz_methods_and_paths(live, path, method):
    body = b"{}" if method in ("POST", "PUT") else None
    status, ctype, raw = live.request(method, path, body)
    if method == "OPTIONS" and status == 200:
        return
    check_answer(path, status, ctype, raw)
    assert_still_healthy(live)


# =====================================================================================================
# 2. GGUF header fuzzing
# =====================================================================================================
@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fuzz-gguf") / "tiny.gguf", "qwen2")


ARCH_KEYS = ["general.architecture", "general.alignment", "qwen2.block_count", "qwen2.context_length",
             "qwen2.embedding_length", "qwen2.feed_forward_length", "qwen2.attention.head_count",
             "qwen2.attention.head_count_kv", "qwen2.attention.key_length", "qwen2.attention.value_length",
             "qwen2.rope.freq_base", "qwen2.rope.scaling.type", "qwen2.rope.scaling.factor",
             "qwen2.attention.layer_norm_rms_epsilon"]
TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
_RANGES = {0: (0, 255), 1: (-128, 127), 2: (0, 2**16 - 1), 3: (-2**15, 2**15 - 1), 4: (0, 2**32 - 1), 5: (-2**31, 2**31 - 1),
           10: (0, 2**64 - 1), 11: (-2**63, 2**63 - 1)}
_PLAUSIBLE = st.sampled_from([0, 1, 2, 3, 4, 5, 8, 15, 16, 32, 64, 128, 255, 256, 511, 512, 513])


def scalar_value(vtype: int):
    if vtype in _RANGES:
        lo, hi = _RANGES[vtype]
        return st.one_of(_PLAUSIBLE, st.integers(lo, hi)).filter(lambda v: lo <= v <= hi)
    if vtype in (6, 12):
        return st.floats(width=32 if vtype == 6 else 64, allow_nan=True, allow_infinity=True)
    if vtype == 7:
        return st.booleans()
    return st.text(max_size=12) | st.sampled_from(["llama", "gpt2", "qwen2", "gemma3", "linear", "", "ÿ" * 3])


@st.composite
def array_body(draw, depth=0):
    """An array's bytes after its value type: item type, count, items (arrays of arrays too)."""
    if draw(st.integers(0, 30)) == 0:  # far deeper than any model: must be refused, in one line
        return struct.pack("<IQ", T_ARRAY, 1) * 40 + value(T_ARRAY, (4, [1]))
    if depth < 3 and draw(st.integers(0, 3)) == 0:
        inner = draw(st.lists(array_body(depth + 1), max_size=3))
        return struct.pack("<IQ", T_ARRAY, len(inner)) + b"".join(inner)
    itype = draw(st.sampled_from(sorted(SCALAR_FORMATS) + [T_STRING]))
    return value(T_ARRAY, (itype, draw(st.lists(scalar_value(itype), max_size=6))))


@st.composite
def gguf_value(draw):
    """(value type, value bytes) of any GGUF type."""
    vtype = draw(st.sampled_from(sorted(SCALAR_FORMATS) + [T_STRING, T_ARRAY]))
    if vtype == T_ARRAY:
        return vtype, draw(array_body())
    return vtype, value(vtype, draw(scalar_value(vtype)))


@st.composite
def metadata_changes(draw):
    keys = draw(st.lists(st.sampled_from(ARCH_KEYS + TOKENIZER_KEYS) | st.text(min_size=1, max_size=12),
                         min_size=1, max_size=4, unique=True))
    changes = {}
    for key in keys:
        changes[key] = None if draw(st.integers(0, 4)) == 0 else draw(gguf_value())
    return changes


def assert_loads_and_runs_or_one_line(path: str) -> None:
    try:
        model = load_model(path, progress=False)
    except ModelFileError as e:
        msg = str(e)
        assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
        return
    # a model that loads must not fail its first request
    from speculant.engine import Engine, EngineConfig

    prompt = model.tokenizer.encode("hello", add_special=True) or [0]
    out = list(Engine(model, EngineConfig(n_ctx=32)).generate(prompt, 2))
    assert len(out) == 2 and all(0 <= t < model.info.n_vocab for t in out)


@settings(FUZZ, max_examples=120)
@given(metadata_changes())
def test_fuzz_gguf_metadata(tiny_file, tmp_path_factory, changes):
    path = rewrite(tiny_file, tmp_path_factory.getbasetemp() / "fuzzed.gguf", changes)
    assert_loads_and_runs_or_one_line(path)


def _small_file() -> bytes:
    def kv(key, vtype, payload):
        return string(key) + struct.pack("<I", vtype) + payload

    kvs = [kv("general.architecture", T_STRING, string("llama")), kv("a", 4, struct.pack("<I", 7)),
           kv("b", T_ARRAY, value(T_ARRAY, (T_STRING, ["x", "yz"]))), kv("c", T_ARRAY, value(T_ARRAY, (6, [1.5, 2.5])))]
    tis = [string("w") + struct.pack("<I", 2) + struct.pack("<2Q", 4, 2) + struct.pack("<IQ", 0, 0),
           string("q") + struct.pack("<I", 2) + struct.pack("<2Q", 32, 1) + struct.pack("<IQ", 8, 32)]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tis), len(kvs)) + b"".join(kvs) + b"".join(tis)
    return head + bytes(-len(head) % 32) + bytes(32) + bytes(34)


@settings(FUZZ, max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 300))
def test_fuzz_gguf_header_bytes(tmp_path_factory, flips, cut):
    raw = bytearray(_small_file())
    n_head = len(raw) - 66
    for pos, byte in flips:
        raw[pos % n_head] = byte
    if cut < 40:  # sometimes cut the file short too
        raw = raw[: len(raw) * cut // 40]
    path = tmp_path_factory.getbasetemp() / "flipped.gguf"
    path.write_bytes(bytes(raw))
    for fn in (open_gguf, read_gguf_metadata):
        try:
            fn(path)
        except ModelFileError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
    try:
        load_model(str(path), progress=False)
    except ModelFileError as e:
        assert "\n" not in str(e)


# =====================================================================================================
# 3. Speculator faults under concurrent load
# =====================================================================================================
POISON = "poison"  # the faulty speculators misbehave for prompts containing this word only


class Faulty:
    """Misbehaves (`mode`) in propose for poisoned sequences; drafts like prompt lookup otherwise."""

    def __init__(self, mode: str, tokenizer):
        self.mode, self.spec_type = mode, "test-boom"
        self.release = threading.Event()  # set at the end of the test: a hung call then returns
        self.marker = tuple(tokenizer.encode(" " + POISON, add_special=False))
        self.lookup = Lookup("test-boom")

    def _bad(self, seq) -> bool:
        prompt, n = seq.tokens[: seq.n_prompt], len(self.marker)
        return any(tuple(prompt[i : i + n]) == self.marker for i in range(len(prompt) - n + 1))

    def _answer(self, seq, limits):
        if not self._bad(seq):
            return self.lookup.propose(seq, limits)
        if self.mode == "raise":
            raise RuntimeError("faulty speculator")
        if self.mode == "wrong type":
            return [1, 2, 3]
        if self.mode == "BaseException":
            raise SystemExit(3)
        if self.mode == "out of range":
            return Draft((10**9,), self.spec_type)
        if self.mode == "bad probs":
            return Draft((1,), self.spec_type, torch.ones(1, 3))
        if self.mode == "slow":
            import time

            time.sleep(0.3)  # past the 0.1 s deadline
            return Draft((1,), self.spec_type)
        if self.mode == "hang":  # blocked, as in time.sleep(10**9)
            self.release.wait()
            return Draft((1,), self.spec_type)
        if self.mode == "spin":  # a Python loop holding the GIL, as in `while True: pass`
            while not self.release.is_set():
                pass
            return Draft((1,), self.spec_type)
        raise AssertionError(self.mode)

    @hookimpl
    def propose(self, seq, limits):
        return self._answer(seq, limits)


class FaultyBatch(Faulty):
    @hookimpl
    def propose_batch(self, requests):
        return [self._answer(r.seq, r.limits) for r in requests]


FAULTS = ["raise", "wrong type", "BaseException", "out of range", "bad probs", "slow", "hang", "spin"]


def load_requests(seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    words = ["def", "add", "class", "hello", "world", "return", "model", "total", "print", "values", "poison"]
    out = []
    for i in range(16):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 7)))
        if i % 4 == 0:
            text += " poison"
        kind = i % 3
        if kind == 0:
            out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 12,
                                                 "temperature": 0, "stream": i % 2 == 0}))
        elif kind == 1:
            out.append(("/v1/completions", {"prompt": text + " " + text, "max_tokens": 12, "temperature": 0}))
        else:
            out.append(("/completion", {"prompt": text, "n_predict": 12, "temperature": 0, "stream": i % 2 == 1}))
    return out


@pytest.fixture(scope="module")
def plain_texts(tmp_path_factory):
    """Each load request's text from a server without speculators, one request at a time."""
    model = tiny_model(tmp_path_factory.mktemp("fuzz-plain"))
    server = LiveServer(make_engine(model, n_ctx=128), n_slots=1)
    try:
        return {seed: [text_of(p, *server.post(p, b)) for p, b in load_requests(seed)] for seed in (0, 1)}
    finally:
        server.close()


def drafts(server: LiveServer) -> float:
    metrics = server.request("GET", "/metrics")[2].decode()
    return sum(float(l.split()[1]) for l in metrics.splitlines() if l.startswith("speculant:spec_decode_num_drafts_total"))


@pytest.mark.parametrize("batched", [False, True], ids=["propose", "propose_batch"])
@pytest.mark.parametrize("mode", FAULTS)
def test_speculator_faults_under_concurrent_load(tmp_path_factory, plain_texts, mode, batched):
    model = tiny_model(tmp_path_factory.mktemp("fuzz-faults"))
    spec = (FaultyBatch if batched else Faulty)(mode, model.tokenizer)
    # A slow or hung call gets the speculator quarantined (never called again): the second
    # speculator of the chain drafts on. The grace (first calls) is short, for the hung ones.
    engine = make_engine(model, n_ctx=128, speculators=[spec, Lookup("test-lookup")], adaptive=False,
                         spec_deadline=0.1, spec_grace=0.5)
    server = LiveServer(engine, n_slots=4)
    seed = int(batched)
    reqs = load_requests(seed)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda pb: server.post(*pb), reqs))
        for (path, _), answer in zip(reqs, answers):
            check_answer(path, *answer)
        assert [text_of(p, *a) for (p, _), a in zip(reqs, answers)] == plain_texts[seed]
        status, _, raw = server.request("GET", "/health")
        assert status == 200, raw
        # the engine is whole afterwards: the same requests again, one at a time, and the
        # healthy ones still speculate (a batched call shared with a poisoned sequence need not)
        before = drafts(server)
        assert [text_of(p, *server.post(p, b)) for p, b in reqs[:8]] == plain_texts[seed][:8]
        assert drafts(server) > before
        assert ("test-boom" in engine.chain.quarantined) == (mode in ("slow", "hang", "spin"))
    finally:
        spec.release.set()
        server.close()
