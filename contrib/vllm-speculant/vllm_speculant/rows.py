"""Which request each row of a vLLM step is, told from the rows' token histories.

vLLM 0.33.0 calls a custom proposer with the rows' tokens only (gpu_model_runner.py:4744-4751:
`propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu,
slot_mappings=...)`): no request ids, and rows move between steps as requests come and go
(the persistent batch is condensed). speculant's speculators keep per-sequence state (a suffix
index, n-gram maps), so each row must be matched to the sequence it continues.

A row's history before this step is its history now minus the tokens sampled this step; the
sequence it continues is the one whose history, after the previous step, was exactly that. Rows
with equal histories (n > 1 samples of one prompt) are interchangeable: a speculator's state for a
sequence is a function of its history (the contract's `test_begin_resets`,
`test_truncate_forgets_the_cut`), so either pairing drafts the same. A row matching no sequence
starts one, its prompt being that earlier history; a sequence no row continues has finished (or
left the batch, which vLLM's own suffix proposer treats alike) and is freed.
"""
from __future__ import annotations

import itertools

import attrs

from speculant import Draft


@attrs.define
class Tracked:
    """One sequence: its id for the speculators, its history after the last step it was in, its
    prompt length, and the draft returned for it then (what this step verified)."""

    seq_id: int
    tokens: tuple[int, ...]
    n_prompt: int
    draft: Draft | None = None


class Rows:
    def __init__(self):
        self.seqs: dict[int, Tracked] = {}
        self._by_history: dict[tuple[int, ...], list[int]] = {}  # history after the last step -> seq ids
        self._seen: list[Tracked] = []
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.seqs)

    def match(self, history: tuple[int, ...], n_new: int) -> tuple[Tracked, bool]:
        """The sequence a row continues (history: all its tokens now, the last n_new of them
        sampled this step) and whether it is new. Call finish() after the step's last row."""
        before = history[: len(history) - n_new]
        ids = self._by_history.get(before)
        if ids:
            seq = self.seqs[ids.pop()]
            if not ids:
                del self._by_history[before]
            new = False
        else:
            seq = Tracked(next(self._ids), before, len(before))
            self.seqs[seq.seq_id] = seq
            new = True
        self._seen.append(seq)
        return seq, new

    def finish(self) -> list[int]:
        """End the step: forget the sequences no row continued (returned, to be ended) and key
        the others by their new histories."""
        gone = [i for ids in self._by_history.values() for i in ids]
        for i in gone:
            del self.seqs[i]
        self._by_history = {}
        for seq in self._seen:
            self._by_history.setdefault(seq.tokens, []).append(seq.seq_id)
        self._seen = []
        return gone
