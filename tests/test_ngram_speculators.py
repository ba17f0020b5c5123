"""The n-gram speculators (plugin speculant_ngram): llama.cpp's drafting rules on hand-made
histories, per-sequence state, the shared ngram-mod pool, flags, and end-to-end losslessness."""
from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
import torch

from speculant import Draft, DraftLimits, ForwardOutput, SequenceView, SpeculantError
from speculant.engine import Engine, EngineConfig
from speculant.plugins import load_registry
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators

from toy_models import EOS, N_VOCAB, ToyModel, _logits, _next_hash

BIG = DraftLimits(n_max=1024)
NAMES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod"]


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def make(name, registry, **options):
    (spec,) = build_speculators([name], options, registry=registry)
    return spec


def view(tokens, seq_id=0, n_prompt=None):
    tokens = tuple(tokens)
    return SequenceView(seq_id, tokens, len(tokens) if n_prompt is None else n_prompt)


def toks(draft):
    return None if draft is None else draft.tokens


# --- registration and flags ---------------------------------------------------------------------
def test_registered_through_entry_point_with_llamacpp_defaults(registry):
    assert set(NAMES) <= set(registry.names("speculator"))
    plugin = next(p for p in registry.plugins if p.name == "ngram")
    assert plugin.error is None
    simple, k, k4v, mod = build_speculators(NAMES, {}, registry=registry)
    assert [s.spec_type for s in (simple, k, k4v, mod)] == NAMES
    for s in (simple, k, k4v):
        assert (s.size_n, s.size_m, s.min_hits) == (12, 48, 1)
    assert (mod.n_match, mod.n_min, mod.n_max) == (24, 48, 64)
    assert mod.pool.entries.dtype == np.int32 and mod.pool.entries.size == 4 * 1024 * 1024


def test_flags(registry):
    parser = argparse.ArgumentParser()
    parser.exit = lambda *a, **k: (_ for _ in ()).throw(ValueError(a))  # no SystemExit noise
    registry.pm.hook.speculant_add_options(parser=parser)
    args = vars(parser.parse_args([]))
    for kind in ("simple", "map_k", "map_k4v"):
        for what in ("size_n", "size_m", "min_hits"):
            assert args[f"spec_ngram_{kind}_{what}"] is None
    for what in ("n_match", "n_min", "n_max"):
        assert args[f"spec_ngram_mod_{what}"] is None
    args = vars(parser.parse_args(["--spec-ngram-map-k4v-size-n", "5", "--spec-ngram-mod-n-min", "0",
                                   "--spec-ngram-simple-min-hits", "7"]))
    assert args["spec_ngram_map_k4v_size_n"] == 5 and args["spec_ngram_mod_n_min"] == 0
    spec = make("ngram-map-k4v", registry, **args)
    assert (spec.size_n, spec.size_m) == (5, 48)
    for bad in (["--spec-ngram-simple-size-n", "0"], ["--spec-ngram-map-k-size-m", "1025"],
                ["--spec-ngram-map-k-min-hits", "0"], ["--spec-ngram-mod-n-match", "x"],
                ["--spec-ngram-mod-n-max", "-1"]):
        with pytest.raises((ValueError, SystemExit)):
            parser.parse_args(bad)
    with pytest.raises(SpeculantError, match="size-n"):
        make("ngram-simple", registry, spec_ngram_simple_size_n=0)


# --- history search -------------------------------------------------------------------------------
def test_history_search_skips_misaligned_byte_hits():
    from speculant_ngram._common import History

    # int32 little-endian images of these tokens contain each other's bytes at odd offsets
    # (256, 0 holds the bytes of 1 at offset 1), which the byte search must not report.
    rng = random.Random(5)
    alphabet = [0, 1, 256, 65536, 16777216, 257, 65537]
    for _ in range(200):
        t = tuple(rng.choice(alphabet) for _ in range(rng.randrange(1, 300)))
        n = rng.randrange(1, 4)
        key = tuple(rng.choice(alphabet) for _ in range(n))
        lo = rng.randrange(0, len(t) + 1)
        hi = rng.randrange(lo - 2, len(t) - n + 1) if len(t) >= n else lo - 1
        hits = [j for j in range(lo, hi + 1) if t[j : j + n] == key]
        h = History(t)
        assert h.rfind(key, lo, hi) == (hits[-1] if hits else -1)
        assert h.find_all(key, lo, hi) == hits


# --- ngram-simple ---------------------------------------------------------------------------------
def simple(registry, n=3, m=4):
    return make("ngram-simple", registry, spec_ngram_simple_size_n=n, spec_ngram_simple_size_m=m)


def test_simple_most_recent_match(registry):
    s = simple(registry)
    t = [9, 1, 2, 3, 10, 11, 12, 13, 20, 1, 2, 3, 30, 31, 32, 33, 40, 1, 2, 3]
    assert toks(s.propose(view(t), BIG)) == (30, 31, 32, 33)
    assert toks(s.propose(view(t), DraftLimits(n_max=2))) == (30, 31)


def test_simple_never_matches_at_zero(registry):
    s = simple(registry)
    t = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3]
    assert s.propose(view(t), BIG) is None  # the only earlier occurrence is at j = 0
    assert toks(s.propose(view([0] + t), BIG)) == (10, 11, 12, 13)


def test_simple_needs_n_follow_up_tokens(registry):
    s = simple(registry)
    # The most recent match (j=12, overlapping the key) has only 2 tokens after it before
    # id_last: no draft, although the older match at j=1 would have had 4.
    t = [0, 1, 2, 3, 8, 9, 10, 11, 7, 7, 7, 7, 1, 2, 3, 1, 2, 3]
    assert s.propose(view(t), BIG) is None
    t = [0, 1, 2, 3, 8, 9, 10, 11, 7, 7, 7, 7, 5, 1, 2, 3]  # older match only: 4 follow-up tokens
    assert toks(s.propose(view(t), BIG)) == (8, 9, 10, 11)


def test_simple_history_length_rule(registry):
    s = simple(registry)  # N + M + 1 = 8
    assert s.propose(view([0, 1, 2, 3, 4, 5, 1, 2, 3]), BIG) is None  # len(prompt) = 8
    assert toks(s.propose(view([0, 1, 2, 3, 4, 5, 6, 1, 2, 3]), BIG)) == (4, 5, 6, 1)  # 9
    assert toks(s.propose(view([0, 1, 2, 3, 4, 5, 6, 1, 2, 3]), DraftLimits(n_max=0))) is None


# --- ngram-map-k ----------------------------------------------------------------------------------
def map_hash(tokens):
    h = 0
    for t in tokens:
        h = (h * 2654435761 + t) & 0xFFFFFFFF
    return h % 262144


T_B = [0, 1, 2, 3, 10, 11, 7, 7, 7, 7, 7, 7, 7, 7]  # prompt of 13 tokens + a last one
T_1 = T_B + [1, 2, 3]
T_2 = T_1 + [10, 6, 6, 1, 2, 3, 20, 21, 6, 6, 6, 1, 2, 3]


def map_k(registry, n=3, m=2, **kw):
    return make("ngram-map-k", registry, spec_ngram_map_k_size_n=n, spec_ngram_map_k_size_m=m, **kw)


def test_map_k_key_map_insert_if_empty_and_accept_cap(registry):
    s = map_k(registry)
    s.begin(view(T_B))
    st = s.seqs[0]
    assert (st.size_last_begin, st.idx_last_check) == (13, 13)
    d = s.propose(view(T_1), BIG)  # found by the scan of the prompt part; all of it hashed
    assert toks(d) == (10, 11)
    slot = map_hash((1, 2, 3))
    assert st.key_map[slot] == 1 and st.key_map_last_idx == 10
    s.accept(view(T_1 + [10, 6]), d, 1, {})
    # (1,2,3) occurs again at 14 and 20 (followed by 20,21) but the hash table keeps index 1
    # (insert-if-empty) and the draft is capped at the 1 token accepted last time.
    d = s.propose(view(T_2), BIG)
    assert toks(d) == (10,)
    assert st.key_map[slot] == 1
    # another speculator's draft (is_other) and a step without a draft change nothing
    s.accept(view(T_2), Draft((5,), "ngram-simple"), 0, {})
    s.accept(view(T_2), None, 0, {})
    assert toks(s.propose(view(T_2), BIG)) == (10,)
    # 0 accepted: this key never drafts again (llama.cpp's cap), until cleaned up
    s.accept(view(T_2), Draft((10,), "ngram-map-k"), 0, {})
    assert s.propose(view(T_2), BIG) is None
    assert toks(s.propose(view(T_2), DraftLimits(n_max=1))) is None


def test_map_k_begin_with_shorter_history_cleans_up(registry):
    s = map_k(registry)
    s.begin(view(T_B))
    s.propose(view(T_1), BIG)
    s.accept(view(T_1), Draft((10, 11), "ngram-map-k"), 0, {})
    s.propose(view(T_2), BIG)
    st = s.seqs[0]
    assert st.idx_last_check == len(T_2) - 1 and len(st.keys) == 1
    # prompt of 11 < B = 13: keep what starts before 11 - N - M = 6
    s.begin(view(T_2[:12]))
    assert (st.size_last_begin, st.idx_last_check, st.key_map_last_idx) == (11, 11, 5)
    assert st.key_map.max() < 6 and st.key_map[map_hash((1, 2, 3))] == 1
    assert [k.key_idx for k in st.keys] == [1]  # key record (and its cap of 0) survive
    assert s.propose(view(T_2), BIG) is None
    # a prompt of <= N + M tokens clears everything: the key drafts again, uncapped
    s.begin(view(T_2[:5]))
    assert st.keys == [] and not st.key_map.any() and st.key_map_last_idx == 0
    assert toks(s.propose(view(T_2), BIG)) == (20, 21)  # scan from the top finds the newest match
    # truncate is the same as a begin with the shorter history
    s.accept(view(T_2), Draft((20,), "ngram-map-k"), 0, {})
    s.truncate(view(T_2[:5]), 5)
    assert st.keys == [] and st.idx_last_check == 4
    # a longer new prompt prunes nothing
    s.begin(view(T_2))
    assert st.idx_last_check == len(T_2) - 1


def test_map_shorter_history_without_begin_acts_as_begin(registry):
    a, b = map_k(registry), map_k(registry)
    for s in (a, b):
        s.begin(view(T_B))
        s.propose(view(T_2), BIG)
    x = T_2[:23]  # shorter than the last draft's history, ends with the key (1, 2, 3)
    b.begin(view(x))  # what llama.cpp's server would have called
    assert toks(a.propose(view(x), BIG)) == toks(b.propose(view(x), BIG)) == (10, 11)
    sa, sb = a.seqs[0], b.seqs[0]
    assert (sa.size_last_begin, sa.key_map_last_idx, sa.idx_last_check) == (22, 16, 22)
    assert (sb.size_last_begin, sb.key_map_last_idx, sb.idx_last_check) == (22, 16, 22)
    assert np.array_equal(sa.key_map, sb.key_map)


def test_map_k_min_history_and_limits(registry):
    s = map_k(registry)  # needs len(prompt) >= 2N + M = 8
    assert s.propose(view([1, 2, 3, 4, 5, 6, 1, 2]), BIG) is None
    t = [0, 1, 2, 3, 4, 5, 9, 9, 9, 1, 2, 3]
    assert toks(s.propose(view(t), BIG)) == (4, 5)
    s2 = map_k(registry, m=6)
    t = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 1, 2, 3]
    assert toks(s2.propose(view(t), DraftLimits(n_max=3))) == (4, 5, 6)


# --- ngram-map-k4v --------------------------------------------------------------------------------
def k4v(registry, n=3, m=2, **kw):
    return make("ngram-map-k4v", registry, spec_ngram_map_k4v_size_n=n, spec_ngram_map_k4v_size_m=m, **kw)


def test_k4v_dominance_and_draft_from_most_recent_match(registry):
    # (1,2,3) followed by (10,11) twice, then by (20,21) once, then the key again.
    t = [0, 1, 2, 3, 10, 11, 7, 1, 2, 3, 10, 11, 7, 1, 2, 3, 20, 21, 7, 1, 2, 3]
    s = k4v(registry)
    d = s.propose(view(t), BIG)
    # (10,11) dominates 2 >= 2*1, but the draft is the text after the most recent match (20,21)
    assert toks(d) == (20, 21)
    rec = s.seqs[0].keys[0]
    assert [(v.idx, v.num) for v in rec.values] == [(4, 2), (16, 1), (0, 0), (0, 0)]
    assert rec.stat_idx == 13 and rec.key_num == 1
    # accept caps the dominant value, which gates every draft of this key
    s.accept(view(t), d, 1, {})
    assert rec.values[0].n_accepted == 1 and rec.values[1].n_accepted == 2
    # quirk: the stats scan resumes *at* the previous match, so (20,21) is counted again: 2 vs 2
    assert s.propose(view(t), BIG) is None
    assert [v.num for v in rec.values] == [2, 2, 0, 0] and rec.key_num == 2


def test_k4v_no_dominant_value(registry):
    t = [0, 1, 2, 3, 10, 11, 7, 1, 2, 3, 20, 21, 7, 1, 2, 3]
    assert k4v(registry).propose(view(t), BIG) is None  # 1 vs 1
    t = [0] + [1, 2, 3, 10, 11, 7] * 3 + [1, 2, 3, 20, 21, 7] * 2 + [1, 2, 3]
    assert k4v(registry).propose(view(t), BIG) is None  # 3 < 2 * 2
    t = [0] + [1, 2, 3, 10, 11, 7] * 4 + [1, 2, 3, 20, 21, 7] * 2 + [1, 2, 3]
    assert toks(k4v(registry).propose(view(t), BIG)) == (20, 21)  # 4 >= 2 * 2


def test_k4v_min_hits_and_key_only_ignores_it(registry):
    t = [0, 1, 2, 3, 10, 11, 7, 1, 2, 3, 10, 11, 7, 1, 2, 3]
    s = k4v(registry, spec_ngram_map_k4v_min_hits=2)
    assert s.propose(view(t), BIG) is None  # first lookup of the key
    assert toks(s.propose(view(t), BIG)) == (10, 11)
    k = map_k(registry, spec_ngram_map_k_min_hits=5)
    assert toks(k.propose(view(t), BIG)) == (10, 11)


def test_k4v_begin_drops_values_past_the_cut(registry):
    t = [0, 1, 2, 3, 10, 11, 7, 1, 2, 3, 10, 11, 7, 1, 2, 3, 20, 21, 7, 1, 2, 3]
    s = k4v(registry)
    s.begin(view(t[:2]))
    s.propose(view(t), BIG)
    rec = s.seqs[0].keys[0]
    assert [v.idx for v in rec.values] == [4, 16, 0, 0]
    s.begin(view(t[:16]))  # prompt of 15 > B = 1: cleanup at B = 1 -> the key at 13 goes
    assert s.seqs[0].keys == []
    s = k4v(registry)
    s.begin(view(t[:21]))  # B = 20: the scan of the prompt part finds the key at 13
    assert toks(s.propose(view(t), BIG)) == (20, 21)
    rec = s.seqs[0].keys[0]
    assert rec.key_idx == 13 and [v.idx for v in rec.values] == [4, 16, 0, 0]
    s.begin(view(t[:20]))  # prompt of 19 < B: cleanup = 19 - N - M = 14 -> the value at 16 goes
    assert [v.idx for v in rec.values] == [4, 0, 0, 0] and [v.num for v in rec.values] == [2, 0, 0, 0]
    assert s.seqs[0].keys == [rec]


# --- per-sequence state ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ngram-map-k", "ngram-map-k4v"])
def test_map_sequences_do_not_leak(name, registry):
    opts = {f"spec_{name.replace('-', '_')}_size_n": 3, f"spec_{name.replace('-', '_')}_size_m": 2}
    s = make(name, registry, **opts)
    a = [0, 1, 2, 3, 10, 11, 7, 1, 2, 3, 10, 11, 7, 1, 2, 3]
    b = [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 1, 2, 3]
    s.begin(view(a[:2], 0))
    s.begin(view(b[:2], 1))
    assert toks(s.propose(view(a, 0), BIG)) == (10, 11)
    assert s.propose(view(b, 1), BIG) is None  # seq 1 never saw (1,2,3, ...)
    s.accept(view(a, 0), Draft((10, 11), name), 0, {})  # caps seq 0's value at 0
    assert toks(s.propose(view(a, 2), BIG)) == (10, 11)  # seq 2 has its own map, uncapped
    assert s.propose(view(a, 0), BIG) is None
    s.end(0)
    assert 0 not in s.seqs and 1 in s.seqs
    s.end(1)
    s.end(2)
    s.end(7)  # unknown ids are fine
    assert s.seqs == {}


# --- ngram-mod ------------------------------------------------------------------------------------
def mod(registry, n=3, n_min=2, n_max=5):
    return make("ngram-mod", registry, spec_ngram_mod_n_match=n, spec_ngram_mod_n_min=n_min, spec_ngram_mod_n_max=n_max)


def mod_index(window, size=4 * 1024 * 1024):
    h = 0
    for t in window:
        h = (h * 6364136223846793005 + t) & 0xFFFFFFFFFFFFFFFF
    return h % size


def test_mod_hash_matches_64_bit_wrapping_hash(registry):
    s = mod(registry, n=24)
    rng = random.Random(1)
    windows = [[rng.randrange(0, 2**31 - 1) for _ in range(24)] for _ in range(200)]
    windows += [[rng.randrange(0, 300) for _ in range(24)] for _ in range(200)]
    for w in windows:
        assert s.pool.index(w) == mod_index(w)
    # the vectorised insertion computes the same slots: check where each window's value landed
    flat = [t for w in windows for t in w]
    arr = np.array(flat, dtype=np.int32)
    slots = {}
    for i in range(len(flat) - 24):
        slots[mod_index(flat[i : i + 24])] = flat[i + 24]  # sequential: the last write wins
    s.pool.add_range(arr, len(flat) - 24)
    assert s.pool.used == len(slots)
    for slot, value in slots.items():
        assert s.pool.entries[slot] == value
    # rolling the index one token at a time equals hashing the slid window
    w = windows[0]
    idx = s.pool.index(w)
    for t in windows[1]:
        idx = s.pool.roll(idx, w[0], t)
        w = w[1:] + [t]
        assert idx == mod_index(w)


def test_mod_batch_add_equals_sequential_add(registry):
    s1, s2 = mod(registry, n=2), mod(registry, n=2)
    rng = random.Random(2)
    seq = [rng.randrange(4) for _ in range(300)]  # many repeated keys with changing values
    for i in range(len(seq) - 2):
        s1.pool.add(seq[i : i + 3])
    s2.pool.add_range(np.array(seq, dtype=np.int32), len(seq) - 2)
    assert s1.pool.used == s2.pool.used <= 16
    assert np.array_equal(s1.pool.entries, s2.pool.entries)


def test_mod_draft_follows_pool_and_n_min(registry):
    s = mod(registry)
    s.begin(view([1, 2, 3, 4, 5, 6, 7, 8, 9, 50]))  # prompt 1..9: windows up to (5,6,7)->8... (6,7,8)->9
    assert s.seqs[0].i_last == 6
    t = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2, 3]
    assert toks(s.propose(view(t), BIG)) == (4, 5, 6, 7, 8)  # n_max = 5
    assert toks(s.propose(view(t), DraftLimits(n_max=2))) == (4, 5)
    long = mod(registry, n_max=10)
    long.begin(view([1, 2, 3, 4, 5, 6, 7, 8, 9, 50]))
    assert toks(long.propose(view(t), BIG)) == (4, 5, 6, 7, 8, 9)  # stops at the first miss
    short = mod(registry, n_min=7, n_max=10)
    short.begin(view([1, 2, 3, 4, 5, 6, 7, 8, 9, 50]))
    assert short.propose(view(t), BIG) is None  # dry after 6 < n_min tokens: dropped
    assert s.propose(view([1, 2]), BIG) is None


def test_mod_lazy_chunked_insertion(registry):
    s = mod(registry, n=3, n_min=1, n_max=3)
    base = list(range(100, 110))
    s.begin(view(base))  # prompt of 9 tokens, i_last = 6
    mid = base + list(range(200, 221))
    t = mid + [7] * 5 + [200, 201, 202]  # prompt of 38: 6 + 32 < 38 is false, nothing added
    assert s.propose(view(t), BIG) is None
    t = mid + [7] * 6 + [200, 201, 202]  # prompt of 39: windows 6..35 added, (200,201,202)->203 among them
    assert toks(s.propose(view(t), BIG)) == (203, 204, 205)
    assert s.seqs[0].i_last == 36


def test_mod_pool_is_shared_between_sequences(registry):
    s = mod(registry)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    s.begin(view(pattern + [0, 0], seq_id=0))
    s.begin(view([5, 5, 5, 5], seq_id=1))
    assert toks(s.propose(view([5, 5, 5, 5, 11, 12, 13], seq_id=1), BIG)) == (14, 15, 16, 17, 18)
    s.end(0)  # the pool outlives the sequence that filled it
    assert 0 not in s.seqs
    assert toks(s.propose(view([9, 11, 12, 13], seq_id=2), BIG)) == (14, 15, 16, 17, 18)


def test_mod_low_acceptance_reset(registry):
    s = mod(registry)
    s.begin(view([1, 2, 3, 4, 5, 6, 7, 8, 9, 50]))
    t = view([1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2, 3])
    for _ in range(4):
        d = s.propose(t, BIG)
        s.accept(t, d, 1, {})  # 1/5 < 0.25
    assert s.seqs[0].n_low == 4
    d = s.propose(t, BIG)
    s.accept(t, d, 2, {})  # 2/5 >= 0.25 ends the streak
    assert s.seqs[0].n_low == 0
    for _ in range(4):
        s.accept(t, s.propose(t, BIG), 0, {})
    s.accept(t, Draft((4,), "ngram-simple"), 0, {})  # another type's draft does not count
    s.accept(t, None, 0, {})
    assert s.seqs[0].n_low == 4 and s.pool.used > 0
    d = s.propose(t, DraftLimits(n_max=4))
    s.accept(t, d, 1, {})  # the fraction is over what was verified: 1/4 is not low
    assert s.seqs[0].n_low == 0
    for _ in range(5):
        s.accept(t, s.propose(t, BIG), 0, {})
    assert s.pool.used == 0 and (s.pool.entries == -1).all()
    assert s.seqs[0].n_low == 0 and s.seqs[0].i_last == 0
    assert s.propose(t, BIG) is None


def test_mod_occupancy_reset_after_begin(registry):
    quarter = 4 * 1024 * 1024 // 4
    s = make("ngram-mod", registry, spec_ngram_mod_n_match=1)  # slot = token id, no collisions
    s.begin(view(list(range(quarter + 1)) + [0]))  # prompt of quarter+1 tokens: quarter windows
    assert s.pool.used == quarter  # exactly 25%: kept
    s.begin(view([quarter + 5, quarter + 6, 3], seq_id=1))  # one more entry: > 25% -> wiped
    assert s.pool.used == 0 and (s.pool.entries == -1).all()
    assert s.seqs[1].i_last == 1  # llama.cpp keeps i_last: this prompt's n-grams are gone too


# --- end to end -----------------------------------------------------------------------------------
class CopyContext:
    state_kind = "kv"

    def __init__(self):
        self.rows: dict[int, list[tuple[int, int]]] = {}  # (token, rolling hash) per position

    def length(self, seq_id):
        return len(self.rows.get(seq_id, []))

    def truncate(self, seq_id, n):
        if seq_id in self.rows:
            del self.rows[seq_id][n:]

    def drop(self, seq_id):
        self.rows.pop(seq_id, None)


class CopyModel(ToyModel):
    """ToyModel's random logits plus a strong vote for the token that followed the previous
    occurrence of the last 3 (else 2, else 1) tokens, an induction head: repetitive text keeps
    repeating with occasional slips, so n-gram drafts get partly accepted. Still a fixed
    function of the history."""

    def new_context(self, max_tokens):
        return CopyContext()

    def forward(self, batch, ctx, hidden_layers=()):
        self.forward_calls += 1
        out = []
        for seq_id, pos, tok, want in zip(batch.seq_ids, batch.positions, batch.tokens, batch.want_logits):
            rows = ctx.rows.setdefault(seq_id, [])
            assert pos == len(rows)
            rows.append((tok, _next_hash(rows[-1][1] if rows else 0, tok)))
            if want:
                logits = _logits(rows[-1][1])
                hist = [r[0] for r in rows]
                for k in (3, 2, 1):  # back off to shorter contexts, so it returns to the loop after a slip
                    j = next((j for j in range(len(hist) - k - 1, -1, -1) if hist[j : j + k] == hist[-k:]), None)
                    if j is not None:
                        logits[hist[j + k]] += 12.0
                        break
                out.append(logits)
        return ForwardOutput(torch.stack(out) if out else torch.empty(0, N_VOCAB), {})


BLOCK = [(7 * i + 3) % 30 + 1 for i in range(30)]  # a permutation of 1..30 (no EOS)
PROMPT = BLOCK * 5 + BLOCK[:10]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=4)]


def run(model_cls, speculators, params, n=60, adaptive=False):
    engine = Engine(model_cls(), EngineConfig(n_ctx=512, draft_n_max=16, adaptive=adaptive), speculators)
    out = list(engine.generate(PROMPT, n, params))
    return out, engine


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "temp"])
@pytest.mark.parametrize("name", NAMES)
def test_engine_output_equals_plain_decoding(name, params, registry):
    truth, _ = run(CopyModel, [], params)
    assert len(truth) == 60 and EOS not in truth
    out, engine = run(CopyModel, build_speculators([name], {}, registry=registry), params)
    assert out == truth
    stats = engine.last_sequence.stats
    assert stats.n_drafts > 0 and stats.n_accepted > 0
    assert engine.spec_stats[name].accepted == stats.n_accepted
    # the speculator's per-sequence state was freed when the sequence ended
    spec = engine.chain.speculators[0]
    assert getattr(spec, "seqs", {}) == {}


@pytest.mark.parametrize("name", NAMES)
def test_engine_random_model_and_adaptive(name, registry):
    # ToyModel ignores repetition: drafts are mostly rejected, output must still be exact.
    params = PARAMS[1]
    truth, _ = run(ToyModel, [], params, n=40)
    out, _ = run(ToyModel, build_speculators([name], {}, registry=registry), params, n=40)
    assert out == truth
    truth, _ = run(CopyModel, [], params, n=40)
    out, _ = run(CopyModel, build_speculators([name], {}, registry=registry), params, n=40, adaptive=True)
    assert out == truth


def test_engine_two_sequences_share_one_chain(registry):
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    prompts = [PROMPT, BLOCK[5:] * 3 + BLOCK[:20]]
    singles = [list(Engine(CopyModel(), EngineConfig(n_ctx=512)).generate(p, 40, params)) for p in prompts]
    specs = build_speculators(["ngram-simple", "ngram-map-k4v", "ngram-mod"], {}, registry=registry)
    engine = Engine(CopyModel(), EngineConfig(n_ctx=512, draft_n_max=16, adaptive=False), specs)
    seqs = [engine.add(p, 40, params) for p in prompts]
    while engine.active():
        engine.step()
    assert [s.tokens[s.n_prompt :] for s in seqs] == singles
    assert all(s.stats.n_accepted > 0 for s in seqs)
