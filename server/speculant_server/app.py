"""The aiohttp application: OpenAI- and llama-server-compatible endpoints over one EngineWorker.

Handlers only parse, tokenize (in the default executor, off the event loop), queue a Job and
relay its events; all model work happens on the engine thread, so the loop stays free to answer
/health and other requests during a long generation.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any

import attrs
from aiohttp import web

from speculant.engine import Engine
from speculant.gguf import CHATML_TEMPLATE
from speculant.logs import get_logger

from speculant_server import metrics, slot_files
from speculant_server.grammar import Grammars, tool_call_grammar
from speculant_server.protocol import (ApiError, Defaults, GenRequest, Limits, bad, check_prompt_bytes, get_bool,
                                       get_str, get_tokens, parse_chat, parse_completion, parse_json, parse_messages)
from speculant_server.tools import ToolCallParser, parse_tools, prepare_messages, tools_error
from speculant_server.worker import Done, EngineWorker, Job, QueueFull

log = get_logger("speculant.server")

PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models"}  # answered without an API key, as llama-server does


@attrs.define
class ServerConfig:
    n_slots: int = 4
    queue_size: int = 256
    api_keys: tuple[str, ...] = ()
    alias: str | None = None
    max_body_size: int = 16 * 2**20
    defaults: Defaults = attrs.field(factory=Defaults)
    draft_model: str | None = None
    cache_ram: int | None = 8192 << 20  # bytes of finished prompts' states kept beyond the slots (None: no limit)
    slot_similarity: float = 0.1  # llama-server's --slot-prompt-similarity
    slot_save_path: str | None = None
    limits: Limits = attrs.field(factory=Limits)  # checked before tokenizing: prompt bytes, messages, stop strings
    special_in_content: bool = False  # special-token texts in chat messages become control tokens (role injection)
    body_timeout: float = 60.0  # seconds to receive a request's whole body, once its headers are in (408 after)
    keepalive_timeout: float = 15.0  # seconds an idle connection stays open (also one that sends no full headers)
    shutdown_timeout: float = 10.0  # seconds from SIGTERM to exit: running requests finish or get an error


class ClientGone(Exception):
    pass


class State:
    def __init__(self, engine: Engine, config: ServerConfig, spec_known: list[str] | None = None):
        self.engine, self.config = engine, config
        self.model = engine.model
        self.tokenizer = engine.model.tokenizer
        self.n_ctx = engine.config.n_ctx
        self.max_prompt_bytes = config.limits.prompt_bytes(self.n_ctx, getattr(self.tokenizer, "max_token_bytes", 256))
        self.worker = EngineWorker(engine, config.n_slots, config.queue_size, config.cache_ram, config.slot_similarity)
        self.spec_enabled = list(self.worker.spec_types)
        if spec_known is None:
            from speculant.plugins import default_registry

            spec_known = default_registry().names("speculator")
        self.spec_known = sorted(set(spec_known) | set(self.spec_enabled))
        info = getattr(self.model, "info", None)
        self.model_path = getattr(info, "path", "") or ""
        self.model_name = config.alias or (self.model_path.rsplit("/", 1)[-1] if self.model_path else "speculant")
        self.registry = metrics.make_registry(self.worker)
        self.grammars = Grammars(self.tokenizer, engine.n_vocab)  # structured outputs (llguidance), built on first use
        self.created = int(time.time())


STATE = web.AppKey("state", State)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, ensure_ascii=False))


def _error_response(e: ApiError) -> web.Response:
    return _json(e.body(), e.status)


# --- middlewares -------------------------------------------------------------------------------------
@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BodyTimeout as e:  # answer, then close at once: reading the rest would wait on the same client
        resp = _error_response(e)
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        if request.protocol is not None:
            request.protocol.force_close()
        return resp
    except ApiError as e:
        return _error_response(e)
    except ClientGone:
        return web.Response(status=499)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        if e.status == 404:
            message = f"no endpoint {request.method} {request.path}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif e.status == 413:
            message = f"the request body is too large: {e.text or e.reason}"
        return _error_response(ApiError(e.status, message))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error", path=request.path)
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = request.app[STATE].config.api_keys
    if keys and request.path not in PUBLIC_PATHS and request.method != "OPTIONS":
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
        if not key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY'")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
            raise ApiError(401, "invalid API key")
    return await handler(request)


# --- helpers ------------------------------------------------------------------------------------------
async def _blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class BodyTimeout(ApiError):
    """The body did not arrive in time: answered with 408, then the connection is closed."""


async def read_json(request: web.Request) -> dict:
    timeout = request.app[STATE].config.body_timeout
    try:  # the whole body, not per read: a client trickling a byte at a time is cut off too
        body = await asyncio.wait_for(request.read(), timeout)  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    except asyncio.TimeoutError:
        raise BodyTimeout(408, f"the request body did not arrive within {timeout:g} s", "timeout_error") from None
    return parse_json(body)


def generation_settings(state: State, params, n_predict: int | None, stops: list[str], stream: bool, spec) -> dict:
    c = state.engine.config
    types = state.spec_enabled if spec is None or spec.types is None else list(spec.types)
    pick = lambda name, default: default if spec is None or getattr(spec, name) is None else getattr(spec, name)
    return {
        "n_predict": -1 if n_predict is None else n_predict, "temperature": params.temperature, "top_k": params.top_k,
        "top_p": params.top_p, "min_p": params.min_p, "seed": -1 if params.seed is None else params.seed,
        "stop": stops, "stream": stream, "n_ctx": state.n_ctx,
        "speculative.n_max": pick("n_max", c.draft_n_max), "speculative.n_min": pick("n_min", c.draft_n_min),
        "speculative.p_min": pick("p_min", c.draft_p_min), "speculative.types": ",".join(types) or "none",
    }


def build_prompt(state: State, req: GenRequest) -> list[int]:
    tok = state.tokenizer
    if req.prompt_tokens is not None:
        return req.prompt_tokens
    if req.messages is not None:
        extra = {}
        if req.tools is not None:
            error = tools_error(tok.chat_template)
            if error is not None:
                raise error
            extra["tools"] = list(req.tools.tools)
        # the messages' special-token texts stay text (no role injection) unless --special-in-content
        try:
            prompt = tok.chat_prompt(prepare_messages(req.messages), add_generation_prompt=True,
                                     special_in_content=state.config.special_in_content, **extra)
        except ApiError:
            raise
        except Exception as e:  # the template rejected the conversation (roles, order, ...)
            raise bad(f"the chat template could not render the messages: {e}") from None
        check_prompt_bytes(prompt.text, state.max_prompt_bytes, "messages")
        opening = req.tools.prefix() if req.tools is not None else ""  # tool_choice required or named
        return prompt.encode() + (tok.encode(opening, add_special=False, parse_special=False) if opening else [])
    check_prompt_bytes(req.prompt_text, state.max_prompt_bytes, "prompt")
    return tok.encode(req.prompt_text, add_special=True, parse_special=True)  # a raw prompt: specials parsed, as llama-server


# --- response shapes ------------------------------------------------------------------------------------
class _Format:
    """A response's shape. Choices are indexed 0..n-1; `logprobs` are TokenLogprob lists."""

    done_marker = True

    def __init__(self, state: State, req: GenRequest, job_id: str, prompt_text: str | None = None):
        self.state, self.req, self.model = state, req, state.model_name
        self.created = int(time.time())
        self.job_id = job_id
        self.slot = -1
        self.tokenizer = state.tokenizer

    @staticmethod
    def usage(dones: list[Done]) -> dict:
        """The prompt once, the completion tokens of every choice."""
        prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": dones[0].cached_tokens}}

    @staticmethod
    def timings(dones: list[Done]) -> dict:
        """The first choice's timings, with the predicted and draft counts of all choices."""
        t = dict(dones[0].timings)
        if len(dones) > 1:
            for key in ("predicted_n", "draft_n", "draft_n_accepted"):
                t[key] = sum(d.timings[key] for d in dones)
            t["predicted_ms"] = max(d.timings["predicted_ms"] for d in dones)
            t["predicted_per_token_ms"] = t["predicted_ms"] / t["predicted_n"] if t["predicted_n"] else 0.0
            t["predicted_per_second"] = t["predicted_n"] / t["predicted_ms"] * 1e3 if t["predicted_ms"] > 0 else 0.0
        return t

    def token(self, token: int) -> tuple[str, list[int]]:
        """A token's text (special tokens as their text; a piece of a UTF-8 character as U+FFFD)
        and its bytes."""
        b = self.tokenizer.token_bytes(token, True)
        return b.decode("utf-8", "replace"), list(b)

    def start(self, index: int) -> list[dict]:
        return []

    def usage_chunks(self, dones: list[Done]) -> list[dict]:
        return []


def _lp(v: float) -> float:
    """A logprob JSON can carry: -inf (a token the model rules out) as OpenAI's -9999.0."""
    return v if v > -9999.0 else -9999.0


class ChatFormat(_Format):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Per choice, with tools: the parser that splits its text into content and tool calls,
        # the calls sent so far, and logprobs of text held back (they ride with the next chunk).
        self.parsers: dict[int, ToolCallParser] = {}
        self.n_calls: dict[int, int] = {}
        self.held: dict[int, list] = {}

    def _chunk(self, delta: dict, index: int = 0, finish: str | None = None, logprobs=None, **extra) -> dict:
        return {"id": self.job_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": "speculant",
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra}

    def logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        out = []
        for e in entries:
            text, b = self.token(e.token)
            top = []
            for t, lp in e.top:
                tt, tb = self.token(t)
                top.append({"token": tt, "logprob": _lp(lp), "bytes": tb})
            out.append({"token": text, "logprob": _lp(e.logprob), "bytes": b, "top_logprobs": top})
        return {"content": out}

    def start(self, index):
        return [self._chunk({"role": "assistant", "content": ""}, index)]

    def text(self, text, index=0, logprobs=None):
        if self.req.tools is None:
            return [self._chunk({"content": text}, index, logprobs=self.logprobs(logprobs))]
        content, calls = self._parser(index).feed(text)
        return self._parsed(index, content, calls, logprobs)

    def _parser(self, index: int) -> ToolCallParser:
        if index not in self.parsers:
            self.parsers[index] = ToolCallParser(self.req.tools)
        return self.parsers[index]

    def _parsed(self, index: int, content: str, calls: list[dict], logprobs) -> list[dict]:
        """Chunks for what the parser let through: content, then each call whole (OpenAI's
        streamed shape, with the call's index among the choice's calls)."""
        if logprobs is not None:
            self.held.setdefault(index, []).extend(logprobs)
        out = []
        if content:
            out.append(self._chunk({"content": content}, index, logprobs=self._take_held(index)))
        for call in calls:
            k = self.n_calls.get(index, 0)
            self.n_calls[index] = k + 1
            out.append(self._chunk({"tool_calls": [{"index": k, **call}]}, index, logprobs=self._take_held(index)))
        return out

    def _take_held(self, index: int):
        held = self.held.pop(index, None)
        return self.logprobs(held) if held is not None else None

    def _finish_reason(self, done: Done, index: int, n_calls: int) -> str:
        # OpenAI's: a turn that ends in calls (not cut by max_tokens) finishes with "tool_calls"
        return "tool_calls" if n_calls and done.finish_reason == "stop" else done.finish_reason

    def end(self, done: Done, index=0):
        out = []
        if self.req.tools is not None:
            content, calls = self._parser(index).finish()
            out = self._parsed(index, content, calls, None)
            if index in self.held:  # logprobs of text that turned out to be nothing
                out.append(self._chunk({}, index, logprobs=self._take_held(index)))
        finish = self._finish_reason(done, index, self.n_calls.get(index, 0))
        return out + [self._chunk({}, index, finish, timings=done.timings)]

    def usage_chunks(self, dones):
        if not self.req.include_usage:
            return []
        return [{**self._chunk({}), "choices": [], "usage": self.usage(dones), "timings": self.timings(dones)}]

    def _message(self, text: str) -> dict:
        if self.req.tools is None:
            return {"role": "assistant", "content": text}
        parser = ToolCallParser(self.req.tools)
        content, calls = parser.feed(text)
        rest, more = parser.finish()
        content, calls = content + rest, calls + more
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def final(self, texts: list[str], logprobs: list, dones: list[Done]) -> dict:
        choices = []
        for i, (text, lps, done) in enumerate(zip(texts, logprobs, dones)):
            message = self._message(text)
            choices.append({"index": i, "message": message, "logprobs": self.logprobs(lps),
                            "finish_reason": self._finish_reason(done, i, len(message.get("tool_calls", ())))})
        return {"id": self.job_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": "speculant", "choices": choices,
                "usage": self.usage(dones), "timings": self.timings(dones)}


class CompletionsFormat(_Format):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offsets: dict[int, int] = {}  # per choice: characters of token text so far (text_offset)

    def _chunk(self, text: str, index: int = 0, finish: str | None = None, logprobs=None, **extra) -> dict:
        return {"id": self.job_id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": "speculant",
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}], **extra}

    def logprobs(self, entries, index: int) -> dict | None:
        """OpenAI's legacy shape: the tokens, their logprobs, for each a dict of the top tokens'
        texts (the chosen one always among them) to their logprobs, and where each token's text
        starts (characters into the choice's token texts, concatenated)."""
        if entries is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offsets.get(index, 0)
        for e in entries:
            text, _ = self.token(e.token)
            top = {self.token(t)[0]: _lp(lp) for t, lp in e.top}
            top.setdefault(text, _lp(e.logprob))
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return out

    def text(self, text, index=0, logprobs=None):
        return [self._chunk(text, index, logprobs=self.logprobs(logprobs, index))]

    def end(self, done: Done, index=0):
        return [self._chunk("", index, done.finish_reason, timings=done.timings)]

    def usage_chunks(self, dones):
        if not self.req.include_usage:
            return []
        return [{**self._chunk(""), "choices": [], "usage": self.usage(dones), "timings": self.timings(dones)}]

    def final(self, texts: list[str], logprobs: list, dones: list[Done]) -> dict:
        choices = [{"index": i, "text": text, "logprobs": self.logprobs(lps, i), "finish_reason": done.finish_reason}
                   for i, (text, lps, done) in enumerate(zip(texts, logprobs, dones))]
        return {**self._chunk(""), "choices": choices, "usage": self.usage(dones), "timings": self.timings(dones)}


class LlamaFormat(_Format):
    """llama-server's /completion (one choice)."""

    done_marker = False

    def __init__(self, state, req, job_id, prompt_text=None):
        super().__init__(state, req, job_id)
        self.prompt_text = prompt_text

    def probs(self, entries) -> list[dict]:
        """llama-server's completion_probabilities (post_sampling_probs false): per token its id,
        text, bytes and logprob, and the n_probs most likely tokens likewise."""
        out = []
        for e in entries:
            text, b = self.token(e.token)
            top = []
            for t, lp in e.top:
                tt, tb = self.token(t)
                top.append({"id": t, "token": tt, "bytes": tb, "logprob": _lp(lp)})
            out.append({"id": e.token, "token": text, "bytes": b, "logprob": _lp(e.logprob), "top_logprobs": top})
        return out

    def text(self, text, index=0, logprobs=None):
        chunk = {"content": text, "stop": False, "id_slot": self.slot, "index": 0, "tokens": []}
        if logprobs is not None:
            chunk["completion_probabilities"] = self.probs(logprobs)
        return [chunk]

    def _summary(self, done: Done) -> dict:
        return {"id_slot": done.slot, "index": 0, "stop": True, "model": self.model,
                "tokens_predicted": done.completion_tokens, "tokens_evaluated": done.prompt_tokens,
                "generation_settings": self.settings, "prompt": self.prompt_text or "",
                "has_new_line": False, "truncated": False, "stop_type": done.stop_type,
                "stopping_word": done.stopping_word, "tokens_cached": done.prompt_tokens + done.completion_tokens,
                "timings": done.timings}

    def end(self, done: Done, index=0):
        return [{"content": "", "tokens": [], **self._summary(done)}]

    def final(self, texts: list[str], logprobs: list, dones: list[Done]) -> dict:
        out = {"content": texts[0], "tokens": [], **self._summary(dones[0]), "has_new_line": "\n" in texts[0]}
        if logprobs[0] is not None:
            out["completion_probabilities"] = self.probs(logprobs[0])
        return out


# --- generation -------------------------------------------------------------------------------------------
async def _next_event(request: web.Request, events: asyncio.Queue):
    """The job's next event; ClientGone when the client hung up meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), 0.5)
        except asyncio.TimeoutError:
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone() from None


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def choice_params(params, index: int):
    """Choice i of an n > 1 request samples with seed + i (mod 2^64) when the request has a seed,
    so the choices differ and each is reproducible; without one each draws its own random seed."""
    if index == 0 or params.seed is None:
        return params
    return attrs.evolve(params, seed=(params.seed + index) % 2**64)


async def generate(request: web.Request, req: GenRequest, fmt_cls) -> web.StreamResponse:
    state = request.app[STATE]
    if req.n > state.config.n_slots:
        raise bad(f"'n' is {req.n}, more than this server's {state.config.n_slots} slots (-np): "
                  f"the choices of a request run at the same time", param="n")
    prompt = await _blocking(build_prompt, state, req)
    n, n_ctx = len(prompt), state.n_ctx
    if n == 0:
        raise bad("the prompt is empty")
    if n >= n_ctx:
        raise ApiError(400, f"the prompt has {n} tokens, more than the context holds: {n_ctx} tokens "
                            f"(the prompt plus at least one new token)", "exceed_context_size_error",
                       n_prompt_tokens=n, n_ctx=n_ctx)
    key = "n_predict" if req.endpoint == "completion" else "max_tokens"
    if req.max_tokens is not None and req.max_tokens >= n_ctx:
        raise bad(f"'{key}' is {req.max_tokens}, beyond the context size of {n_ctx} tokens "
                  f"(at most {n_ctx - 1}, less the prompt)", param=key)
    max_new = n_ctx - n if req.max_tokens is None else min(req.max_tokens, n_ctx - n)
    constraints = [None] * req.n
    # A forced tool call (tool_choice required or named) is held to its function's schema; it
    # takes the place of response_format, which is for the text answer a forced call replaces.
    spec = (tool_call_grammar(req.tools, state.tokenizer) if req.tools is not None else None) or req.grammar
    if spec is not None:  # compiled and checked before queueing: a bad schema is a 400 now
        grammar = await _blocking(state.grammars.compile, spec)
        constraints = await _blocking(lambda: [state.grammars.constraint(grammar) for _ in range(req.n)])

    prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "completion": "cmpl-"}[req.endpoint]
    job_id = prefix + uuid.uuid4().hex[:24]
    fmt = fmt_cls(state, req, job_id, req.prompt_text)
    fmt.settings = generation_settings(state, req.params, req.max_tokens, req.stops, req.stream, req.spec)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    jobs: list[Job] = []

    def emitter(index: int):
        def emit(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                jobs[index].cancelled = True
        return emit

    for i in range(req.n):
        job = Job(job_id if req.n == 1 else f"{job_id}/{i}", req.endpoint, prompt, max_new, choice_params(req.params, i),
                  req.stops, emitter(i), req.spec, req.cache_prompt, logprobs=req.logprobs, constraint=constraints[i])
        job.settings = fmt.settings
        jobs.append(job)
    jobs[0].siblings = jobs[1:]
    try:
        state.worker.submit(jobs[0])
    except QueueFull as e:
        raise ApiError(503, f"the server is busy ({e}); try again later") from None
    try:
        while fmt.slot < 0:  # all choices start together (the worker admits them at once), the first first
            index, event = await _next_event(request, events)
            if event[0] == "error":
                raise event[1]
            if index == 0:
                fmt.slot = event[1]
        if req.stream:
            return await _stream(request, fmt, events, req.n)
        return await _collect(request, fmt, events, req.n)
    finally:  # done, failed, or the client went away (ClientGone, ConnectionResetError, CancelledError)
        for job in jobs:
            if not job.finished:
                state.worker.cancel(job)


async def _collect(request, fmt, events, n: int) -> web.Response:
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list | None] = [None] * n
    dones: list[Done | None] = [None] * n
    while any(d is None for d in dones):
        index, (kind, value, *rest) = await _next_event(request, events)
        if kind == "start":
            continue
        if kind == "text":
            texts[index].append(value)
            if rest[0] is not None:
                logprobs[index] = (logprobs[index] or []) + list(rest[0])
        elif kind == "done":
            dones[index] = value
        else:
            raise value
    if fmt.req.logprobs is not None:
        logprobs = [lp or [] for lp in logprobs]
    return _json(fmt.final(["".join(t) for t in texts], logprobs, dones))


async def _stream(request, fmt, events, n: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    dones: list[Done | None] = [None] * n
    try:
        for index in range(n):
            for chunk in fmt.start(index):
                await resp.write(_sse(chunk))
        while any(d is None for d in dones):
            index, (kind, value, *rest) = await _next_event(request, events)
            if kind == "start":
                continue
            if kind == "text":
                for chunk in fmt.text(value, index, rest[0]):
                    await resp.write(_sse(chunk))
            elif kind == "done":
                dones[index] = value
                for chunk in fmt.end(value, index):
                    await resp.write(_sse(chunk))
            else:  # headers are gone: the error travels as an event
                await resp.write(_sse(value.body()))
                break
        else:
            for chunk in fmt.usage_chunks(dones):
                await resp.write(_sse(chunk))
        if fmt.done_marker:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        raise ClientGone() from None
    return resp

# --- handlers ---------------------------------------------------------------------------------------------
async def chat_completions(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_chat(body, state.config.defaults, state.spec_enabled, state.spec_known, state.config.limits)
    req.tools = parse_tools(body)
    return await generate(request, req, ChatFormat)


async def completions(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_completion(body, "completions", state.config.defaults, state.spec_enabled, state.spec_known,
                           state.tokenizer.n_vocab, state.config.limits)
    return await generate(request, req, CompletionsFormat)


async def completion(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    req = parse_completion(body, "completion", state.config.defaults, state.spec_enabled, state.spec_known,
                           state.tokenizer.n_vocab, state.config.limits)
    return await generate(request, req, LlamaFormat)


async def tokenize(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    content = body.get("content")
    if content is None:
        raise bad("'content' is required", param="content")
    content = get_str(body, "content")
    add_special = get_bool(body, "add_special", False)
    parse_special = get_bool(body, "parse_special", True)
    with_pieces = get_bool(body, "with_pieces", False)
    tok = state.tokenizer

    def run():
        check_prompt_bytes(content, state.max_prompt_bytes, "content")
        ids = tok.encode(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return {"tokens": ids}
        out = []
        for i in ids:
            piece = tok.token_bytes(i, True)
            try:
                out.append({"id": i, "piece": piece.decode("utf-8")})
            except UnicodeDecodeError:
                out.append({"id": i, "piece": list(piece)})
        return {"tokens": out}

    return _json(await _blocking(run))


async def detokenize(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    tokens = get_tokens(body.get("tokens", []), "tokens", state.tokenizer.n_vocab)
    return _json({"content": await _blocking(state.tokenizer.decode, tokens)})


async def apply_template(request: web.Request):
    state = request.app[STATE]
    body = await read_json(request)
    messages = parse_messages(body, state.config.limits)

    def run():
        try:
            return state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:
            raise bad(f"the chat template could not render the messages: {e}") from None

    return _json({"prompt": await _blocking(run)})


async def models(request: web.Request):
    state = request.app[STATE]
    info = getattr(state.model, "info", None)
    meta = {}
    if info is not None:
        meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                "n_layers": info.n_layers, "size": info.file_bytes, "architecture": info.architecture}
    return _json({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                              "owned_by": "speculant", "meta": meta}]})


async def health(request: web.Request):
    state = request.app[STATE]
    if state.worker.died is not None or not state.worker.alive:  # died: set before the thread has ended
        raise ApiError(503, "the engine thread is not running" + (f" ({state.worker.died})" if state.worker.died else ""))
    if state.worker.draining:
        raise ApiError(503, "the server is shutting down")
    return _json({"status": "ok"})


async def props(request: web.Request):
    state = request.app[STATE]
    d = state.config.defaults
    tok = state.tokenizer
    c = state.engine.config
    return _json({
        "default_generation_settings": {"id": 0, "n_ctx": state.n_ctx,
                                        "params": generation_settings(state, d.params, None if d.n_predict < 0 else d.n_predict,
                                                                      [], False, None)},
        "total_slots": state.config.n_slots, "model_alias": state.model_name, "model_path": state.model_path,
        "chat_template": getattr(tok, "chat_template", None) or CHATML_TEMPLATE,
        "bos_token": tok.bos_text, "eos_token": tok.eos_text, "build_info": "speculant",
        "modalities": {"vision": False, "audio": False}, "endpoint_slots": True, "endpoint_metrics": True,
        "speculative": {"types": state.spec_enabled, "available": state.spec_known, "n_max": c.draft_n_max,
                        "n_min": c.draft_n_min, "p_min": c.draft_p_min, "adaptive": c.adaptive,
                        "draft_model": state.config.draft_model,
                        # spec type -> why, for those the watchdog took out (see --spec-deadline)
                        "quarantined": {name: str(why) for name, why in dict(state.engine.chain.quarantined).items()},
                        # recurrent/hybrid targets: how partial acceptances went back (see --spec-use-checkpoints)
                        **({"recurrent": {"mode": "checkpoint-replay" if state.engine.config.spec_use_checkpoints else "per-row",
                                          **attrs.asdict(state.engine.recurrent_stats)}} if state.engine.recurrent else {})},
    })


async def slots(request: web.Request):
    state = request.app[STATE]
    out = []
    for i, job in enumerate(list(state.worker.slots)):
        kept = state.worker.cache.slots[i]
        entry = {"id": i, "n_ctx": state.n_ctx, "speculative": bool(state.spec_enabled), "is_processing": job is not None,
                 "n_cache_tokens": job.seq.n_cached if job is not None and job.seq is not None else len(kept.tokens) if kept else 0}
        if job is not None:
            entry.update(id_task=job.id, params=getattr(job, "settings", {}), prompt_n=len(job.prompt),
                         next_token={"has_next_token": True, "n_decoded": job.n_generated,
                                     "n_remain": job.max_new_tokens - job.n_generated})
        else:
            entry["id_task"] = -1
        out.append(entry)
    return _json(out)


async def _on_engine(state: State, fn):
    """fn() on the engine thread between two steps (the only thread that may touch the engine)."""
    return await asyncio.wrap_future(state.worker.call(fn))


async def slot_action(request: web.Request):
    """llama-server's POST /slots/ID?action=save|restore|erase. The files are read and written in
    the executor, not on the engine thread: a slot file is tens of MB, and other slots' requests
    go on generating meanwhile; only copying the state out or in runs between two engine steps."""
    state = request.app[STATE]
    action, raw, n_slots = request.query.get("action"), request.match_info["id_slot"], state.config.n_slots
    if action not in ("save", "restore", "erase"):
        raise bad("the 'action' query parameter is required: save, restore or erase" if action is None
                  else f"'action' must be save, restore or erase, got {action!r}", param="action")
    if not (raw.isascii() and raw.isdigit() and len(raw) < 10 and int(raw) < n_slots):
        raise bad(f"there is no slot {raw!r}: slot ids are 0 to {n_slots - 1}", param="id_slot")
    slot, worker = int(raw), state.worker
    if action == "erase":
        n = await _on_engine(state, lambda: slot_files.erase(worker, slot))
        log.info("slot erased", slot=slot, n_tokens=n)
        return _json({"id_slot": slot, "n_erased": n})
    folder = state.config.slot_save_path
    if not folder:
        raise ApiError(501, f"slot {action} is off: start the server with --slot-save-path DIR")
    if state.engine.recurrent or not hasattr(state.engine.context, "get_state"):
        raise ApiError(501, f"slot {action} is not supported for this model: its state cannot be saved to a file")
    filename = slot_files.check_filename((await read_json(request)).get("filename"))
    path, meta = slot_files.path_in(folder, filename), slot_files.model_meta(state.model)
    t0 = time.perf_counter()
    try:
        if action == "save":
            snap = await _on_engine(state, lambda: slot_files.snapshot(worker, slot))
            n, n_bytes = len(snap.tokens), await _blocking(slot_files.write, path, snap, meta)
        else:
            try:
                snap, n_bytes = await _blocking(slot_files.read, path, filename, meta, int(meta["n_vocab"]),
                                                slot_files.max_file_bytes(state.engine.context, int(meta["n_embd"] or 0)))
            except FileNotFoundError:
                raise ApiError(404, f"there is no slot file '{filename}' in the --slot-save-path folder") from None
            n = await _on_engine(state, lambda: slot_files.install(worker, slot, snap, filename))
    except slot_files.SlotFileError as e:
        raise bad(str(e)) from None
    except IsADirectoryError:
        raise bad(f"'{filename}' is a folder in the --slot-save-path folder, not a slot file") from None
    except OSError as e:  # the server's disk or permissions (the folder is gone, ...), not the request
        raise ApiError(500, f"could not {action} slot file '{filename}': {e.strerror or e}") from None
    ms = (time.perf_counter() - t0) * 1e3
    log.info(f"slot {action}d", slot=slot, filename=filename, n_tokens=n, n_bytes=n_bytes, ms=round(ms, 1))
    if action == "save":
        return _json({"id_slot": slot, "filename": filename, "n_saved": n, "n_written": n_bytes, "timings": {"save_ms": ms}})
    return _json({"id_slot": slot, "filename": filename, "n_restored": n, "n_read": n_bytes, "timings": {"restore_ms": ms}})


async def metrics_handler(request: web.Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    state = request.app[STATE]
    return web.Response(body=metrics.render(state.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- the app ------------------------------------------------------------------------------------------------
SHUTDOWN_FLUSH = 1.0  # seconds of the shutdown timeout kept for the stopped requests' errors to go out


def drain_seconds(shutdown_timeout: float) -> float:
    """How long running requests may go on after SIGTERM, of `shutdown_timeout` in all."""
    return max(0.0, shutdown_timeout - min(SHUTDOWN_FLUSH, shutdown_timeout / 2))

def create_app(engine: Engine, config: ServerConfig = ServerConfig(), spec_known: list[str] | None = None) -> web.Application:
    """The application around `engine`; its engine thread starts with the app and stops with it."""
    app = web.Application(client_max_size=config.max_body_size, middlewares=[errors_middleware, auth_middleware],
                          handler_args={"keepalive_timeout": config.keepalive_timeout})
    state = State(engine, config, spec_known)
    app[STATE] = state
    shutdown_started: list[float] = []

    async def on_startup(app):
        state.worker.start()

    async def on_shutdown(app):
        """SIGTERM (aiohttp has stopped listening and closed idle connections): 503 for new and
        waiting requests, then the running ones may finish until SHUTDOWN_FLUSH seconds before
        the shutdown timeout; whatever still runs then gets a 503 error (an error event and
        [DONE] on a stream), so every client hears how its request ended."""
        loop = asyncio.get_running_loop()
        shutdown_started.append(loop.time())
        worker = state.worker
        worker.begin_shutdown()
        deadline = loop.time() + drain_seconds(config.shutdown_timeout)
        if worker.running():
            log.info("shutting down: waiting for running requests", n=len(worker.running()),
                     timeout_s=config.shutdown_timeout)
        while worker.running() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        n = worker.abort_running(ApiError(503, f"the server is shutting down: the request did not finish within "
                                               f"the shutdown timeout ({config.shutdown_timeout:g} s)"))
        if n:
            log.warning("shutting down: stopped running requests", n=n)

    async def on_cleanup(app):
        # The engine thread ends after its current step; a long one is not waited for past the
        # shutdown timeout (the thread is a daemon: the process exits without it).
        left = config.shutdown_timeout - (asyncio.get_running_loop().time() - shutdown_started[0]) if shutdown_started else 10.0
        await _blocking(state.worker.stop, max(0.1, left))

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    r = app.router
    for path in ("/v1/chat/completions", "/chat/completions"):
        r.add_post(path, chat_completions)
    for path in ("/v1/completions", "/completions"):
        r.add_post(path, completions)
    r.add_post("/completion", completion)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/apply-template", apply_template)
    for path in ("/v1/models", "/models"):
        r.add_get(path, models)
    for path in ("/health", "/v1/health"):
        r.add_get(path, health)
    r.add_get("/props", props)
    r.add_get("/slots", slots)
    r.add_post("/slots/{id_slot}", slot_action)
    r.add_get("/metrics", metrics_handler)
    return app
