"""The n-gram speculators against literal, unoptimised transliterations of llama.cpp's algorithms
(as described in shared/reference/llamacpp-speculative.md 2.2-2.4), on random repetitive
histories with accepts, other types' drafts, truncation and new prompts."""
from __future__ import annotations

import random

import pytest

from speculant import Draft, DraftLimits, SequenceView
from speculant.chain import SpeculatorChain
from speculant.plugins import load_registry
from speculant.speculator import build_speculators

BIG = DraftLimits(n_max=4096)


# --- reference implementations: prompt = history without id_last, as in llama.cpp -------------------
def ref_simple(prompt, id_last, N, M):
    L = len(prompt)
    if L <= N + M + 1:
        return []
    pattern = prompt[L - N + 1 : L] + [id_last]
    match = 0
    for j in range(L - N - 1, 0, -1):
        if prompt[j : j + N] == pattern:
            match = j
            break
    if match == 0:
        return []
    k = min(M, L - (match + N))
    if k < N:
        return []
    return prompt[match + N : match + N + k]


def h32(tokens):
    h = 0
    for t in tokens:
        h = (h * 2654435761 + t) & 0xFFFFFFFF
    return h % 262144


class RefMap:
    def __init__(self, N, M, min_hits, key_only):
        self.N, self.M, self.min_hits, self.key_only = N, M, min_hits, key_only
        self.keys = []  # [key_idx, stat_idx, key_num, values]; value = [idx, num, n_accepted]
        self.key_map = {}  # slot -> history index
        self.H = self.B = self.last_check = 0
        self.last = None

    def begin(self, prompt):
        N, M = self.N, self.M
        S = len(prompt)
        cleanup = self.B
        if self.B > S:
            cleanup = S - N - M if S > N + M else 0
        if S < self.last_check:
            self.key_map = {s: i for s, i in self.key_map.items() if i < cleanup}
            self.H = cleanup - 1 if cleanup > 0 else 0
            kept = []
            for rec in self.keys:
                if rec[0] >= cleanup:
                    continue
                if not self.key_only:
                    vals = [v for v in rec[3] if not (v[0] != 0 and v[0] >= cleanup)]
                    rec[3] = vals + [[0, 0, M] for _ in range(4 - len(vals))]
                    if rec[3][0][0] == 0:
                        continue
                kept.append(rec)
            self.keys = kept
        self.last_check = self.B = S

    def draft(self, prompt, id_last):
        N, M = self.N, self.M
        self.last = None
        L = len(prompt)
        if L < 2 * N + M:
            return []
        self.last_check = L
        key = prompt[L - N + 1 :] + [id_last]
        match = 0
        i = self.key_map.get(h32(key), 0)
        if i != 0 and i < L - N - M - 1 and prompt[i : i + N] == key:
            match = i
        if match == 0 and self.B > N + M + 1:
            for j in range(self.B - N - M - 1, self.H, -1):
                if prompt[j : j + N] == key:
                    match = j
                    break
        if match == 0:
            for j in range(L - N - M - 1, max(self.B, self.H), -1):
                if prompt[j : j + N] == key:
                    match = j
                    break
        ranges = []
        if self.B > N + M + 1:
            ranges.append(range(self.B - N - M - 1, self.H, -1))
        ranges.append(range(L - N - M - 1, max(self.B, self.H), -1))
        for r in ranges:
            for j in r:
                self.key_map.setdefault(h32(prompt[j : j + N]), j)
        self.H = max(self.H, L - N - M - 1)
        if match == 0:
            return []
        rec = next((r for r in self.keys if prompt[r[0] : r[0] + N] == key), None)
        if rec is None:
            rec = [match, 0, 0, [[0, 0, M] for _ in range(4)]]
            self.keys.append(rec)
        rec[2] = min(rec[2] + 1, 16380)
        if self.key_only:
            self.last = (rec, 0)
            return prompt[match + N : match + N + min(M, rec[3][0][2])]
        if rec[2] < self.min_hits:
            return []
        for i in range(rec[1], match + 1):
            if prompt[i : i + N] != key:
                continue
            value = prompt[i + N : i + N + M]
            for v in rec[3]:
                if v[0] == 0:
                    v[0], v[1], v[2] = i + N, 0, M
                    break
                if prompt[v[0] : v[0] + M] == value:
                    break
            else:
                continue
            v[1] = min(v[1] + 1, 16380)
        rec[1] = match
        nums = [v[1] for v in rec[3]]
        best = nums.index(max(nums))
        others = sum(nums) - nums[best]
        if others > 0 and nums[best] < 2 * others:
            return []
        self.last = (rec, best)
        return prompt[match + N : match + N + min(M, rec[3][best][2])]

    def truncate(self, prompt):  # llama.cpp learns of a cut through begin() with the shorter history
        self.begin(prompt)

    def accept(self, n_accepted, is_other):
        if is_other or self.last is None:
            return
        rec, v = self.last
        rec[3][v][2] = n_accepted


class RefModPool:
    def __init__(self, n):
        self.n, self.entries, self.used = n, {}, 0

    def idx(self, window):
        h = 0
        for t in window:
            h = (h * 6364136223846793005 + t) & 0xFFFFFFFFFFFFFFFF
        return h % 4194304

    def add(self, window):
        i = self.idx(window[: self.n])
        if i not in self.entries:
            self.used += 1
        self.entries[i] = window[self.n]

    def get(self, window):
        return self.entries.get(self.idx(window), -1)

    def reset(self):
        self.entries, self.used = {}, 0


class RefModSeq:
    def __init__(self, pool, n_min, n_max):
        self.pool, self.n_min, self.n_max = pool, n_min, n_max
        self.i_last = self.n_draft_last = self.n_low = 0

    def begin(self, prompt):
        n = self.pool.n
        self.i_last = self.n_draft_last = 0
        if len(prompt) < n:
            return
        for i in range(len(prompt) - n):
            self.pool.add(prompt[i : i + n + 1])
        self.i_last = len(prompt) - n
        if self.pool.used / 4194304 > 0.25:
            self.pool.reset()

    def truncate(self, prompt):  # (no llama.cpp counterpart) re-add what replaces the cut part
        self.i_last = min(self.i_last, max(len(prompt) - self.pool.n, 0))

    def draft(self, prompt, id_last):
        n = self.pool.n
        self.n_draft_last = 0
        L = len(prompt)
        if L < n:
            return []
        if self.i_last + 32 < L:
            for i in range(self.i_last, L - n):
                self.pool.add(prompt[i : i + n + 1])
            self.i_last = L - n
        window = prompt[L - n + 1 :] + [id_last]
        out = []
        for i in range(self.n_max):
            t = self.pool.get((window + out)[-n:])
            if t == -1:
                if i < self.n_min:
                    return []
                break
            out.append(t)
        self.n_draft_last = len(out)
        return out

    def accept(self, n_accepted, is_other):
        if is_other or self.n_draft_last == 0:
            return
        if n_accepted / self.n_draft_last < 0.25:
            self.n_low += 1
            if self.n_low >= 5:
                self.pool.reset()
                self.n_low = 0
                self.i_last = 0
        else:
            self.n_low = 0


# --- random histories ---------------------------------------------------------------------------------
def history(rng, length, vocab):
    """Random text with many exact repeats (copied spans) and some noise."""
    out = [rng.randrange(vocab) for _ in range(8)]
    while len(out) < length:
        if rng.random() < 0.75:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randrange(3, 40)])
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


def drive(rng, speculator, refs, n_seqs, length, vocab):
    """Run random events on the speculator (through a chain, as the engine calls it) and the
    per-seq reference objects `refs` side by side; every proposal must be identical."""
    spec = SpeculatorChain([speculator])
    hists = {s: history(rng, length, vocab) for s in range(n_seqs)}
    cur = {}
    for s in range(n_seqs):
        cur[s] = rng.randrange(2, 60)
        t = hists[s][: cur[s]]
        spec.begin(SequenceView(s, tuple(t), len(t)))
        refs[s].begin(t[:-1])
    n_drafts = 0
    for _ in range(400):
        s = rng.randrange(n_seqs)
        h, c = hists[s], cur[s]
        if c >= len(h):
            continue
        t = h[:c]
        v = SequenceView(s, tuple(t), 0)
        r = rng.random()
        if r < 0.1:  # another speculator of the chain drafted: ours was not asked
            spec.accept(v, Draft((1, 2), "other"), rng.randrange(3), {})
            refs[s].accept(rng.randrange(3), True)
            cur[s] += rng.randrange(1, 4)
            continue
        if r < 0.14:  # history cut back (truncate or a new, shorter prompt)
            c2 = rng.randrange(2, c + 1)
            t2 = h[:c2]
            if rng.random() < 0.5:
                spec.truncate(SequenceView(s, tuple(t2), 0), c2)
                refs[s].truncate(t2[:-1])
            else:
                spec.begin(SequenceView(s, tuple(t2), c2))
                refs[s].begin(t2[:-1])
            hists[s] = h = t2 + history(rng, length - c2, vocab) if rng.random() < 0.5 else h
            cur[s] = c2
            continue
        d = spec.propose(v, BIG)
        expect = refs[s].draft(t[:-1], t[-1])
        assert (tuple(d.tokens) if d else ()) == tuple(expect), (s, c)
        if d is None:
            spec.accept(v, None, 0, {})  # a step without a draft: no accept at all in llama.cpp
            cur[s] += 1
            continue
        n_drafts += 1
        follow = h[c : c + len(d)]
        n_acc = 0
        while n_acc < len(follow) and follow[n_acc] == d.tokens[n_acc]:
            n_acc += 1
        if rng.random() < 0.2:
            n_acc = rng.randrange(len(d) + 1)  # whatever the target decided
        spec.accept(SequenceView(s, tuple(h[: c + n_acc + 1]), 0), d, n_acc, {})
        refs[s].accept(n_acc, False)
        cur[s] += n_acc + 1
    return n_drafts


@pytest.fixture(scope="module")
def registry():
    return load_registry()


@pytest.mark.parametrize("seed", range(6))
def test_simple_matches_reference(seed, registry):
    rng = random.Random(seed)
    N, M = rng.choice([(1, 2), (2, 3), (3, 4), (4, 8)])

    class Ref:
        def begin(self, prompt):
            pass

        def draft(self, prompt, id_last):
            return ref_simple(prompt, id_last, N, M)

        def accept(self, n, is_other):
            pass

        truncate = begin

    (spec,) = build_speculators(["ngram-simple"], {"spec_ngram_simple_size_n": N, "spec_ngram_simple_size_m": M},
                                registry=registry)
    assert drive(rng, spec, {0: Ref(), 1: Ref()}, 2, 500, rng.choice([3, 5, 8])) > 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", ["ngram-map-k", "ngram-map-k4v"])
def test_map_matches_reference(name, seed, registry):
    rng = random.Random(seed)
    N, M = rng.choice([(1, 2), (2, 3), (3, 4), (2, 6)])
    hits = rng.choice([1, 1, 2, 3])
    p = f"spec_{name.replace('-', '_')}"
    (spec,) = build_speculators([name], {f"{p}_size_n": N, f"{p}_size_m": M, f"{p}_min_hits": hits}, registry=registry)
    refs = {s: RefMap(N, M, hits, name == "ngram-map-k") for s in range(2)}
    # long histories: the vectorised hashing and byte-image searches kick in
    assert drive(rng, spec, refs, 2, rng.choice([300, 900]), rng.choice([3, 5, 8])) > 0
    for s in refs:
        st = spec.seqs[s]
        assert {int(i) for i in st.key_map[st.key_map != 0]} == set(refs[s].key_map.values())
        assert st.key_map_last_idx == refs[s].H


@pytest.mark.parametrize("seed", range(6))
def test_mod_matches_reference(seed, registry):
    rng = random.Random(seed)
    n, n_min, n_max = rng.choice([(1, 0, 4), (2, 1, 6), (3, 2, 8), (4, 0, 12)])
    (spec,) = build_speculators(["ngram-mod"], {"spec_ngram_mod_n_match": n, "spec_ngram_mod_n_min": n_min,
                                                "spec_ngram_mod_n_max": n_max}, registry=registry)
    pool = RefModPool(n)
    refs = {s: RefModSeq(pool, n_min, n_max) for s in range(3)}  # three sequences, one shared pool
    assert drive(rng, spec, refs, 3, 600, rng.choice([4, 6, 10])) > 0
    assert spec.pool.used == pool.used
    assert {i: int(spec.pool.entries[i]) for i in pool.entries} == pool.entries
    assert int((spec.pool.entries != -1).sum()) == len(pool.entries)
