"""Tool calling: OpenAI's `tools` / `tool_choice` in, `tool_calls` out.

The tools reach the model through its own chat template (the `tools` variable, as transformers'
apply_chat_template passes them), so the model sees them exactly as it was trained to. What the
model writes back is parsed by the format its template teaches. One format is known today,
Hermes' (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n
</tool_call>`. A template that never mentions `tools` cannot take them: 400, not silence.

`tool_choice` "required" and a named function are kept by starting the assistant's answer with
the opening of a call (`<tool_call>\n{"name": "` and, named, the name and `"arguments": `): the
model continues a call it cannot decline; the rest of the call is then held by a grammar
(speculant_server.grammar.tool_call_grammar): under "required" one of the offered names, and the
arguments valid against that function's `parameters` schema, then `}` and `</tool_call>`. Only
the offered functions are calls: a call to any other name (possible under "auto") stays in the
content.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

import attrs

from speculant_server.protocol import ApiError, bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@attrs.frozen
class ToolRequest:
    """What a request asked for: its tools (as sent, checked) and the choice."""

    tools: tuple[dict, ...]
    choice: str  # "auto", "required", or "function" (then `name`)
    name: str | None = None
    parallel: bool = True

    def prefix(self) -> str:
        """The opening of the answer that keeps the choice ("" for auto)."""
        if self.choice == "required":
            return OPEN + '\n{"name": "'
        if self.choice == "function":
            return OPEN + '\n{"name": ' + json.dumps(self.name, ensure_ascii=False) + ', "arguments": '
        return ""


def _function_name(v: Any, where: str, param: str) -> str:
    if not isinstance(v, str) or not _NAME.match(v):
        raise bad(f"{where} must be a function name of 1-64 letters, digits, '_', '.' or '-'", param=param)
    return v


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None when no tool may be called (no tools,
    an empty list, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' has {len(tools)} tools, more than the {MAX_TOOLS} allowed", param="tools")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        fn = tool["function"]
        names.append(_function_name(fn.get("name"), f"tools[{i}].function.name", "tools"))
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    if len(set(names)) != len(names):
        raise bad("tool names must be distinct", param="tools")
    if choice is None or choice == "auto":
        return ToolRequest(tuple(tools), "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":  # with one tool, that tool: its name is then written for the model
        if len(names) == 1:
            return ToolRequest(tuple(tools), "function", names[0], parallel)
        return ToolRequest(tuple(tools), "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = _function_name(choice["function"].get("name"), "tool_choice.function.name", "tool_choice")
        if name not in names:
            raise bad(f"tool_choice names '{name}', which is not in 'tools'", param="tool_choice")
        return ToolRequest(tuple(tools), "function", name, parallel)
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
              "\"function\": {\"name\": ...}}", param="tool_choice")


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders tools in a format parsed here (Hermes' <tool_call>)."""
    return bool(template) and "tools" in template and OPEN in template


def prepare_messages(messages: list[dict]) -> list[dict]:
    """Messages for the template: an assistant's tool_calls checked, their `arguments` (a JSON
    string in OpenAI's API) as objects, since templates write them with `tojson`."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None or m.get("role") != "assistant":
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be an array", param="messages")
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise bad(f"messages[{i}].tool_calls[{j}] must have a 'function' object", param="messages")
            name = _function_name(fn.get("name"), f"messages[{i}].tool_calls[{j}].function.name", "messages")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise bad(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", param="messages") from None
            fixed.append({**call, "function": {**fn, "name": name, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def new_call(name: str, arguments: Any) -> dict:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call_from(body: str) -> dict | None:
    """A call from the text between the tags, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return new_call(obj["name"], args)


class ToolCallParser:
    """Splits a streamed answer into content and tool calls. `feed(text)` returns the content
    that is certain not to belong to a call (a possible start of `<tool_call>` is held back) and
    the calls completed by this text; `finish()` the rest when the answer ends. A call whose JSON
    does not parse stays in the content, as written."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self._buf = request.prefix()  # the answer's opening, written by us, is the model's text too
        self._in_call = bool(self._buf)
        self._names = {t["function"]["name"] for t in request.tools}
        # An answer may also be a bare call: {"name": ..., "arguments": ...}, perhaps in a ```json
        # fence (small models write that: the 1.5B Qwen2.5-Coder does). While the
        # answer's start could still be one, it is held back (`_lead`); once it is one (`_bare`),
        # the answer is read whole at its end.
        self._lead, self._bare = not self._in_call, False
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        if self._lead:
            state = lead_state(self._buf)
            if state == "maybe":
                return "", []
            self._lead, self._bare = False, state == "yes"
        if self._bare:
            return "", []
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                parsed, call = self._take(self._buf[len(OPEN):end])
                if not parsed:
                    content.append(self._content(self._buf[:end + len(CLOSE)]))
                elif call is not None:
                    calls.append(call)
                self._buf, self._in_call = self._buf[end + len(CLOSE):], False
            else:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    content.append(self._content(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._content(self._buf[:start]))
                self._buf, self._in_call = self._buf[start:], True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the answer ends: an unclosed call whose JSON parses is a call (the
        model may stop at its end-of-turn token right after the JSON)."""
        rest, self._buf = self._buf, ""
        if self._lead or self._bare:
            calls, tail = self._bare_calls(rest)
            if calls:
                return self._content(tail), calls
            return rest, []
        if self._in_call:
            parsed, call = self._take(rest[len(OPEN):])
            if parsed:
                return "", [] if call is None else [call]
        return self._content(rest), []

    def _bare_calls(self, text: str) -> tuple[list[dict], str]:
        """The calls of an answer that is bare call objects (fenced or not), and the text after
        them; ([], text) when it is not, or names a function the request did not offer."""
        decoder, calls = json.JSONDecoder(), []
        body = text.strip()
        if body.startswith("```"):
            body = body[3:].removeprefix("json")
        while True:
            body = body.lstrip()
            if not body.startswith("{"):
                break
            try:
                obj, end = decoder.raw_decode(body)
            except ValueError:
                return [], text
            if not isinstance(obj, dict) or obj.get("name") not in self._names:
                return [], text
            calls.append(obj)
            body = body[end:].lstrip().removeprefix("```")
        if not calls:
            return [], text
        out = []
        for obj in calls:
            parsed, call = self._take(json.dumps(obj))
            if call is not None:
                out.append(call)
        return out, body

    def _take(self, body: str) -> tuple[bool, dict | None]:
        """(whether `body` is a call, the call to return: None for a second call where the
        request said parallel_tool_calls false, which is dropped)."""
        call = _call_from(body.strip())
        if call is None or call["function"]["name"] not in self._names:  # only offered functions are called
            return False, None
        if self.calls and not self.request.parallel:
            return True, None
        self.calls.append(call)
        return True, call

    def _content(self, text: str) -> str:
        # Between and after calls the model writes newlines; they are not content.
        return "" if self.calls and not text.strip() else text


def lead_state(text: str) -> str:
    """Whether an answer starting with `text` is a bare call's start, `\\s*(```(json)?\\s*)?{\\s*"name"\\s*:\\s*"`:
    "yes" (that start is whole), "maybe" (it could still become one) or "no"."""
    i, n = 0, len(text)

    def ws(i):
        while i < n and text[i].isspace():
            i += 1
        return i

    i = ws(i)
    if text.startswith("```", i) or "```".startswith(text[i:]):
        if n - i < 3:
            return "maybe"
        i += 3
        rest = text[i:]
        if rest.startswith("json"):
            i += 4
        elif "json".startswith(rest):
            return "maybe"
        elif not rest[0].isspace():
            return "no"  # another language's fence: ```python
    for token in ("{", '"name"', ":", '"'):
        i = ws(i)
        if text.startswith(token, i):
            i += len(token)
        elif token.startswith(text[i:]):
            return "maybe"
        else:
            return "no"
    return "yes"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tools_error(template: str | None) -> ApiError | None:
    """The 400 for a request with tools on a model whose template cannot take them."""
    if template_takes_tools(template):
        return None
    return bad("this model's chat template has no tool-call format this server knows "
               "(Hermes' <tool_call>, as Qwen2.5 and Qwen3 write); send the tools in a message instead",
               param="tools")
