"""The official `openai` client asks `python -m speculant_server` on the real 1.5B model (n-gram
speculation) for structured output: `response_format` json_schema (strict) and json_object. The
answers parse and validate, streamed the same, and equal constrained plain decoding's."""
import json

import pytest

from test_server_clients import real_openai_client

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "language": {"enum": ["C", "Python", "Rust", "Go"]},
        "arguments": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "type": {"type": "string"}}, "required": ["name", "type"],
            "additionalProperties": False}},
        "returns": {"type": "string"},
        "pure": {"type": "boolean"},
    },
    "required": ["name", "language", "arguments", "returns", "pure"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe this function as JSON (name, language, arguments with their types, "
                                        "return type, whether it is pure):\n\nint add(int a, int b) { return a + b; }"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    yield from real_openai_client(tmp_path_factory, "real-server", "--spec-type", "ngram-simple", timeout=600)


def validate(text: str, schema: dict) -> dict:
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"])
    else:
        jsonschema.validate(value, schema)
    return value


def test_openai_json_schema_real_model(real_server):
    client = real_server
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=120, temperature=0,
                                       response_format=FORMAT)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    value = validate(choice.message.content, SCHEMA)
    assert value["name"] == "add" and value["language"] == "C"
    assert [a["name"] for a in value["arguments"]] == ["a", "b"]

    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=120, temperature=0,
                                            response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content

    plain = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=120, temperature=0,
                                           response_format=FORMAT, extra_body={"speculative.n_max": 0})
    assert plain.choices[0].message.content == choice.message.content  # speculation changes nothing


def test_openai_json_object_real_model(real_server):
    r = real_server.chat.completions.create(
        model="any", max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France and of Italy as a JSON object."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"], "additionalProperties": False}}}


def test_openai_forced_tool_call_follows_the_schema_real_model(real_server):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = real_server.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Is it warm in Lisbon today?"}], tools=[WEATHER, CLOCK],
            tool_choice=choice, temperature=0, max_tokens=60)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0].function
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}[call.name]
        validate(call.arguments, schema)
