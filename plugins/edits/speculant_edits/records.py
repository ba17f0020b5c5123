"""The prompt's records written again in another layout: the next records drafted.

Asked to turn the prompt's records into a table, a CSV, a YAML list or code (JSON objects into
Markdown rows, say), an answer writes each record the same way: the same text around its values,
the values copied from the prompt, one record after the other. A copying speculator drafts the
text around the values but not the values (the previous record's are wrong, the prompt's copy
goes on in the prompt's layout), and copy-edits' alignment loses the copy at every value, so each
record took several short drafts (extract-table: about 2 tokens a step).

`Template.learn` compares the answer's last two records (a record: one line or a few). The last
one's values are the longest pieces from a word's start that the prompt holds (`project-7`,
`Fast JSON parser`); the rest is literal text, which the record before must have around its own
values, and values the same in both are literal too. It finds where in the prompt each record's
values come from (the last record's nearest after the one before's) and, for each field, the
prompt text just before its value in both records (its context: `"name": "` in JSON) and just
after (its end: `"`). `Template.text` then writes the following records: the same literal text,
each field's value the prompt's text from its context's next occurrence to its end, record after
record. Where a context does not come again, or a record's values are not the prompt's,
nothing is drafted.

This works on text, not tokens: a value is often a different token in the answer than in the
prompt (` Go` after `| `, `Go` after `"`). `RecordLines` takes a sequence's tokens to text and the
records drafted back to the tokens the model writes.
"""
from __future__ import annotations

import re

import attrs

WORD = re.compile(r"\w+(?:[-.]\w+)*")  # a word: `project-7`, `1.5`, `Go`
MAX_CONTEXT = 32  # characters of prompt text before a value that say which field it is
MAX_END = 8  # characters of prompt text after a value that end it
MAX_VALUE = 256  # a value runs no longer than this (else its end was not found where it should be)
MAX_STARTS = 256  # occurrences of a first value tried when placing a record's values
RECORD_CHARS_PER_TOKEN = 8  # the record text written for a draft of n tokens: 8n characters, enough
MAX_AHEAD_TOKENS = 64  # records written for at most this many tokens a draft
MAX_RECORD_LINES = 4  # records of up to this many lines (a YAML item, a small object)
LEARNED_KEPT = 64  # templates kept per sequence (a record's lines are tried at every step)


def _wordy(c: str) -> bool:
    return c.isalnum() or c == "_"


def whole_at(text: str, value: str, i: int) -> bool:
    """Whether `value` at text[i] is not a piece of a longer word on either side."""
    if _wordy(value[0]) and i > 0:
        before = text[i - 1]
        if _wordy(before) or (before in "-." and i >= 2 and _wordy(text[i - 2])):
            return False
    j = i + len(value)
    return not (_wordy(value[-1]) and j < len(text) and _wordy(text[j]))


def find_value(text: str, value: str, start: int) -> int:
    """The first position >= start where `value` stands whole in text, or -1."""
    i = text.find(value, start)
    while i >= 0 and not whole_at(text, value, i):
        i = text.find(value, i + 1)
    return i


def place(text: str, values: list[str], start: int) -> list[int] | None:
    """Where the values stand in text in order, each the first after the one before, from start."""
    out, pos = [], start
    for v in values:
        i = find_value(text, v, pos)
        if i < 0:
            return None
        out.append(i)
        pos = i + len(v)
    return out


def place_compact(text: str, values: list[str]) -> list[int] | None:
    """The placement of the values that spans the least text (a record's fields lie together)."""
    best, best_span, i, tried = None, None, find_value(text, values[0], 0), 0
    while i >= 0 and tried < MAX_STARTS:
        rest = place(text, values[1:], i + len(values[0]))
        if rest is not None:
            span = (rest[-1] + len(values[-1]) if rest else i + len(values[0])) - i
            if best_span is None or span < best_span:
                best, best_span = [i, *rest], span
        i = find_value(text, values[0], i + 1)
        tried += 1
    return best


def common_suffix(a: str, b: str, limit: int) -> str:
    n = 0
    while n < limit and n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


def common_prefix(a: str, b: str, limit: int) -> str:
    n = 0
    while n < limit and n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return a[:n]


def longest_in(prompt: str, text: str, i: int) -> int:
    """The length of the longest piece of text from i that stands in the prompt (up to MAX_VALUE
    characters, no newline)."""
    hi = min(len(text) - i, MAX_VALUE)
    nl = text.find("\n", i, i + hi)
    if nl >= 0:
        hi = nl - i
    lo = 0
    while lo < hi:  # the longest m with text[i:i + m] in the prompt (any shorter one is too)
        m = (lo + hi + 1) // 2
        if prompt.find(text[i : i + m]) >= 0:
            lo = m
        else:
            hi = m - 1
    return lo


def segment(last: str, prompt: str) -> list[str | None]:
    """`last` as literal text (str) and values (None, each followed by its text): a value starts
    at a word's start and is the longest piece from there that the prompt holds, ending where a
    word does; the rest is literal."""
    out: list[str | None] = []
    lit, i = [], 0
    while i < len(last):
        if _wordy(last[i]) and (i == 0 or not _wordy(last[i - 1])):
            m = longest_in(prompt, last, i)
            while m > 0 and i + m < len(last) and _wordy(last[i + m - 1]) and _wordy(last[i + m]):
                m -= 1  # not a piece of a word
            while m > 0 and last[i + m - 1].isspace():
                m -= 1  # nor the space after it (the prompt's `C is` is not `C |`'s)
            if i + m < len(last) and _wordy(last[i + m]):
                while m > 0 and not _wordy(last[i + m - 1]):
                    m -= 1  # a word follows: what stands between is literal (`185,Filename`: the `,`)
            if m > 0:
                out.extend(["".join(lit), None, last[i : i + m]])
                lit, i = [], i + m
                continue
        lit.append(last[i])
        i += 1
    out.append("".join(lit))
    return out


def fields(before: str, last: str, prompt: str) -> tuple[list[str | int], list[str], list[str]] | None:
    """`last` as its literal text and fields (their index), each field's value in `before` and in
    `last`: the values are what `last` has from the prompt (segment), and `before` must be the same
    literal text around other values. None where it is not, or where no value differs."""
    seg = segment(last, prompt)
    literals = seg[0::3]  # literal, None, value, literal, None, value, ..., literal
    values = seg[2::3]
    if not values or any(lit == "" for lit in literals[1:-1]) or not before.startswith(literals[0]):
        return None
    old, pos = [], len(literals[0])
    for lit in literals[1:-1]:
        j = before.find(lit, pos + 1)
        if j < 0:
            return None
        old.append(before[pos:j])
        pos = j + len(lit)
    tail = literals[-1]
    if len(before) - len(tail) <= pos or not before.endswith(tail):
        return None
    old.append(before[pos : len(before) - len(tail)])
    parts: list[str | int] = [literals[0]]
    fold_old: list[str] = []
    fold_new: list[str] = []
    for a, b, lit in zip(old, values, literals[1:]):
        if "\n" in a or not WORD.search(a):
            return None
        if a == b:  # the same in both records: literal text
            parts[-1] += b + lit
            continue
        parts.append(len(fold_new))
        parts.append(lit)
        fold_old.append(a)
        fold_new.append(b)
    return (parts, fold_old, fold_new) if fold_new else None


@attrs.frozen
class Template:
    """A record's literal text and fields (their index), each field's context and end in the prompt;
    `cursor`: where in the prompt the last learned record's values end (the next record's follow)."""

    parts: tuple[str | int, ...]
    contexts: tuple[str, ...]
    ends: tuple[str, ...]  # "" where the values' ends differ: the value is then a word
    cursor: int

    @classmethod
    def learn(cls, before: str, last: str, prompt: str) -> "Template | None":
        """The template of the record `last` given the record `before` it, or None where they
        differ other than in fields, or their values are not the prompt's records."""
        found = fields(before, last, prompt)
        if found is None:
            return None
        parts, old, new = found
        at0 = place_compact(prompt, old)
        if at0 is None:
            return None
        at1 = place(prompt, new, at0[-1] + len(old[-1]))
        if at1 is None:
            return None
        # a context reaches back no further than the value before it in either record (it is
        # looked for from where that value ends)
        gap = [MAX_CONTEXT] + [min(at0[f] - at0[f - 1] - len(old[f - 1]), at1[f] - at1[f - 1] - len(new[f - 1]))
                               for f in range(1, len(new))]
        contexts = tuple(common_suffix(prompt[:i], prompt[:j], min(g, MAX_CONTEXT)) for i, j, g in zip(at0, at1, gap))
        if not all(contexts):
            return None
        ends = tuple(common_prefix(prompt[i + len(o) :], prompt[j + len(n) :], MAX_END) for i, j, o, n in zip(at0, at1, old, new))
        return cls(tuple(parts), contexts, ends, at1[-1] + len(new[-1]))

    def value(self, prompt: str, field: int, cursor: int) -> tuple[str, int] | None:
        """The field's next value in the prompt from cursor, and where it ends."""
        ctx = self.contexts[field]
        i = prompt.find(ctx, cursor)
        if i < 0:
            return None
        start = i + len(ctx)
        end = self.ends[field]
        if end:
            # the end as it came in both records, or the longest start of it found (the last
            # record ends the list: `"\n"` where a next record followed is `"\n` there)
            for n in range(len(end), 0, -1):
                j = prompt.find(end[:n], start, start + MAX_VALUE + n)
                if j > start and "\n" not in prompt[start:j]:
                    return prompt[start:j], j
            return None
        m = WORD.match(prompt, start)
        return (m.group(), m.end()) if m else None

    def text(self, prompt: str, n_chars: int) -> str:
        """The records after the learned one, each ended by a newline, until n_chars are written
        or a field's context does not come again (then up to that field)."""
        out: list[str] = []
        written, cursor = 0, self.cursor
        while written < n_chars:
            record: list[str] = []
            for part in self.parts:
                if isinstance(part, str):
                    record.append(part)
                    continue
                found = self.value(prompt, part, cursor)
                if found is None:
                    return "".join(out) + "".join(record)
                record.append(found[0])
                cursor = found[1]
            out.append("".join(record) + "\n")
            written += len(out[-1])
        return "".join(out)


class RecordLines:
    """One sequence's records drafts: the prompt's text (once) and the templates learned."""

    def __init__(self, tokenizer, prompt: tuple[int, ...]):  # tokenizer: speculant.gguf.tokenizer.Tokenizer
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.prompt_text = tokenizer.decode(prompt)
        self._learned: dict[tuple[str, str], Template | None] = {}

    def template(self, before: str, last: str) -> Template | None:
        key = (before, last)
        if key not in self._learned:
            if len(self._learned) >= LEARNED_KEPT:
                self._learned.clear()
            self._learned[key] = Template.learn(before, last, self.prompt_text)
        return self._learned[key]

    def ahead(self, lines: list[str], complete_first: bool,
              n_chars: int = RECORD_CHARS_PER_TOKEN * MAX_AHEAD_TOKENS) -> tuple[str, str] | None:
        """(the current record written so far, the text from its start that the template of the
        last two records writes, n_chars past it or more), trying records of 1 to MAX_RECORD_LINES
        lines and each line of the current record as the place reached in it: the first template
        the current record so far follows. `lines`: the answer's last lines, the last one
        unfinished."""
        n = len(lines) - 1  # complete lines
        usable = n if complete_first else n - 1  # a first line cut by the tail is not one
        for k in range(1, MAX_RECORD_LINES + 1):
            for p in range(k):  # complete lines of the current record written
                if 2 * k + p > usable:
                    break
                cut = len(lines) - 1 - p
                t = self.template("\n".join(lines[cut - 2 * k : cut - k]), "\n".join(lines[cut - k : cut]))
                if t is None:
                    continue
                current = "\n".join(lines[cut:])
                text = t.text(self.prompt_text, n_chars + len(current))
                if len(text) > len(current) and text.startswith(current):
                    return current, text
        return None

    def draft(self, answer: tuple[int, ...], n_max: int) -> tuple[int, ...] | None:
        tok = self.tokenizer
        # the answer's last lines, each token's bytes: enough for two records of MAX_RECORD_LINES
        # and the current one
        pieces: list[bytes] = []
        first, newlines = len(answer), 0
        while first > 0 and newlines < 3 * MAX_RECORD_LINES:
            first -= 1
            pieces.append(tok.token_bytes(answer[first]))
            newlines += pieces[-1].count(b"\n")
        pieces.reverse()
        text = b"".join(pieces).decode("utf-8", errors="replace")
        if "\ufffd" in text or "\n" not in text:
            return None
        n_chars = RECORD_CHARS_PER_TOKEN * min(n_max, MAX_AHEAD_TOKENS)  # not records past what the draft takes
        found = self.ahead(text.split("\n"), complete_first=first == 0, n_chars=n_chars)
        if found is None:
            return None
        current, ahead = found
        rest = ahead[len(current) :][: RECORD_CHARS_PER_TOKEN * n_max]
        # The draft's tokens as the model writes them: the current line's own tokens (those after
        # the last one holding a newline) tokenized with its continuation, where that gives them
        # back; else the continuation alone.
        own_from = max((i + 1 for i, b in enumerate(pieces) if b"\n" in b), default=0)
        own = answer[first + own_from :]
        line = b"".join(pieces[own_from:]).decode("utf-8", errors="replace")
        whole = tok.encode(line + rest, add_special=False, parse_special=False)
        if tuple(whole[: len(own)]) == own:
            tokens = whole[len(own) :]
        else:
            tokens = tok.encode(rest, add_special=False, parse_special=False)
        return tuple(tokens[:n_max]) or None
