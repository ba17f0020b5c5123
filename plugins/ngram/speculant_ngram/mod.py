"""ngram-mod: llama.cpp's rolling-hash pool of "next token after this n-gram".

One pool per speculator object, shared by every sequence it serves (llama.cpp shares it across
all server slots): 4*1024*1024 int32 entries, each the token that last followed an n-gram whose
64-bit hash ``h = h * 6364136223846793005 + token`` (wrapping) lands there, or EMPTY. Entries are
not verified, so a collision drafts a wrong token and the target simply rejects it. Drafting
follows the pool from the last n tokens until it misses or reaches n_max; a run shorter than
n_min is dropped. The pool is wiped when a begin leaves it more than 25% occupied, and when one
sequence sees 5 drafts in a row with less than 25% of their tokens accepted.
"""
from __future__ import annotations


import numpy as np

from speculant import Draft, DraftLimits, SequenceView, hookimpl
from speculant.logs import get_logger
from speculant.speculator import SpeculatorConfig

from speculant_ngram._common import hash_low_bits, hash_powers, int_option, tokens_of, window_hashes

log = get_logger(__name__)

POOL_SIZE = 4 * 1024 * 1024  # 4,194,304 entries (16 MiB)
HASH_MUL = 6364136223846793005
EMPTY = -1
ADD_CHUNK = 32  # new n-grams are added lazily, once more than this many tokens are pending
OCCUPANCY_RESET = 0.25  # at begin: wipe the pool when more than this fraction is in use
LOW_ACCEPT = 0.25  # a draft with a smaller accepted fraction is "low" (llama.cpp's comment says 0.5; its code uses 0.25)
LOW_STREAK_RESET = 5  # this many low drafts in a row wipe the pool


class NgramModPool:
    """llama.cpp's common_ngram_mod: the table, its occupancy count, add/get/reset."""

    def __init__(self, n: int, size: int = POOL_SIZE):
        if size & (size - 1):
            # index() relies on it: hash mod 2^k only needs the low k bits of the 64-bit hash.
            raise ValueError("the pool size must be a power of two")
        self.n, self.size, self.mask = n, size, size - 1
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0
        self.mul_low = HASH_MUL & self.mask
        self.powers = hash_powers(HASH_MUL, n, 64, self.mask)
        # weight of the oldest token of a window, removed when the window slides by one token
        self.oldest_weight = int(self.powers[0]) if n > 0 else 0

    def index(self, window) -> int:
        """Slot of an n-token window: the 64-bit wrapping hash modulo the size."""
        return hash_low_bits(window, self.mul_low, self.mask)

    def roll(self, idx: int, oldest: int, newest: int) -> int:
        """Slot of the window slid by one token: drop `oldest`, append `newest`."""
        return ((idx - oldest * self.oldest_weight) * self.mul_low + newest) & self.mask

    def get(self, idx: int) -> int:
        return self.entries.item(idx)

    def add(self, window) -> None:
        """One (n+1)-token window: its first n tokens are the key, the last the value."""
        i = self.index(window[: self.n])
        if self.entries[i] == EMPTY:
            self.used += 1
        self.entries[i] = window[self.n]

    def add_range(self, arr: np.ndarray, count: int) -> None:
        """``add(arr[s : s+n+1])`` for s = 0 .. count-1, in that order, vectorised."""
        if count <= 0:
            return
        idx = window_hashes(arr, 0, count, self.powers, self.mask)
        values = arr[self.n : self.n + count]
        # Sequential adds overwrite, so the last window per slot wins; a slot counts as newly
        # used if it was EMPTY before the batch.
        uniq, first_from_end = np.unique(idx[::-1], return_index=True)
        last = count - 1 - first_from_end
        self.used += int(np.count_nonzero(self.entries[uniq] == EMPTY))
        self.entries[uniq] = values[last]

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0


class _SeqInfo:
    __slots__ = ("i_last", "n_draft_last", "n_low")

    def __init__(self):
        self.i_last = 0  # windows starting before this index are in the pool
        self.n_draft_last = 0  # length of this sequence's last draft (0: none)
        self.n_low = 0  # consecutive low-acceptance drafts


class NgramMod:
    spec_type = "ngram-mod"
    shared_across_sequences = True  # one pool for every sequence (the contract's isolation tests know)
    contract_options = {"spec_ngram_mod_n_match": 4, "spec_ngram_mod_n_min": 1, "spec_ngram_mod_n_max": 8}
    contract_xfail = {"test_truncate_forgets_the_cut": "pool entries are shared and cannot be taken back (as in "
                                                       "llama.cpp): n-grams of the cut text still draft"}

    def __init__(self, config: SpeculatorConfig):
        self.n_match = int_option(config, "spec_ngram_mod_n_match", 24, 1, 1024)
        self.n_min = int_option(config, "spec_ngram_mod_n_min", 48, 0, 1024)
        self.n_max = int_option(config, "spec_ngram_mod_n_max", 64, 0, 1024)
        if self.n_match < 16:
            log.warning("ngram-mod: a small n_match; llama.cpp recommends at least 16", n_match=self.n_match)
        self.pool = NgramModPool(self.n_match)  # shared by all sequences of this speculator
        self.seqs: dict[int, _SeqInfo] = {}

    def _info(self, seq_id: int) -> _SeqInfo:
        info = self.seqs.get(seq_id)
        if info is None:
            info = self.seqs[seq_id] = _SeqInfo()
        return info

    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        # llama.cpp's begin gets the prompt of the next draft: all tokens but the last (our id_last).
        info = self._info(seq.seq_id)  # n_low survives a begin, as in llama.cpp
        info.i_last = 0
        info.n_draft_last = 0
        prompt = tokens_of(seq)[:-1]
        n = self.n_match
        if len(prompt) < n:
            return
        arr = np.fromiter(prompt, dtype=np.int32, count=len(prompt))
        self.pool.add_range(arr, len(prompt) - n)
        info.i_last = len(prompt) - n
        if self.pool.used / self.pool.size > OCCUPANCY_RESET:
            # checked after adding: the whole shared pool goes, this prompt's n-grams included
            log.info("ngram-mod: pool too full, resetting", occupancy=round(self.pool.used / self.pool.size, 3), limit=OCCUPANCY_RESET)
            self.pool.reset()

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        # Pool entries cannot be taken back (they are shared and unverified, like llama.cpp's);
        # only make sure the n-grams of the text that replaces the cut part get added.
        info = self.seqs.get(seq.seq_id)
        if info is not None:
            prompt_len = max(min(n, len(seq.tokens)) - 1, 0)
            info.i_last = min(info.i_last, max(prompt_len - self.n_match, 0))

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        info = self._info(seq.seq_id)
        info.n_draft_last = 0
        t = tokens_of(seq)
        n = self.n_match
        L = len(t) - 1  # len(prompt)
        if L < n:
            return None
        # Never past the history (only if it shrank without truncate; no-op otherwise).
        info.i_last = min(info.i_last, L - n)
        if info.i_last + ADD_CHUNK < L:  # lazy, chunked insertion of the new n-grams
            lo = info.i_last
            arr = np.fromiter(t[lo:L], dtype=np.int32, count=L - lo)
            self.pool.add_range(arr, L - n - lo)
            info.i_last = L - n

        pool = self.pool
        window = list(t[L - n + 1 :])  # prompt[L-n+1:L] + [id_last]
        idx = pool.index(window)
        out: list[int] = []
        for i in range(self.n_max):
            tok = pool.get(idx)
            if tok == EMPTY:
                if i < self.n_min:  # the pool ran dry too early: no draft
                    return None
                break
            out.append(tok)
            idx = pool.roll(idx, window[i], tok)
            window.append(tok)
        info.n_draft_last = len(out)
        if not out or limits.n_max <= 0:
            return None
        # The caller's cap truncates afterwards, as llama.cpp's dispatcher does (so a draft
        # may end up shorter than n_min).
        return Draft(tuple(out[: limits.n_max]), self.spec_type)

    @hookimpl
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden) -> None:
        if draft is None or draft.spec_type != self.spec_type or len(draft) == 0:
            return  # no draft verified, or another type's draft (llama.cpp's is_other)
        info = self.seqs.get(seq.seq_id)
        if info is None or info.n_draft_last == 0:
            return
        # The fraction is taken over the tokens actually verified. llama.cpp divides by the
        # untruncated draft length, which is the same thing unless the caller trimmed the draft;
        # here the engine trims every draft to --spec-draft-n-max (16 by default, below
        # ngram-mod's 48..64), which would make every draft look "low" and wipe the pool.
        if n_accepted / len(draft) < LOW_ACCEPT:
            info.n_low += 1
            if info.n_low >= LOW_STREAK_RESET:
                log.info("ngram-mod: low-acceptance drafts in a row, resetting the pool", drafts=info.n_low)
                self.pool.reset()
                info.n_low = 0
                info.i_last = 0  # this sequence re-adds its history lazily on the next draft
        else:
            info.n_low = 0
