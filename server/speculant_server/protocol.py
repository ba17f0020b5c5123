"""Request bodies -> validated generation requests; OpenAI-shaped errors.

Every field is checked for its type and range here, so the engine thread only ever sees requests
it can run. A problem is an ``ApiError``, which the app turns into
``{"error": {"message", "type", "code"}}`` with the HTTP status (``code`` is the status, as
llama-server does).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import attrs

from speculant.engine import SpecOverride
from speculant.sampling import SamplingParams
from speculant_server.errors import ApiError, bad  # noqa: F401 (re-exported: the server's modules import them from here)

SPEC_N_LIMIT = 64  # as --spec-draft-n-max
TOP_LOGPROBS_LIMIT = 20  # most top tokens per position: OpenAI's chat limit (its completions allow 5)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_json_type(body)}")
    # The walk costs more than the parse on a big body: only when the text may hold a surrogate
    # (an escape \uD800-\uDFFF, or one encoded raw, which json.loads lets through).
    if not isinstance(raw, bytes) or _MAYBE_SURROGATE.search(raw) or json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        _no_surrogates(body)
    return body


_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _no_surrogates(body: dict) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates: not text, no tokenizer, template or
    response can take them (and an error message quoting one could not be sent). Rejected once
    here, anywhere in the body, keys included, naming the field."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # not recursive: json.loads already bounds the depth, this walk adds no frames
        path, v = stack.pop()
        if isinstance(v, str):
            if not _utf8(v):
                c = next(c for c in v if 0xD800 <= ord(c) <= 0xDFFF)
                raise bad(f"'{path}' contains a lone surrogate (U+{ord(c):04X}), which is not valid Unicode", param=path)
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _utf8(k):
                    where = f"'{path}'" if path else "the request body"
                    raise bad(f"a key in {where} contains a lone surrogate, which is not valid Unicode", param=path or None)
                stack.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v) if isinstance(item, (str, dict, list)))


# --- typed field access ------------------------------------------------------------------------
def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


def get_int(body: dict, key: str, default: Any = None, low: int | None = None, high: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{key}' must be an integer, got {_json_type(v)}", param=key)
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise bad(f"'{key}' must be {rng}, got {v}", param=key)
    return v


def get_float(body: dict, key: str, default: Any = None, ok: Callable[[float], bool] = lambda v: True,
              expected: str = "") -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{key}' must be a number, got {_json_type(v) if not isinstance(v, float) else v}", param=key)
    if not ok(float(v)):
        raise bad(f"'{key}' must be {expected}, got {v}", param=key)
    return float(v)


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean, got {_json_type(v)}", param=key)
    return v


def get_str(body: dict, key: str, default: Any = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"'{key}' must be a string, got {_json_type(v)}", param=key)
    return v


def get_stop(body: dict, limits: Limits | None = None) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        stops = [v] if v else []
    elif isinstance(v, list) and all(isinstance(s, str) for s in v):
        stops = [s for s in v if s]
    else:
        raise bad(f"'stop' must be a string or an array of strings, got {_json_type(v)}", param="stop")
    limits = limits or Limits()
    if len(stops) > limits.max_stop_strings:
        raise bad(f"'stop' has {len(stops)} strings, more than the {limits.max_stop_strings} allowed "
                  "(--max-stop-strings)", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_length:
        raise bad(f"a 'stop' string has {longest} characters, more than the {limits.max_stop_length} allowed "
                  "(--max-stop-length)", param="stop")
    return stops


def get_tokens(v: Any, key: str, n_vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(f"'{key}' must be an array of token ids", param=key)
    tokens = [int(t) for t in v]
    for t in tokens:
        if not 0 <= t < n_vocab:
            raise bad(f"token id {t} in '{key}' is out of range (the vocabulary has {n_vocab} tokens)", param=key)
    return tokens


# --- limits ------------------------------------------------------------------------------------------
PROMPT_BYTES_FLOOR = 64 << 10  # the automatic --max-prompt-bytes is never below this


@attrs.frozen
class Limits:
    """What a request may ask for, checked before anything is tokenized (the serve command's flags):
    tokenizing, rendering and stop matching cost time in proportion to these, however soon the
    request would be refused afterwards (a 7 MB prompt costs tens of seconds of tokenizer time)."""

    max_prompt_bytes: int = -1  # prompt text in UTF-8 bytes (rendered chat prompt); -1: automatic, 0: no limit
    max_messages: int = 2048  # OpenAI's own limit on 'messages'
    max_stop_strings: int = 64
    max_stop_length: int = 512  # characters of one stop string
    max_n: int = 8  # choices per request ('n'); also at most the server's slots

    def prompt_bytes(self, n_ctx: int, max_token_bytes: int) -> int | None:
        """The prompt size limit in bytes (None: none). Automatic: what `n_ctx` tokens could hold at
        most (each token stands for at most `max_token_bytes` bytes), so no prompt that fits the
        context is refused; at least PROMPT_BYTES_FLOOR, so that a prompt a little too long still
        gets the exact token count in its error."""
        if self.max_prompt_bytes == 0:
            return None
        if self.max_prompt_bytes > 0:
            return self.max_prompt_bytes
        return max(PROMPT_BYTES_FLOOR, n_ctx * max_token_bytes)


def check_prompt_bytes(text: str, limit: int | None, param: str) -> None:
    """413 when `text` is over `limit` UTF-8 bytes: cheap, so it runs before the tokenizer does."""
    if limit is None or len(text) * 4 <= limit:  # a character is at most 4 bytes
        return
    n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if n > limit:
        raise ApiError(413, f"the prompt is {n} bytes, more than this server takes: {limit} bytes (--max-prompt-bytes)",
                       param=param, n_prompt_bytes=n, max_prompt_bytes=limit)


# --- the generation request ------------------------------------------------------------------------
@attrs.define
class Defaults:
    """Server-wide defaults (the serve command's flags)."""

    params: SamplingParams = SamplingParams()
    n_predict: int = -1  # -1: until the end of the context


@attrs.define
class GenRequest:
    """One generation: the prompt (text, messages or tokens) and how to run it."""

    endpoint: str  # "chat", "completions" or "completion" (llama-server's)
    prompt_text: str | None = None
    messages: list[dict] | None = None
    prompt_tokens: list[int] | None = None
    max_tokens: int | None = None  # None: until the end of the context
    params: SamplingParams = SamplingParams()
    stops: list[str] = attrs.field(factory=list)
    stream: bool = False
    include_usage: bool = False
    spec: SpecOverride | None = None
    cache_prompt: bool = True  # llama-server's: continue from a kept state sharing a prefix with the prompt
    n: int = 1  # choices, each its own sequence on the shared prompt
    logprobs: int | None = None  # top tokens to report with each token's logprob (None: no logprobs)
    tools: Any = None  # chat: a tools.ToolRequest when tools may be called
    grammar: GrammarSpec | None = None  # structured output: response_format, grammar or json_schema


def sampling_params(body: dict, defaults: SamplingParams) -> SamplingParams:
    temperature = get_float(body, "temperature", defaults.temperature)  # <= 0: greedy, as llama-server
    top_k = get_int(body, "top_k", defaults.top_k)
    top_p = get_float(body, "top_p", defaults.top_p, lambda v: 0 <= v <= 1, "in [0, 1]")
    min_p = get_float(body, "min_p", defaults.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
    seed = get_int(body, "seed", None, -1, 2**64 - 1)
    seed = defaults.seed if seed is None or seed == -1 else seed
    return SamplingParams(max(0.0, temperature), max(0, top_k), top_p, min_p, seed)


def spec_override(body: dict, enabled: list[str], known: list[str]) -> SpecOverride | None:
    """`speculative.n_max` / `.n_min` / `.p_min` / `.type`, as flat dotted keys (llama-server's way) or
    a nested `speculative` object. Types must be among the server's --spec-type (`enabled`)."""
    fields = {k[len("speculative."):]: v for k, v in body.items() if k.startswith("speculative.")}
    nested = body.get("speculative")
    if nested is not None:
        if not isinstance(nested, dict):
            raise bad(f"'speculative' must be an object, got {_json_type(nested)}", param="speculative")
        fields.update(nested)
    if not fields:
        return None
    named = {f"speculative.{k}": v for k, v in fields.items()}
    n_max = get_int(named, "speculative.n_max", None, 0, SPEC_N_LIMIT)
    n_min = get_int(named, "speculative.n_min", None, 0, SPEC_N_LIMIT)
    p_min = get_float(named, "speculative.p_min", None, lambda v: 0 <= v <= 1, "in [0, 1]")
    types = None
    t = named.get("speculative.type", named.get("speculative.types"))
    if t is not None:
        if isinstance(t, str):
            names = [n.strip() for n in t.split(",") if n.strip()]
        elif isinstance(t, list) and all(isinstance(n, str) for n in t):
            names = [n.strip() for n in t if n.strip()]
        else:
            raise bad(f"'speculative.type' must be a string (comma list) or an array of strings, got {_json_type(t)}",
                      param="speculative.type")
        names = [n for n in names if n != "none"]
        for n in names:
            if n not in known:
                raise bad(f"unknown spec type '{n}' (available: {', '.join(known) or 'none installed'})",
                          param="speculative.type")
            if n not in enabled:
                raise bad(f"spec type '{n}' is not enabled on this server (enabled: {', '.join(enabled) or 'none'}); "
                          f"start it with --spec-type {n}", param="speculative.type")
        types = tuple(n for n in enabled if n in names)  # the chain's order
    return SpecOverride(n_max, n_min, p_min, types)


def _max_tokens(body: dict, keys: tuple[str, ...], default: int) -> int | None:
    """max_tokens-like fields: an integer >= 1; -1 (llama-server's n_predict) means no limit."""
    for key in keys:
        if body.get(key) is not None:
            v = get_int(body, key)
            if v == -1 and key == "n_predict":
                return None
            if v <= 0:
                raise bad(f"'{key}' must be >= 1, got {v}", param=key)
            return v
    return None if default < 0 else default


def parse_messages(body: dict, limits: Limits | None = None) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", param="messages")
    max_messages = (limits or Limits()).max_messages
    if len(msgs) > max_messages:
        raise bad(f"'messages' has {len(msgs)} messages, more than the {max_messages} allowed (--max-messages)",
                  param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {_json_type(m)}", param="messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role must be a string", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content: only text parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or an array of text parts", param="messages")
        out.append({**m, "role": role, "content": content or ""})
    return out


# Fields that would change what is generated or returned: rejected until they are supported,
# rather than ignored. Each maps to the values that ask for nothing and are accepted.
UNSUPPORTED = {"post_sampling_probs": (None, False)}

ANY_JSON_OBJECT = {"type": "object"}


@attrs.frozen
class GrammarSpec:
    """A structured-output request: kind "json" (value: a JSON schema) or "gbnf" (value: GBNF
    text), and the field it came from (errors name it). Compiled by speculant_server.grammar."""

    kind: str
    value: Any
    param: str


def get_grammar(body: dict) -> GrammarSpec | None:
    """OpenAI's `response_format` (json_object, json_schema) and llama-server's `grammar` (GBNF)
    and `json_schema`; at most one of them. Only the shapes are checked here; whether a schema
    or grammar is valid is the grammar engine's to say (speculant_server.grammar)."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad("'response_format' must be an object with a 'type': \"text\", \"json_object\" or \"json_schema\"",
                      param="response_format")
        kind = rf["type"]
        if kind == "json_object":
            schema = rf.get("schema", ANY_JSON_OBJECT)  # llama-server takes a schema here too
            if not isinstance(schema, dict):
                raise bad(f"'response_format.schema' must be an object, got {_json_type(schema)}", param="response_format")
            found.append(GrammarSpec("json", schema, "response_format"))
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise bad("'response_format.json_schema' must be an object: {\"name\": ..., \"schema\": {...}, \"strict\": ...}",
                          param="response_format")
            if wrapper.get("name") is not None and not isinstance(wrapper["name"], str):
                raise bad("'response_format.json_schema.name' must be a string", param="response_format")
            if wrapper.get("strict") is not None and not isinstance(wrapper["strict"], bool):
                raise bad("'response_format.json_schema.strict' must be a boolean", param="response_format")
            schema = wrapper.get("schema", {})
            if not isinstance(schema, dict):
                raise bad(f"'response_format.json_schema.schema' must be an object, got {_json_type(schema)}",
                          param="response_format")
            found.append(GrammarSpec("json", schema, "response_format"))
        elif kind != "text":
            raise bad(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got {kind!r:.40}",
                      param="response_format")
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise bad(f"'json_schema' must be an object (a JSON schema), got {_json_type(schema)}", param="json_schema")
        found.append(GrammarSpec("json", schema, "json_schema"))
    grammar = get_str(body, "grammar", "")
    if grammar:
        found.append(GrammarSpec("gbnf", grammar, "grammar"))
    if len(found) > 1:
        raise bad(f"only one of 'response_format', 'json_schema' and 'grammar' may ask for a structure; got "
                  f"{' and '.join(repr(f.param) for f in found)}", param=found[1].param)
    return found[0] if found else None


def _unsupported(body: dict) -> None:
    for key, neutral in UNSUPPORTED.items():
        v = body.get(key)
        if not any(v == n and type(v) is type(n) for n in neutral):
            raise bad(f"'{key}' is not supported by this server", param=key)


def _logprobs(body: dict, endpoint: str) -> int | None:
    """How many top tokens to report with each token's logprob (None: no logprobs), in each
    endpoint's own fields: chat's `logprobs` (boolean) and `top_logprobs`, completions' `logprobs`
    (the number of top tokens), /completion's `n_probs` (llama-server's; 0: none)."""
    if endpoint == "chat":
        on = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", None, 0, TOP_LOGPROBS_LIMIT)
        if top is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if on else None
    if body.get("top_logprobs") is not None:
        raise bad(f"'top_logprobs' is a chat completions field; here ask with "
                  f"'{'logprobs' if endpoint == 'completions' else 'n_probs'}'", param="top_logprobs")
    if endpoint == "completions":
        if body.get("logprobs") is False:
            return None
        return get_int(body, "logprobs", None, 0, TOP_LOGPROBS_LIMIT)
    if body.get("logprobs") not in (None, False):
        raise bad("'logprobs' is an OpenAI field; /completion takes llama-server's 'n_probs'", param="logprobs")
    n_probs = get_int(body, "n_probs", 0, 0, TOP_LOGPROBS_LIMIT)
    return n_probs or None


def _common(body: dict, endpoint: str, defaults: Defaults, enabled: list[str], known: list[str],
            limits: Limits | None) -> GenRequest:
    limits = limits or Limits()
    if endpoint == "completion":
        n = get_int(body, "n", 1)
        if n != 1:
            raise bad(f"'n' must be 1 on /completion (use /v1/completions for several choices), got {n}", param="n")
    else:
        n = get_int(body, "n", 1, 1, limits.max_n)
    logprobs = _logprobs(body, endpoint)
    _unsupported(body)
    stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad(f"'stream_options' must be an object, got {_json_type(opts)}", param="stream_options")
    include_usage = get_bool(opts or {}, "include_usage")
    keys = ("n_predict", "max_tokens") if endpoint == "completion" else ("max_completion_tokens", "max_tokens")
    return GenRequest(endpoint, max_tokens=_max_tokens(body, keys, defaults.n_predict),
                      params=sampling_params(body, defaults.params), stops=get_stop(body, limits), stream=stream,
                      include_usage=include_usage, spec=spec_override(body, enabled, known),
                      cache_prompt=get_bool(body, "cache_prompt", True), n=n, logprobs=logprobs,
                      grammar=get_grammar(body))


def parse_chat(body: dict, defaults: Defaults, enabled: list[str], known: list[str],
               limits: Limits | None = None) -> GenRequest:
    req = _common(body, "chat", defaults, enabled, known, limits)
    req.messages = parse_messages(body, limits)
    return req


def parse_completion(body: dict, endpoint: str, defaults: Defaults, enabled: list[str], known: list[str],
                     n_vocab: int, limits: Limits | None = None) -> GenRequest:
    """/v1/completions (endpoint "completions") or llama-server's /completion ("completion")."""
    req = _common(body, endpoint, defaults, enabled, known, limits)
    for key, neutral in (("tools", (None, [])), ("tool_choice", (None, "none", "auto"))):
        if body.get(key) not in neutral:
            raise bad(f"'{key}' is a chat completions field (/v1/chat/completions)", param=key)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        req.prompt_tokens = get_tokens(prompt, "prompt", n_vocab)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("one prompt per request: batches of prompts are not supported", param="prompt")
    else:
        raise bad(f"'prompt' must be a string or an array of token ids, got {_json_type(prompt)}", param="prompt")
    return req
