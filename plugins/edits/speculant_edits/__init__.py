"""copy-edits: the answer's own edits of the prompt, made again on the text it is about to copy.

An assistant asked to change a file writes the file again: copying speculators (suffix,
ngram-*) draft the copy, and every change the answer makes rejects a draft where the copy goes on
unchanged. Many changes repeat (a parameter renamed at every use, the same type hints on every
signature with the same parameters), and after the first the text around them says where the
next one comes. This speculator follows where the answer copies from (speculant_edits.alignment),
records each change, and where a recorded change applies within the next n_max tokens of the
copy, drafts the copy with it made. Elsewhere it drafts nothing, so put it first in a chain of
copying speculators: `--spec-type copy-edits,suffix`; with `--spec-copy-edits-copies` it drafts
the plain copy there too (alone, a copying speculator of its own).

Where the answer is not copying, and its last two records (a line each, or up to four) are the
prompt's records written again in another layout (a Markdown row, a YAML item, a dict entry or a
CSV row per JSON object), it drafts the next records the same way, each record's values from the
prompt (speculant_edits.records; `--spec-copy-edits-no-records` leaves that out).
"""
from __future__ import annotations

from speculant import Draft, DraftLimits, SequenceView, SpeculantError, hookimpl, int_in
from speculant.speculator import SpeculatorConfig

from speculant_edits.alignment import RESYNC, Alignment, Edit, EditBook
from speculant_edits.records import Template

__all__ = ["Alignment", "CopyEdits", "Edit", "EditBook", "RecordLines", "Template"]

RECORD_CHARS_PER_TOKEN = 8  # the record text written for a draft of n tokens: 8n characters, enough
MAX_RECORD_LINES = 4  # records of up to this many lines (a YAML item, a small object)
LEARNED_KEPT = 64  # templates kept per sequence (a record's lines are tried at every step)


class RecordLines:
    """One sequence's records drafts: the prompt's text (once) and the templates learned."""

    def __init__(self, tokenizer, prompt: tuple[int, ...]):
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

    def ahead(self, lines: list[str], complete_first: bool) -> tuple[str, str] | None:
        """(the current record written so far, the text from there that the template of the last
        two records writes), for the first record length (1.. lines) and place in the current
        record whose template the current record so far follows."""
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
                text = t.text(self.prompt_text, RECORD_CHARS_PER_TOKEN * 64 + len(current))
                if len(text) > len(current) and text.startswith(current):
                    return current, text
        return None

    def draft(self, answer: tuple[int, ...], n_max: int) -> tuple[int, ...] | None:
        tok = self.tokenizer
        # the answer's last lines: enough for two records of MAX_RECORD_LINES and the current one
        want = 3 * MAX_RECORD_LINES
        tail, k = b"", len(answer)
        while k > 0 and tail.count(b"\n") < want:
            k -= 1
            tail = tok.token_bytes(answer[k]) + tail
        text = tail.decode("utf-8", errors="replace")
        if "\ufffd" in text or "\n" not in text:
            return None
        found = self.ahead(text.split("\n"), complete_first=k == 0)
        if found is None:
            return None
        current, ahead = found
        rest = ahead[len(current) :][: RECORD_CHARS_PER_TOKEN * n_max]
        # The draft's tokens as the model writes them: the current line tokenized with its
        # continuation, where that gives the line's own tokens back; else the continuation alone.
        start, line_bytes = len(answer), b""
        while start > k and b"\n" not in line_bytes:
            start -= 1
            line_bytes = tok.token_bytes(answer[start]) + line_bytes
        if b"\n" in line_bytes:  # the line's first token holds the newline before it: from the next one
            start += 1
            line_bytes = line_bytes[len(tok.token_bytes(answer[start - 1])) :]
        own = answer[start:]
        whole = tok.encode(line_bytes.decode("utf-8", errors="replace") + rest, add_special=False, parse_special=False)
        if tuple(whole[: len(own)]) == own:
            tokens = whole[len(own) :]
        else:
            tokens = tok.encode(rest, add_special=False, parse_special=False)
        return tuple(tokens[:n_max]) or None


class CopyEdits:
    spec_type = "copy-edits"
    n_max = 64
    # The contract's tiny model makes no edits, so the suite checks the copies; its sampled texts
    # seldom repeat four tokens in a row, so two make a copy there.
    contract_options = {"spec_copy_edits_copies": True, "spec_copy_edits_resync": 2}

    def __init__(self, config: SpeculatorConfig):
        self.alignments: dict[int, Alignment] = {}
        self.copies = bool(config.option("spec_copy_edits_copies", False))
        self.tokenizer = getattr(config.target, "tokenizer", None)
        self.records = self.tokenizer is not None and not config.option("spec_copy_edits_no_records", False)
        self.record_lines: dict[int, RecordLines] = {}
        self.resync = config.option("spec_copy_edits_resync", RESYNC)
        if isinstance(self.resync, bool) or not isinstance(self.resync, int) or not 1 <= self.resync <= 64:
            raise SpeculantError(f"--spec-copy-edits-resync must be an integer in [1, 64], got {self.resync!r}")

    def _alignment(self, seq: SequenceView) -> Alignment:
        a = self.alignments.get(seq.seq_id)
        if a is None or len(a.prompt) != seq.n_prompt or a.o_done > len(seq.tokens) - seq.n_prompt:
            a = self.alignments[seq.seq_id] = Alignment(tuple(seq.tokens[: seq.n_prompt]), self.resync)
        return a

    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        self.alignments.pop(seq.seq_id, None)
        self.record_lines.pop(seq.seq_id, None)

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        self.alignments.pop(seq.seq_id, None)  # rebuilt from the tokens at the next proposal

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.alignments.pop(seq_id, None)
        self.record_lines.pop(seq_id, None)

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        if limits.n_max <= 0:
            return None
        a = self._alignment(seq)
        a.take(seq.tokens[seq.n_prompt :])
        tokens = a.draft(limits.n_max, copies=self.copies)
        if not tokens and self.records and not a.copying:
            tokens = self._records(seq).draft(seq.tokens[seq.n_prompt :], limits.n_max)
        return Draft(tokens, self.spec_type) if tokens else None

    def _records(self, seq: SequenceView) -> RecordLines:
        r = self.record_lines.get(seq.seq_id)
        prompt = seq.tokens[: seq.n_prompt]
        if r is None or r.prompt != prompt:
            r = self.record_lines[seq.seq_id] = RecordLines(self.tokenizer, prompt)
        return r


@hookimpl
def speculant_register_speculators(register):
    register(CopyEdits.spec_type, CopyEdits)


@hookimpl
def speculant_add_options(parser):
    parser.add_argument("--spec-copy-edits-copies", action="store_true", default=None,
                        help="copy-edits: draft the copy where no recorded edit applies too (default: only where one does)")
    parser.add_argument("--spec-copy-edits-no-records", action="store_true", default=None,
                        help="copy-edits: no drafts of the next lines where the answer writes the prompt's records again "
                             "in another layout (default: drafted)")
    parser.add_argument("--spec-copy-edits-resync", type=int_in(1, 64), default=None, metavar="N",
                        help=f"copy-edits: tokens the answer must copy in a row to be copying again after a change (default {RESYNC})")
