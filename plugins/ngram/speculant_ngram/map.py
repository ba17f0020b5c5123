"""ngram-map-k and ngram-map-k4v: llama.cpp's per-sequence n-gram key map.

Per sequence: a 2^18-slot hash table from the 32-bit LCG hash of an N-gram to one history index
holding it (first writer wins), plus "key records" for every key that produced a match. The
key-only variant drafts the M tokens after the match, capped by how many tokens of the last
draft from that key were accepted. The k4v variant also keeps up to four distinct M-gram
"values" seen after the key with their counts, and drafts only when one value dominates
(count >= 2x all the others together).

Quirks of llama.cpp kept on purpose (each is what its code does):
* the draft text is the M-gram after the *match* (most recent lookup hit), not the stored text
  of the chosen value; the value only gates the draft and caps its length;
* a value whose last draft had 0 accepted tokens never drafts again (its cap is 0);
* min_hits is not checked in key-only mode; ``key_num`` counts draft-time lookups, not
  occurrences in the history;
* the stats scan runs from ``stat_idx`` to the match inclusive, so an occurrence at the previous
  match is counted again when the same key is looked up again;
* with B = size_last_begin, start positions in (B - N - M - 1, B] (all of [1, B] when
  B <= N + M + 1) are neither scanned nor hashed until the next begin moves B.
"""
from __future__ import annotations

import numpy as np

from speculant import Draft, DraftLimits, SequenceView, hookimpl
from speculant.speculator import SpeculatorConfig

from speculant_ngram._common import History, hash_low_bits, hash_powers, int_option, tokens_of, window_hashes

KEY_MAP_SIZE = 1 << 18  # 262144 slots; a power of two, so only the hash's low 18 bits matter
KEY_MAP_MASK = KEY_MAP_SIZE - 1
LCG_FACTOR = 2654435761  # 32-bit hash h = h * LCG_FACTOR + token (wrapping)
MAX_VALUES = 4
MAX_COUNT = 16380  # key_num and value_num saturate here
UINT16_MAX = 65535


class _Value:
    __slots__ = ("idx", "num", "n_accepted")

    def __init__(self, idx: int = 0, num: int = 0, n_accepted: int = 0):
        self.idx = idx  # history index where the M-gram starts; 0 = empty slot
        self.num = num  # occurrences counted by the k4v stats scan
        self.n_accepted = n_accepted  # tokens accepted from the last draft through this value: the next cap

    def copy(self) -> "_Value":
        return _Value(self.idx, self.num, self.n_accepted)


class _Key:
    __slots__ = ("key_idx", "stat_idx", "key_num", "values")

    def __init__(self, key_idx: int, m: int):
        self.key_idx = key_idx  # a history index holding the key's tokens (its identity)
        self.stat_idx = 0  # the k4v stats scan resumes here
        self.key_num = 0  # lookups that found this key
        self.values = [_Value(0, 0, m) for _ in range(MAX_VALUES)]


class _SeqMap:
    """llama.cpp's common_ngram_map for one sequence."""

    __slots__ = ("keys", "index", "key_map", "key_map_last_idx", "size_last_begin", "idx_last_check", "last")

    def __init__(self):
        self.keys: list[_Key] = []
        # key tokens -> record: llama.cpp scans `keys` comparing the tokens at each key_idx; the
        # dict gives the same first-match answer in O(1). None = rebuild from the history at the
        # next draft (after a begin, when the tokens at the stored indices may have changed).
        self.index: dict[tuple[int, ...], _Key] | None = {}
        self.key_map = np.zeros(KEY_MAP_SIZE, dtype=np.uint32)  # hash slot -> history index, 0 = empty
        self.key_map_last_idx = 0  # H: highest start position already hashed
        self.size_last_begin = 0  # B: prompt length at the last begin
        self.idx_last_check = 0  # prompt length at the last draft (or begin)
        self.last: tuple[_Key, int] | None = None  # (record, value slot) behind the last draft


class _NgramMap:
    spec_type = ""
    # Where llama.cpp's semantics, kept on purpose, differ from the plugin contract's:
    contract_xfail = {
        "test_begin_resets": "llama.cpp keeps a reused slot's key map across begin (pruned to the new prompt), "
                             "so the next drafts depend on the earlier text",
        "test_truncate_forgets_the_cut": "truncate is llama.cpp's begin with the shorter history, whose key-map "
                                         "bookkeeping differs from never having seen the cut tokens",
    }
    key_only = True
    _prefix = ""

    def __init__(self, config: SpeculatorConfig):
        p = self._prefix
        self.size_n = int_option(config, f"{p}_size_n", 12, 1, 1024)
        self.size_m = int_option(config, f"{p}_size_m", 48, 1, 1024)
        self.min_hits = int_option(config, f"{p}_min_hits", 1, 1)
        self.n_max = self.size_m
        self._powers = hash_powers(LCG_FACTOR, self.size_n, 32, KEY_MAP_MASK)
        self._mul_low = LCG_FACTOR & KEY_MAP_MASK
        self.seqs: dict[int, _SeqMap] = {}

    # --- hooks ---------------------------------------------------------------------------
    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        # The prompt handed to llama.cpp's begin is the prompt of the next draft: all tokens but
        # the last, which our first propose treats as id_last. State for a reused seq id is kept
        # and pruned as llama.cpp does for a reused slot (stale entries are re-verified anyway).
        st = self.seqs.setdefault(seq.seq_id, _SeqMap())
        self._begin(st, tokens_of(seq)[:-1])

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        # llama.cpp has no truncate; its begin() with a shorter history is how it learns of one.
        st = self.seqs.get(seq.seq_id)
        if st is not None:
            self._begin(st, tokens_of(seq)[:n][:-1])

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        st = self.seqs.get(seq.seq_id)
        if st is None:  # no begin seen: llama.cpp's freshly constructed map
            st = self.seqs[seq.seq_id] = _SeqMap()
        t = tokens_of(seq)
        if len(t) - 1 < st.idx_last_check:
            # The history shrank without a truncate/begin (llama.cpp aborts here; its server always
            # calls begin first). Do what that begin would have done.
            self._begin(st, t[:-1])
        draft = self._draft(st, History(t))
        if not draft:
            return None
        return Draft(draft[: limits.n_max], self.spec_type) if limits.n_max > 0 else None

    @hookimpl
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden) -> None:
        # No draft this step (llama.cpp calls no accept then) or another type's draft (is_other):
        # both leave the map alone.
        if draft is None or draft.spec_type != self.spec_type:
            return
        st = self.seqs.get(seq.seq_id)
        if st is None or st.last is None:
            return
        rec, v = st.last
        rec.values[v].n_accepted = min(max(int(n_accepted), 0), UINT16_MAX)

    # --- llama.cpp's common_ngram_map_begin ------------------------------------------------
    def _begin(self, st: _SeqMap, prompt: tuple[int, ...]) -> None:
        n, m = self.size_n, self.size_m
        size_begin = len(prompt)
        cleanup = st.size_last_begin
        if cleanup > size_begin:  # shorter than at the last begin: keep only what lies well before the end
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < st.idx_last_check:
            km = st.key_map
            km[km >= cleanup] = 0  # slots holding an index past the cut (0 stays 0)
            st.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            kept = []
            for rec in st.keys:
                if rec.key_idx >= cleanup:
                    continue
                if not self.key_only:
                    vals = rec.values
                    for j in range(MAX_VALUES - 1, -1, -1):
                        if vals[j].idx != 0 and vals[j].idx >= cleanup:
                            # delete the value: shift the later ones left, clear the last slot
                            for k in range(j, MAX_VALUES - 1):
                                vals[k] = vals[k + 1].copy()
                            vals[-1].idx = 0
                            vals[-1].num = 0
                    if vals[0].idx == 0:  # no value left (also: never had one) -> the key goes too
                        continue
                kept.append(rec)
            st.keys = kept
            st.index = None
        elif st.keys:
            # Nothing is pruned, but a different prompt may now sit under the stored indices.
            st.index = None
        st.idx_last_check = size_begin
        st.size_last_begin = size_begin

    # --- llama.cpp's common_ngram_map_draft -------------------------------------------------
    def _draft(self, st: _SeqMap, hist: History) -> tuple[int, ...] | None:
        st.last = None
        t = hist.tokens
        n, m = self.size_n, self.size_m
        L = len(t) - 1
        if L < 2 * n + m or L >= 0xFFFFFFFF:  # too short; (the map stores uint32 indices)
            return None
        st.idx_last_check = L
        key = t[L - n + 1 :]  # prompt's last N-1 tokens + id_last
        B, H = st.size_last_begin, st.key_map_last_idx
        top = L - n - m - 1  # highest start with a full key and M-gram before id_last

        # 1) the hash table (one candidate; verified because of collisions)
        match = 0
        i = int(st.key_map[hash_low_bits(key, self._mul_low, KEY_MAP_MASK)])
        if i != 0 and i < top and t[i : i + n] == key:
            match = i
        # 2) linear scan of the prompt part not hashed yet: B-N-M-1 down to H+1
        if match == 0 and B > n + m + 1:
            match = max(hist.rfind(key, H + 1, B - n - m - 1), 0)
        # 3) linear scan of the generated part: L-N-M-1 down to max(B, H)+1
        if match == 0:
            match = max(hist.rfind(key, max(B, H) + 1, top), 0)
        # 4) hash the n-grams the scans covered, same ranges and order, insert-if-empty
        starts = []
        if B > n + m + 1 and B - n - m - 1 > H:
            starts.append((H + 1, B - n - m - 1))
        if top > max(B, H):
            starts.append((max(B, H) + 1, top))
        if starts:
            self._hash_into(st, hist, starts)
        st.key_map_last_idx = max(top, H)

        if match == 0:
            return None

        # the key's record (created on its first match)
        if st.index is None:
            st.index = {}
            for rec in st.keys:
                k = t[rec.key_idx : rec.key_idx + n]
                if len(k) == n:
                    st.index.setdefault(k, rec)
        rec = st.index.get(key)
        if rec is None:
            rec = _Key(match, m)
            st.keys.append(rec)
            st.index[key] = rec
        rec.key_num = min(rec.key_num + 1, MAX_COUNT)

        if self.key_only:  # value slot 0 only; min_hits is not consulted in this mode
            k = min(m, rec.values[0].n_accepted)
            st.last = (rec, 0)
            return t[match + n : match + n + k]

        if rec.key_num < self.min_hits:
            return None
        # refresh the value statistics over the key's occurrences in [stat_idx, match]
        vals = rec.values
        for i in hist.find_all(key, rec.stat_idx, match):
            vstart = i + n
            mgram = None
            for v in vals:
                if v.idx == 0:  # first empty slot: a new value
                    v.idx, v.num, v.n_accepted = vstart, 0, m
                    break
                if mgram is None:
                    mgram = t[vstart : vstart + m]
                if t[v.idx : v.idx + m] == mgram:
                    break
            else:
                continue  # four other values already: this one is not counted
            v.num = min(v.num + 1, MAX_COUNT)
        rec.stat_idx = match

        best = 0
        for j in range(1, MAX_VALUES):  # strict >: the lowest slot wins ties
            if vals[j].num > vals[best].num:
                best = j
        others = sum(v.num for j, v in enumerate(vals) if j != best)
        if others > 0 and vals[best].num < 2 * others:  # no dominant continuation
            return None
        k = min(m, vals[best].n_accepted)
        st.last = (rec, best)
        return t[match + n : match + n + k]  # the text after the match, not the value's stored text

    def _hash_into(self, st: _SeqMap, hist: History, ranges: list[tuple[int, int]]) -> None:
        """Insert start positions into the key map: each (lo, hi) range descending, ranges in the
        given order, a slot keeping the first index written to it."""
        n, km = self.size_n, st.key_map
        total = sum(hi - lo + 1 for lo, hi in ranges)
        if total <= 8:  # the usual decode step: one or two new positions
            t = hist.tokens
            for lo, hi in ranges:
                for j in range(hi, lo - 1, -1):
                    h = hash_low_bits(t[j : j + n], self._mul_low, KEY_MAP_MASK)
                    if km[h] == 0:
                        km[h] = j
            return
        arr = hist.array()
        pos = np.concatenate([np.arange(hi, lo - 1, -1, dtype=np.int64) for lo, hi in ranges])
        slots = np.concatenate([window_hashes(arr, lo, hi - lo + 1, self._powers, KEY_MAP_MASK)[::-1]
                                for lo, hi in ranges])
        # first writer per slot in iteration order, and only into empty slots
        uniq, first = np.unique(slots, return_index=True)
        empty = km[uniq] == 0
        km[uniq[empty]] = pos[first[empty]].astype(np.uint32)


class NgramMapK(_NgramMap):
    spec_type = "ngram-map-k"
    contract_options = {"spec_ngram_map_k_size_n": 3, "spec_ngram_map_k_size_m": 8}  # the contract's short texts
    key_only = True
    _prefix = "spec_ngram_map_k"


class NgramMapK4v(_NgramMap):
    spec_type = "ngram-map-k4v"
    contract_options = {"spec_ngram_map_k4v_size_n": 3, "spec_ngram_map_k4v_size_m": 8}  # the contract's short texts
    key_only = False
    _prefix = "spec_ngram_map_k4v"
