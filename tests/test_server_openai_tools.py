"""The official `openai` client calling tools through `python -m speculant_server` on the real
1.5B model (Qwen2.5's template has a tools section): a two-step conversation (call, tool result,
answer), the same call streamed, and tool_choice naming a function."""
import json

import pytest

from test_server_clients import real_openai_client

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    yield from real_openai_client(tmp_path_factory, "tools-server", "--spec-type", "ngram-simple", "-c", "2048")


def test_two_step_tool_conversation(client):
    r = client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER, CLOCK], temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    messages = [*QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    # The last turn without tools: this 1.5B model, offered tools again, calls again.
    r2 = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
                                        temperature=0, max_tokens=48)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert "18" in r2.choices[0].message.content  # the tool's answer reached the model

    stream = client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER, CLOCK], temperature=0,
                                            max_tokens=64, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content  # a call is not content
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0].index == 0
    assert (deltas[0].function.name, deltas[0].function.arguments) == (call.function.name, call.function.arguments)


def test_tool_choice_names_the_function(client):
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hello!"}],
                                       tools=[WEATHER, CLOCK], temperature=0, max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_time"]
    assert isinstance(json.loads(calls[0].function.arguments), dict)
