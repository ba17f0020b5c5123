"""Tool calling's parts without a model: the request's tools checked, messages prepared for the
template, and the Hermes-format parser, fed whole and in every split a stream can make."""
from __future__ import annotations

import json

import pytest

from speculant.gguf import render_chat
from speculant_server.protocol import ApiError
from speculant_server.tools import (OPEN, ToolCallParser, ToolRequest, parse_tools, prepare_messages,
                                    template_takes_tools)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_choices():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert auto.choice == "auto" and auto.prefix() == "" and len(auto.tools) == 2
    assert parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).prefix() == OPEN + '\n{"name": "'
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).prefix() == \
        OPEN + '\n{"name": "get_weather", "arguments": '  # one tool: required names it
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.prefix() == OPEN + '\n{"name": "get_time", "arguments": '


@pytest.mark.parametrize("body, message", [
    ({"tools": {}}, "'tools' must be an array"),
    ({"tools": [{"type": "code"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name must be a function name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON Schema object"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "'tool_choice' must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "boolean"),
    ({"tools": [WEATHER] * 200}, "more than the 128"),
])
def test_bad_tools_are_400_naming_the_field(body, message):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and message in e.value.message


def test_assistant_tool_calls_reach_the_template_as_objects():
    msgs = prepare_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(ApiError, match="not JSON"):
        prepare_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}])


def test_qwen_style_template_renders_tools_and_calls():
    template = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> use <tool_call>{% endif %}"
                "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\""
                ", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% else %}[{{ m.role }}]{{ m.content }}"
                "{% endif %}{% endfor %}")
    assert template_takes_tools(template) and not template_takes_tools("{{ messages }}") and not template_takes_tools(None)
    msgs = prepare_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}])
    text = render_chat(template, msgs, tools=[WEATHER])
    assert '"name": "get_weather"' in text and '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text


ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _run(request: ToolRequest, pieces: list[str]) -> tuple[str, list[dict]]:
    parser = ToolCallParser(request)
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content += c
        calls += k
    c, k = parser.finish()
    return content + c, calls + k


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("split", [None, 1, 2, 3, 5, 7])
def test_parser_finds_content_and_calls_in_any_split(split):
    pieces = [ANSWER] if split is None else [ANSWER[i:i + split] for i in range(0, len(ANSWER), split)]
    auto = ToolRequest((WEATHER, TIME), "auto")
    content, calls = _run(auto, pieces)
    assert content == "Let me check.\n"
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_parser_edge_cases():
    auto = ToolRequest((WEATHER,), "auto")
    assert _run(auto, ["no tools here, just <tool text"]) == ("no tools here, just <tool text", [])
    assert _run(auto, ["<tool_call>not json</tool_call> ok"])[0] == "<tool_call>not json</tool_call> ok"
    unknown = '<tool_call>\n{"name": "greet", "arguments": {}}\n</tool_call>'  # a function nobody offered
    assert _run(auto, [unknown]) == (unknown, [])
    # unclosed at the end of the answer: a call if its JSON is whole
    assert _calls(_run(auto, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'])[1]) == \
        [("get_weather", {"city": "Rome"})]
    assert _run(auto, ['<tool_call>\n{"name": "get_weather", "argu'])[1] == []
    # arguments written as a JSON string
    assert _calls(_run(auto, ['<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}</tool_call>'])[1]) == \
        [("get_weather", {"city": "X"})]
    # one call asked for: the second is dropped
    single = ToolRequest((WEATHER, TIME), "auto", parallel=False)
    assert _calls(_run(single, [ANSWER])[1]) == [("get_weather", {"city": "Oslo"})]


def test_forced_prefix_is_part_of_the_parsed_answer():
    named = ToolRequest((WEATHER, TIME), "function", "get_weather")
    content, calls = _run(named, ['{"city": "Oslo"}}\n</tool_call>'])
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    required = ToolRequest((WEATHER, TIME), "required")
    assert _calls(_run(required, ['get_time", "arguments": {}}\n</tool_call>'])[1]) == [("get_time", {})]


FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


@pytest.mark.parametrize("split", [None, 1, 4])
def test_bare_calls_fenced_or_not_are_calls(split):
    """Small models write a call as a bare JSON object, often in a ```json fence (the real
    Qwen2.5-Coder-1.5B does): it is a call when it names an offered function."""
    auto = ToolRequest((WEATHER, TIME), "auto")
    for answer in (FENCED, '{"name": "get_time", "arguments": {}}', ' {"name": "get_time", "arguments": {}}\n'
                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}'):
        pieces = [answer] if split is None else [answer[i:i + split] for i in range(0, len(answer), split)]
        content, calls = _run(auto, pieces)
        assert content == "" and calls, answer
    assert _calls(_run(auto, [FENCED])[1]) == [("get_weather", {"city": "Paris"})]
    # not a call: another function's name, a JSON answer that is data, code in a fence, plain text
    for answer in (FENCED.replace("get_weather", "get_stock"), '{"city": "Paris"}', '```python\nprint(1)\n```',
                   "The weather is fine.", '{"name": "get_weather", "arguments": '):
        assert _run(auto, [answer]) == (answer, []), answer


def test_text_streams_at_once_when_it_cannot_be_a_call():
    parser = ToolCallParser(ToolRequest((WEATHER,), "auto"))
    assert parser.feed("``") == ("", [])  # could open a ```json fence
    assert parser.feed("`py") == ("```py", [])
    assert parser.feed("thon\n") == ("thon\n", [])


def test_chat_format_streams_what_it_returns_whole():
    """ChatFormat: the streamed deltas of content and calls add up to the unstreamed message, and
    a turn that ends in calls finishes with "tool_calls"."""
    from types import SimpleNamespace

    from speculant_server.app import ChatFormat
    from speculant_server.protocol import GenRequest
    from speculant_server.worker import Done

    state = SimpleNamespace(model_name="m", tokenizer=None)
    req = GenRequest("chat", tools=ToolRequest((WEATHER, TIME), "auto"))
    done = Done(finish_reason="stop", stop_type="eos", stopping_word="", prompt_tokens=1, completion_tokens=9, timings={}, slot=0)
    streamed = ChatFormat(state, req, "id")
    chunks = [c for i in range(0, len(ANSWER), 3) for c in streamed.text(ANSWER[i:i + 3])] + streamed.end(done)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = ChatFormat(state, req, "id").final([ANSWER], [None], [done])["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == content == "Let me check.\n"
    assert [t["index"] for t in calls] == [0, 1]
    assert [t["function"] for t in calls] == [t["function"] for t in whole["message"]["tool_calls"]]
