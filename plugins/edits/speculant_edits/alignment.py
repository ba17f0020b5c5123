"""The answer aligned with the text it copies, and the edits it made on the way.

A code edit's answer is the prompt's file again, changed in places: while it copies, each output
token is the prompt token after the last one copied; where it changes something it writes other
tokens, then copies again from some later point (of the prompt, or of its own earlier text). `Alignment` follows that, one output token at a
time, and records each change as an `Edit`: the prompt tokens it replaced (`src`, empty for an
insertion), what the answer wrote instead (`dst`), and the prompt tokens around it. An answer
makes the same change again where the same text comes again (a parameter renamed at every use,
the same type hints on every signature that has the same parameters): `EditBook` finds the
recorded edits that apply to the text the answer is about to copy.
"""
from __future__ import annotations

import attrs

# Output tokens that must equal earlier tokens in a row for the answer to count as copying again
# after a change (fewer: the `, x` between two hints of one signature would end the first one).
RESYNC = 4
# Longest change recorded, in tokens replaced and in tokens written: a longer stretch of
# new text is the answer writing something else, not editing what it copies.
MAX_SRC, MAX_DST = 64, 128
BEFORE = 2  # tokens ahead of a change that must be the same for it to apply again


@attrs.frozen
class Edit:
    before: tuple[int, ...]  # the BEFORE tokens ahead of the change
    src: tuple[int, ...]  # tokens of the copied text replaced
    after: int  # the token the copy resumed at
    dst: tuple[int, ...]  # what the answer wrote instead


@attrs.define
class EditBook:
    """The edits recorded, found by the text they apply to. An edit applies at position j when
    the BEFORE tokens ahead of j, its `src` from j and the token after `src` are the text's there
    (strict); a change of at least two tokens applies with only the token ahead of it the same (a
    rename at another use of the name, other text around it). Keyed by the tokens ahead, so a
    draft looks up only the edits that may apply at each of its positions.

    Not every change repeats: a docstring added under one signature is not the next one's. Each
    entry keeps a tally of the times the answer came to where it applies and made it again, or
    did not (copied on unchanged, or changed it otherwise), and is used only while it was made at
    least as often as not."""

    strict: dict[tuple[int, ...], dict[tuple, tuple[int, ...]]] = attrs.field(factory=dict)  # before -> (src, after) -> dst
    loose: dict[tuple[int, ...], dict[tuple[int, ...], tuple[int, ...]]] = attrs.field(factory=dict)  # before[-1:] -> src -> dst
    tally: dict[tuple, list[int]] = attrs.field(factory=dict)  # entry -> [made again, not]

    def add(self, edit: Edit) -> None:
        entries = self.strict.setdefault(edit.before, {})
        key = (edit.src, edit.after)
        old = entries.pop(key, None)  # re-inserted: the most recent last
        if old is not None:
            self._mark(("strict", edit.before, *key), old == edit.dst)
        entries[key] = edit.dst
        if len(edit.src) >= 2:
            loose = self.loose.setdefault(edit.before[-1:], {})
            old = loose.pop(edit.src, None)
            if old is not None:
                self._mark(("loose", edit.before[-1:], edit.src), old == edit.dst)
            loose[edit.src] = edit.dst

    def _mark(self, entry: tuple, made: bool) -> None:
        self.tally.setdefault(entry, [0, 0])[0 if made else 1] += 1

    def missed(self, entry: tuple) -> None:
        """The answer came to where the entry applies and copied on without making it."""
        self._mark(entry, False)

    def _trusted(self, entry: tuple) -> bool:
        made, not_made = self.tally.get(entry, (0, 0))
        return not_made <= made

    def __len__(self) -> int:
        """The distinct changes recorded (each has a strict entry)."""
        return sum(len(entries) for entries in self.strict.values())

    def __bool__(self) -> bool:  # asked for every token taken: no count over the entries
        return bool(self.strict)

    def at(self, text, j: int) -> tuple[int, tuple[int, ...], tuple] | None:
        """(tokens the edit replaces, tokens it writes, its entry) for an edit that applies at
        position j of text, the most recent trusted one of those that do; None if none does."""
        if j < BEFORE:
            return None
        before = tuple(text[j - BEFORE : j])
        for (src, after), dst in reversed(self.strict.get(before, {}).items()):
            end = j + len(src)
            entry = ("strict", before, src, after)
            if end < len(text) and text[end] == after and tuple(text[j:end]) == src and self._trusted(entry):
                return len(src), dst, entry
        for src, dst in reversed(self.loose.get(before[-1:], {}).items()):
            entry = ("loose", before[-1:], src)
            if tuple(text[j : j + len(src)]) == src and self._trusted(entry):
                return len(src), dst, entry
        return None


@attrs.define
class Alignment:
    """Where the answer stands in the text it copies: the prompt, or its own earlier text (an
    answer repeats itself too). `copying`: its last token was the token before `text[p]`, the
    next one it copies. Else it is writing text of its own since output position `o_left`
    (having left the copy at `p_left`, or never copied when that is None)."""

    prompt: tuple[int, ...]
    resync: int = RESYNC
    book: EditBook = attrs.field(factory=EditBook)
    text: list[int] = attrs.field(factory=list)  # the prompt, then each output token taken
    p: int = 0
    copying: bool = False
    o_left: int = 0
    p_left: int | None = None
    _index: dict[tuple[int, ...], list[int]] = attrs.field(factory=dict, repr=False)  # resync-grams -> starts, ascending
    _indexed: int = 0  # grams starting before this are in the index

    def __attrs_post_init__(self) -> None:
        self.text = list(self.prompt)
        self._index_to(len(self.text) - self.resync + 1)

    @property
    def o_done(self) -> int:
        """Output tokens taken in."""
        return len(self.text) - len(self.prompt)

    def _index_to(self, end: int) -> None:
        for j in range(self._indexed, end):
            self._index.setdefault(tuple(self.text[j : j + self.resync]), []).append(j)
        self._indexed = max(self._indexed, end)

    def take(self, output: tuple[int, ...]) -> None:
        """Take in the output tokens past those taken before."""
        while self.o_done < len(output):
            t = output[self.o_done]
            if self.copying:
                if self.p < len(self.text) and self.text[self.p] == t:
                    edit = self.book.at(self.text, self.p) if self.book else None
                    if edit is not None and edit[1][:1] != (t,):  # it applied here, and the answer copied on
                        self.book.missed(edit[2])
                    self.p += 1
                    self._append(t)
                    continue
                self.copying, self.o_left, self.p_left = False, self.o_done, self.p
            self._append(t)
            self._resync()

    def _append(self, t: int) -> None:
        self.text.append(t)
        # every gram but the last one, which a resync looks up (found there, it would be itself)
        self._index_to(len(self.text) - self.resync)

    def _resync(self) -> None:
        """Writing its own text: if its last `resync` tokens came before (after the point it left,
        the nearest such), it copies again from there, and the change is recorded."""
        if self.o_done - self.resync < self.o_left:
            return
        places = self._index.get(tuple(self.text[-self.resync:]))
        if not places:
            return
        o = self.o_done - self.resync  # where the change's text ends in the output
        lo = self.p_left if self.p_left is not None else 0
        later = [j for j in places if j >= lo]
        if self.p_left is not None and later and later[0] - self.p_left <= MAX_SRC and o - self.o_left <= MAX_DST:
            j = later[0]
            if self.p_left >= BEFORE:
                start = len(self.prompt) + self.o_left
                self.book.add(Edit(tuple(self.text[self.p_left - BEFORE : self.p_left]), tuple(self.text[self.p_left : j]),
                                   self.text[j], tuple(self.text[start : start + o - self.o_left])))
        else:
            j = (later or places)[0]  # a new place: the answer copies from elsewhere
        self.p, self.copying = j + self.resync, True

    def draft(self, n_max: int, copies: bool = False) -> tuple[int, ...] | None:
        """The next n_max tokens of the copy with the recorded edits made in it, if one applies
        within them; else None (a plain copy is any copying speculator's draft), or with `copies`
        the plain copy.

        Edits are made on copies of the prompt only. Where the answer copies its own text (the
        header of one function written again for the next, a table's row format), the "changes"
        between two such fragments are new text, not an edit made again: replayed on the
        development answers (`scripts/dev_workloads.py --many` and `--free`), every edited draft
        of the twelve edits copied the prompt (116 token positions, 2301 of 5452 draft tokens
        right), and every one of the free answers copied their own text (8 positions, 5 of 376
        right, 47-token drafts that cost a 48-row verification each)."""
        edits = self.p < len(self.prompt) and bool(self.book)
        if not self.copying or not (edits or copies):
            return None
        out: list[int] = []
        j, edited = self.p, False
        while len(out) < n_max and j < len(self.text):
            edit = self.book.at(self.text, j) if edits else None
            if edit is not None:
                n_src, dst, _ = edit
                out.extend(dst)
                j += n_src
                edited = True
                if n_src == 0:  # an insertion: the token it stood before comes next, unedited
                    out.append(self.text[j])
                    j += 1
                continue
            out.append(self.text[j])
            j += 1
        return tuple(out[:n_max]) if edited or (copies and out) else None
