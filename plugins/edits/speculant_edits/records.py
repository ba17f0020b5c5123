"""The prompt's records written again in another layout, one a line: the next lines drafted.

Asked to turn the prompt's records into a table, a CSV or a list (JSON objects into Markdown
rows, say), an answer writes a line per record: the same text around each record's values, the
values copied from the prompt, one record after the other. A copying speculator drafts the text
around the values but not the values (the previous line's are wrong, the prompt's copy goes on
in the prompt's layout), and copy-edits' alignment loses the copy at every value, so each line
took several short drafts (extract-table: about 2 tokens a step).

`Template.learn` compares the answer's last two complete lines: split into runs of word and
other characters, they must have the same runs but for some words (the fields). It finds where
in the prompt each line's values come from (the previous line's nearest after the one before's)
and, for each field, the prompt text just before its value in both records (its context: `"name":
"` in JSON). `Template.text` then writes the following lines: the same runs, each field's value
the word that follows its context's next occurrence in the prompt, record after record. Where a
context does not come again, or a line's values are not the prompt's, nothing is drafted.

This works on text, not tokens: a value is often a different token in the answer than in the
prompt (` Go` after `| `, `Go` after `"`). The draft is the text tokenized (copy_edits.py).
"""
from __future__ import annotations

import re

import attrs

WORD = re.compile(r"\w+(?:[-.]\w+)*")  # a value: `project-7`, `1.5`, `Go`
RUN = re.compile(r"\w+(?:[-.]\w+)*|\W+|[-.]")
MAX_CONTEXT = 32  # characters of prompt text before a value that say which field it is
MAX_STARTS = 256  # occurrences of a first value tried when placing a line's values


def runs(line: str) -> list[str]:
    return RUN.findall(line)


def word_start(text: str, i: int) -> bool:
    """Whether a word that starts at text[i] is whole there (not the tail of a longer one)."""
    if i == 0:
        return True
    before = text[i - 1]
    if before.isalnum() or before == "_":
        return False
    return not (before in "-." and i >= 2 and (text[i - 2].isalnum() or text[i - 2] == "_"))


def find_word(text: str, word: str, start: int, end: int | None = None) -> int:
    """The first position >= start where `word` stands whole in text, or -1."""
    end = len(text) if end is None else end
    i = text.find(word, start, end)
    while i >= 0:
        m = WORD.match(text, i)
        if m is not None and m.end() == i + len(word) and word_start(text, i):
            return i
        i = text.find(word, i + 1, end)
    return -1


def place(text: str, values: list[str], start: int) -> list[int] | None:
    """Where the values stand in text in order, each the first after the one before, from start."""
    out, pos = [], start
    for v in values:
        i = find_word(text, v, pos)
        if i < 0:
            return None
        out.append(i)
        pos = i + len(v)
    return out


def place_compact(text: str, values: list[str]) -> list[int] | None:
    """The placement of the values that spans the least text (a record's fields lie together)."""
    best, best_span, i, tried = None, None, find_word(text, values[0], 0), 0
    while i >= 0 and tried < MAX_STARTS:
        rest = place(text, values[1:], i + len(values[0]))
        if rest is not None:
            span = (rest[-1] + len(values[-1]) if rest else i + len(values[0])) - i
            if best_span is None or span < best_span:
                best, best_span = [i, *rest], span
        i = find_word(text, values[0], i + 1)
        tried += 1
    return best


def common_suffix(a: str, b: str, limit: int) -> str:
    n = 0
    while n < limit and n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


@attrs.frozen
class Template:
    """A line's runs, fields as their index (int), and each field's context in the prompt;
    `cursor`: where in the prompt the last learned line's values end (the next record's follow)."""

    parts: tuple[str | int, ...]
    contexts: tuple[str, ...]
    cursor: int

    @classmethod
    def learn(cls, before: str, last: str, prompt: str) -> "Template | None":
        """The template of `last` given the line `before` it, or None where they differ in more
        than words, or their values are not the prompt's records."""
        r0, r1 = runs(before), runs(last)
        if len(r0) != len(r1) or not r1:
            return None
        parts: list[str | int] = []
        old: list[str] = []
        new: list[str] = []
        for a, b in zip(r0, r1):
            if a == b:
                parts.append(b)
            elif WORD.fullmatch(a) and WORD.fullmatch(b):
                parts.append(len(new))
                old.append(a)
                new.append(b)
            else:
                return None
        if not new:
            return None
        at0 = place_compact(prompt, old)
        if at0 is None:
            return None
        at1 = place(prompt, new, at0[-1] + len(old[-1]))
        if at1 is None:
            return None
        contexts = tuple(common_suffix(prompt[:i], prompt[:j], MAX_CONTEXT) for i, j in zip(at0, at1))
        if not all(contexts):
            return None
        return cls(tuple(parts), contexts, at1[-1] + len(new[-1]))

    def text(self, prompt: str, n_chars: int) -> str:
        """The lines after the learned one, each ended by a newline, until n_chars are written or
        a field's context does not come again (then up to that field)."""
        out: list[str] = []
        written, cursor = 0, self.cursor
        while written < n_chars:
            line: list[str] = []
            for part in self.parts:
                if isinstance(part, str):
                    line.append(part)
                    continue
                ctx = self.contexts[part]
                i = prompt.find(ctx, cursor)
                m = WORD.match(prompt, i + len(ctx)) if i >= 0 else None
                if m is None:
                    return "".join(out) + "".join(line)
                line.append(m.group())
                cursor = m.end()
            out.append("".join(line) + "\n")
            written += len(out[-1])
        return "".join(out)
