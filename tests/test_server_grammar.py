"""Structured outputs through the server on the tiny model: `response_format` (json_object,
json_schema), llama-server's `grammar` (GBNF) and `json_schema`, on every generation endpoint;
bad schemas and grammars are a 400 naming the problem; the output parses and validates, streamed
too, with speculation equal to plain decoding; the grammar drafter's drafts are counted."""
import json
import re

import pytest

from test_server_util import Lookup, aiotest, assert_error, chat_text, make_engine, post, serve, sse, tiny_model

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2},
    },
    "required": ["ok", "color", "name", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hello there"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def check(text: str, schema=SCHEMA) -> dict:
    """The text parses as JSON and validates against the schema (jsonschema if installed, else
    the checks this schema needs)."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    else:
        assert set(value) == set(schema["required"]) and isinstance(value["ok"], bool)
        assert value["color"] in ("red", "green", "blue") and len(value["name"]) <= 6
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


ENDPOINTS = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 80}, lambda b: b["choices"][0]["message"]["content"]),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 80}, lambda b: b["choices"][0]["text"]),
    ("/completion", {"prompt": "hello there", "n_predict": 80}, lambda b: b["content"]),
]


@aiotest
async def test_json_schema_on_every_endpoint_parses_validates_and_equals_plain_decoding(model):
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False)) as c:
        for path, base, text_of in ENDPOINTS:
            fields = [{"json_schema": SCHEMA}] + ([{"response_format": RESPONSE_FORMAT}] if path != "/completion" else [])
            for field in fields:
                outs = []
                for spec in ({}, {"speculative.n_max": 0}):  # with speculation; constrained plain decoding
                    status, body = await post(c, path, {**base, **field, **spec, "temperature": 0})
                    assert status == 200, body
                    outs.append(text_of(body))
                    check(outs[-1])
                assert outs[0] == outs[1]  # speculation under the grammar: plain decoding's output
        metrics = await (await c.get("/metrics")).text()
    drafted = re.search(r'speculant:spec_decode_num_draft_tokens_total\{spec_type="grammar"\} (\S+)', metrics)
    assert drafted and float(drafted.group(1)) > 0  # the forced keys and separators were drafted


@aiotest
async def test_sampled_json_schema_and_n_choices(model):
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False), n_slots=2) as c:
        for seed in range(3):
            status, body = await post(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 80, "temperature": 1.0,
                                                                   "seed": seed, "n": 2, "response_format": RESPONSE_FORMAT})
            assert status == 200, body
            for choice in body["choices"]:
                check(choice["message"]["content"])
                assert choice["finish_reason"] == "stop"


@aiotest
async def test_streamed_json_schema(model):
    async with serve(make_engine(model, speculators=[Lookup()], adaptive=False)) as c:
        status, body = await post(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 80, "temperature": 0,
                                                               "response_format": RESPONSE_FORMAT})
        status, events = await sse(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 80, "temperature": 0,
                                                                "response_format": RESPONSE_FORMAT, "stream": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert chat_text(events) == body["choices"][0]["message"]["content"]
        check(chat_text(events))
        status, events = await sse(c, "/completion", {"prompt": "hi", "n_predict": 80, "temperature": 0,
                                                      "json_schema": SCHEMA, "stream": True})
        check("".join(e.get("content", "") for e in events if isinstance(e, dict)))


@aiotest
async def test_json_object_and_gbnf(model):
    async with serve(make_engine(model)) as c:
        status, body = await post(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "temperature": 0,
                                                               "response_format": {"type": "json_object"}})
        assert status == 200
        text, finish = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
        assert text.startswith("{")  # the random tiny model may not close its string within 40 tokens
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        # llama-server's json_object with a schema
        status, body = await post(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 80, "temperature": 0,
                                                               "response_format": {"type": "json_object", "schema": SCHEMA}})
        check(body["choices"][0]["message"]["content"])
        grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]? "!"'
        for path, base, text_of in ENDPOINTS:
            for seed in range(3):
                status, body = await post(c, path, {**base, "grammar": grammar, "temperature": 1.0, "seed": seed})
                assert status == 200, body
                assert re.fullmatch(r"(yes|no) [0-9][0-9]?!", text_of(body)), text_of(body)


@aiotest
async def test_logprobs_under_a_grammar_are_the_model_s(model):
    async with serve(make_engine(model)) as c:
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "logprobs": 3}
        _, free = await post(c, "/v1/completions", body)
        _, constrained = await post(c, "/v1/completions", {**body, "grammar": 'root ::= "x" [a-z]+'})
    lp = constrained["choices"][0]["logprobs"]
    assert constrained["choices"][0]["text"].startswith("x")
    assert all(v <= 0 for v in lp["token_logprobs"])
    # the first position's top tokens are the model's, whatever the grammar allows (pre-mask)
    assert lp["top_logprobs"][0].keys() - {lp["tokens"][0]} <= free["choices"][0]["logprobs"]["top_logprobs"][0].keys()


BAD = [
    ({"json_schema": {"type": "foo"}}, "'json_schema' is not a valid JSON schema", "foo"),
    ({"json_schema": {"type": "string", "pattern": "[a-"}}, "not a valid JSON schema", "unclosed"),
    ({"json_schema": [1]}, "'json_schema' must be an object"),
    ({"grammar": "root ::= foo"}, "'grammar' is not a valid GBNF grammar", "foo"),
    ({"grammar": 'root ::= "a" ('}, "not a valid GBNF grammar"),
    ({"grammar": 5}, "'grammar' must be a string"),
    ({"grammar": "root ::= \"a\"", "json_schema": SCHEMA}, "only one of"),
    # llguidance 1.9 panics (a BaseException) cutting this one's error message inside the 'é'
    ({"json_schema": {"required": {"x" * 97 + "\u00e9": []}}}, "not a valid JSON schema", "grammar engine failed", "PanicException"),
]
BAD_OPENAI = [
    ({"response_format": {"type": "xml"}}, "'response_format.type' must be"),
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "schema' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "strict' must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "'response_format' is not a valid JSON schema", "foo"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "only one of"),
]


@aiotest
async def test_bad_schemas_and_grammars_are_400s_naming_the_problem(model):
    async with serve(make_engine(model)) as c:
        for path, base, _ in ENDPOINTS:
            for field, *words in BAD + (BAD_OPENAI if path != "/completion" else []):
                status, body = await post(c, path, {**base, **field})
                err = assert_error(status, body, 400, *words)
                assert "\n" not in err["message"]
        # asking for nothing is accepted
        for field in ({"response_format": {"type": "text"}}, {"grammar": ""}):
            status, body = await post(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **field})
            assert status == 200, body


def test_forced_tool_calls_are_held_to_the_function_schema(model):
    """tool_choice named or required: the call's rest (after the opening the prompt holds) is
    the function's arguments, valid against its parameters schema, then `}`, a newline and
    `</tool_call>` (the tiny vocabulary has no such token: its text)."""
    from speculant_server.grammar import Grammars, tool_call_grammar
    from speculant_server.protocol import ApiError
    from speculant_server.tools import parse_tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time"}}
    tok = model.tokenizer
    grammars = Grammars(tok, model.info.n_vocab)

    def accepts(request, text):
        c = grammars.constraint(grammars.compile(tool_call_grammar(request, tok)))
        ids = tok.encode(text, add_special=False, parse_special=False)
        return c.valid_prefix(ids) == len(ids)

    named = parse_tools({"tools": [weather, clock], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert accepts(named, '{"city": "Oslo", "unit": "C"}}\n</tool_call>')
    assert not accepts(named, '{"city": "Oslo"}}\n</tool_call>')  # unit is required
    assert not accepts(named, '{"city": "Oslo", "unit": "K"}}\n</tool_call>')
    required = parse_tools({"tools": [weather, clock], "tool_choice": "required"})
    assert accepts(required, 'get_time", "arguments": {}}\n</tool_call>')
    assert accepts(required, 'get_weather", "arguments": {"city": "Oslo", "unit": "F"}}\n</tool_call>')
    assert not accepts(required, 'get_date", "arguments": {}}\n</tool_call>')
    assert tool_call_grammar(parse_tools({"tools": [weather]}), tok) is None  # auto: the model decides
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "foo"}}}}}
    with pytest.raises(ApiError) as e:
        grammars.compile(tool_call_grammar(parse_tools({"tools": [broken], "tool_choice": "required"}), tok))
    assert e.value.status == 400 and e.value.extra["param"] == "tools" and "foo" in e.value.message


def test_a_panicking_matcher_ends_its_sequence_not_the_engine(model):
    """A Rust panic inside llguidance is a BaseException: on the engine thread it would kill the
    thread. GrammarConstraint turns it into its error state: nothing allowed, the sequence ends."""
    from speculant.sampling import SamplingParams
    from speculant_server.grammar import GrammarConstraint

    class Panic(BaseException):
        pass

    class Matcher:
        calls = 0

        def is_error(self):
            return False

        def unsafe_compute_mask_ptr(self, ptr, n):
            Matcher.calls += 1
            if Matcher.calls > 3:
                raise Panic("index out of bounds")
            import ctypes
            ctypes.memset(ptr, 0xFF, n)

        def consume_token(self, t):
            return True

        def validate_tokens(self, tokens):
            return len(tokens)

        def compute_ff_tokens(self):
            return []

        def rollback(self, n):
            return True

    engine = make_engine(model)
    c = GrammarConstraint(Matcher(), model.info.n_vocab)
    out = list(engine.generate(model.tokenizer.encode("hello"), 20, SamplingParams(temperature=1.0, seed=1), constraint=c))
    assert c.error and "Panic: index out of bounds" in c.error
    assert out[-1] in model.tokenizer.eog_ids and len(out) <= 4
