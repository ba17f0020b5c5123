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
from speculant_edits.records import RecordLines, Template

__all__ = ["Alignment", "CopyEdits", "Edit", "EditBook", "RecordLines", "Template"]


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
