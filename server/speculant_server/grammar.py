"""Structured outputs: `response_format`, llama-server's `grammar` and `json_schema`, as llguidance
constraints on the engine's sequences (speculant.Constraint).

llguidance was chosen by measurement (docs/server.md, "Structured outputs"; scripts/grammar_engines.py):
on the 1.5B's 151,936-token vocabulary a next-token mask costs 0.02-0.03 ms, a JSON schema compiles
in about 1 ms, and its wheel has no dependencies (xgrammar brings transformers and triton).

The engine's vocabulary object is built from the model's own tokenizer (speculant.gguf), never
downloaded: each token's bytes, control tokens (and user-defined ones that look like them,
`<tool_call>`) marked as special so that no grammar matches their text, the end-of-generation
tokens as its EOS. It is built once per server, on the first request that needs it (0.4 s).
"""
from __future__ import annotations

import json
import threading
from typing import Sequence

import numpy as np
import torch

from speculant_server.protocol import GrammarSpec, bad

# JSON as json.dumps writes it on one line: ", " between items, ": " after keys, no other
# whitespace. Fixed separators leave the model no whitespace to loop in (a small model may write
# newlines for ever where they are allowed), and every separator is a token the grammar forces,
# so the grammar drafter drafts it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class _TokenizerWrapper:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS and BOS ids, a tokenize call."""

    def __init__(self, tokenizer, n_vocab: int):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        tokens, special = [], []
        user_defined = getattr(tokenizer, "is_user_defined", lambda i: False)
        for i in range(n_vocab):
            b = tokenizer.token_bytes(i, True) if i < tokenizer.n_vocab else b""
            # control tokens, and user-defined ones that look like them (llama.cpp's rule)
            if i < tokenizer.n_vocab and (tokenizer.is_control(i) or (b[:1] == b"<" and b[-1:] == b">" and user_defined(i))):
                special.append(i)
                b = b"\xff" + b  # llguidance's mark of a special token: its text is not text
            tokens.append(b)
        self.tokens, self.special_token_ids = tokens, special
        self._byte_ids = {b[0]: i for i, b in enumerate(tokens) if len(b) == 1}

    def __call__(self, s) -> list[int]:
        """Tokens for a text (bytes or str). Bytes that are not UTF-8 (a cut character) end as
        single-byte tokens."""
        if isinstance(s, str):
            return self._tok.encode(s, add_special=False, parse_special=False)
        try:
            return self._tok.encode(s.decode("utf-8"), add_special=False, parse_special=False)
        except UnicodeDecodeError as e:
            head = self._tok.encode(s[: e.start].decode("utf-8"), add_special=False, parse_special=False) if e.start else []
            return head + [self._byte_ids[b] for b in s[e.start:] if b in self._byte_ids]


class Grammars:
    """Compiles requests' grammars for one tokenizer and makes their constraints."""

    def __init__(self, tokenizer, n_vocab: int):
        self.tokenizer, self.n_vocab = tokenizer, n_vocab
        self.eog = sorted(getattr(tokenizer, "eog_ids", ()) or ())
        self._lltok = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                wrapper = llguidance.TokenizerWrapper(_TokenizerWrapper(self.tokenizer, self.n_vocab))
                self._lltok = llguidance.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=self.eog or None)
            return self._lltok

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for the request, checked against the vocabulary; a 400 naming the
        problem (the engine's message, on one line) when it is not a valid schema or grammar."""
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        def refused(reason) -> Exception:
            return bad(f"'{spec.param}' is not a valid {_what(spec)}: {_one_line(reason)}", param=spec.param)

        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
            elif spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.value))
            error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:
            raise refused(e) from None
        except BaseException as e:  # a Rust panic is a BaseException (pyo3's PanicException)
            raise refused(f"the grammar engine failed on it ({type(e).__name__}: {e})") from None
        if error:
            raise refused(error)
        return grammar

    def constraint(self, grammar: str) -> "GrammarConstraint":
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.lltokenizer(), grammar, log_level=0)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # it raises nothing for a bad grammar (compile said so), but a panic is possible
            raise bad(f"the grammar engine failed on the request's grammar ({type(e).__name__}: {_one_line(e)})") from None
        return GrammarConstraint(matcher, self.n_vocab)


def _what(spec: GrammarSpec) -> str:
    return {"json": "JSON schema", "gbnf": "GBNF grammar"}.get(spec.kind, "set of tools (their parameters schemas)")


def tool_call_grammar(tools, tokenizer, close: str = "</tool_call>") -> GrammarSpec | None:
    """The rest of a Hermes tool call after the opening the prompt already holds
    (tools.ToolRequest.prefix()), as a llguidance Lark grammar: for a named function its
    arguments, valid against its `parameters` schema, then `}`, a newline and `</tool_call>`;
    under "required" with several tools first one of their names, then that function's arguments
    likewise. One call (the end-of-turn token comes next). None where no call is forced."""
    if tools.choice not in ("function", "required"):
        return None
    ids = tokenizer.encode(close, add_special=False, parse_special=True)
    end = f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in _specials(tokenizer, ids) else json.dumps(close)

    def args(fn: dict) -> str:
        schema = fn.get("parameters") or {"type": "object"}
        return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})

    fns = {t["function"]["name"]: t["function"] for t in tools.tools}
    lines = ["%llguidance {}"]
    if tools.choice == "function":
        lines += [f'start: args "}}\\n" {end}', f"args: {args(fns[tools.name])}"]
    else:
        names = list(fns)
        lines.append("start: " + " | ".join(f"call_{i}" for i in range(len(names))))
        for i, name in enumerate(names):
            head = json.dumps(name + '", "arguments": ')  # the name's end and the arguments' key, as a Lark string
            lines.append(f'call_{i}: {head} args_{i} "}}\\n" {end}')
            lines.append(f"args_{i}: {args(fns[name])}")
    return GrammarSpec("lark", "\n".join(lines) + "\n", "tools")


def _specials(tokenizer, ids: list[int]) -> set[int]:
    return {i for i in ids if tokenizer.is_control(i) or getattr(tokenizer, "is_user_defined", lambda i: False)(i)}


class GrammarConstraint:
    """One sequence's llguidance matcher as a speculant.Constraint."""

    def __init__(self, matcher, n_vocab: int):
        # The bitmask is filled through the matcher's own pointer call: llguidance.torch would do
        # the same but imports torch.compile's machinery (1.5 s on the first request here).
        self.matcher, self.n_vocab = matcher, n_vocab
        self._bits = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
        self.error: str | None = None  # what put the matcher in its error state (it then allows nothing)

    def _call(self, fn, *args, fallback=None):
        """A matcher call. A Rust panic (pyo3's PanicException, a BaseException) must not reach
        the engine thread, which would die of it: it puts this constraint in its error state
        instead, where it allows nothing and the sequence ends (apply_mask's end-of-generation)."""
        if self.error is not None:
            return fallback
        try:
            return fn(*args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            self.error = f"{type(e).__name__}: {_one_line(e)}"
            return fallback

    def _fill(self) -> bool:
        if self.matcher.is_error():
            self.error = self.error or _one_line(self.matcher.get_error())
            return False
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return True

    def mask(self) -> torch.Tensor:
        if not self._call(self._fill, fallback=False):
            return torch.zeros(self.n_vocab, dtype=torch.bool)
        # numpy's unpackbits, one thread: the same bits by torch shifts went through its thread
        # pool, which took 25 ms a call on a busy 2-core box (0.05 ms idle)
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[: self.n_vocab]
        return torch.from_numpy(bits).bool()

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            self.error = _one_line(self.matcher.get_error())

    def advance(self, token: int) -> None:
        self._call(self._consume, token)

    def rollback(self, n: int) -> None:
        if n > 0:
            self._call(self.matcher.rollback, n)

    def forced(self) -> list[int]:
        return list(self._call(self.matcher.compute_ff_tokens, fallback=[]))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self._call(self.matcher.validate_tokens, list(tokens), fallback=0)
