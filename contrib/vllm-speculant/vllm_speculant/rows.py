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
import numpy as np

from speculant import Draft

TAIL = 4  # tokens of a history's end in its lookup key (its length is the rest of the key)


@attrs.define
class Tracked:
    """One sequence: its id for the speculators, its history after the last step it was in (the
    tuple speculators are handed, and the same tokens as int32 for comparing rows at memcmp
    speed), its prompt length, and the draft returned for it then (what this step verified)."""

    seq_id: int
    tokens: tuple[int, ...]
    n_prompt: int
    draft: Draft | None = None
    buf: np.ndarray = attrs.field(factory=lambda: np.empty(0, dtype=np.int32), repr=False)

    def extend(self, new: list[int]) -> None:
        n, k = len(self.tokens), len(new)
        if n + k > len(self.buf):  # grown by doubling: appending is amortized O(new tokens)
            grown = np.empty(max(2 * len(self.buf), n + k, 64), dtype=np.int32)
            grown[:n] = self.buf[:n]
            self.buf = grown
        self.buf[n : n + k] = new
        # The speculators take the whole history as a tuple; concatenating copies references,
        # cheaper than converting the row again (measured here, 64 rows of 8000 tokens, suffix:
        # a step of propose took 22 ms with each row converted and hashed whole, 8.5 ms this
        # way, this concatenation most of what is left).
        self.tokens = self.tokens + tuple(new)


def _key(history: np.ndarray) -> tuple:
    n = len(history)
    return n, tuple(history[max(0, n - TAIL) :].tolist())


class Rows:
    def __init__(self):
        self.seqs: dict[int, Tracked] = {}
        self._by_key: dict[tuple, list[int]] = {}  # (length, last tokens) of the history after the last step -> ids
        self._seen: list[Tracked] = []
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.seqs)

    def match(self, row: np.ndarray, n_new: int) -> tuple[Tracked, bool]:
        """The sequence a row continues, extended with this step's tokens (row: the row's tokens
        now, the last n_new of them sampled this step), and whether it is new (its prompt is
        then `tokens[:n_prompt]`). Call finish() after the step's last row."""
        m = len(row) - n_new
        before, new = row[:m], row[m:].tolist()
        key = _key(before)
        ids = self._by_key.get(key, [])
        for j, i in enumerate(ids):  # a key shared by different histories is verified, not trusted
            seq = self.seqs[i]
            if np.array_equal(seq.buf[:m], before):
                del ids[j]
                if not ids:
                    del self._by_key[key]
                seq.extend(new)
                self._seen.append(seq)
                return seq, False
        seq = Tracked(next(self._ids), tuple(before.tolist()), m, buf=np.array(before, dtype=np.int32))
        seq.extend(new)
        self.seqs[seq.seq_id] = seq
        self._seen.append(seq)
        return seq, True

    def finish(self) -> list[int]:
        """End the step: forget the sequences no row continued (returned, to be ended) and key
        the others by their new histories."""
        gone = [i for ids in self._by_key.values() for i in ids]
        for i in gone:
            del self.seqs[i]
        self._by_key = {}
        for seq in self._seen:
            self._by_key.setdefault(_key(seq.buf[: len(seq.tokens)]), []).append(seq.seq_id)
        self._seen = []
        return gone
