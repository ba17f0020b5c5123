"""The counted suffix automaton against brute-force counting over the same sequences."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from speculant_suffix.automaton import SuffixAutomaton

sequences = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=4)


def brute_continuations(seqs, x: tuple[int, ...]) -> dict[int, int]:
    out: dict[int, int] = {}
    n = len(x)
    for s in seqs:
        for i in range(len(s) - n):
            if tuple(s[i : i + n]) == x:
                out[s[i + n]] = out.get(s[i + n], 0) + 1
    return out


def occurs(seqs, x) -> bool:
    n = len(x)
    return any(tuple(s[i : i + n]) == tuple(x) for s in seqs for i in range(len(s) - n + 1))


def build(seqs, depth):
    a = SuffixAutomaton(depth)
    for s in seqs:
        a.start()
        a.extend(s)
    return a


@settings(max_examples=200, deadline=None)
@given(sequences, st.lists(st.integers(0, 3), max_size=12), st.integers(2, 6))
def test_match_and_counts_equal_brute_force(seqs, context, depth):
    a = build(seqs, depth)
    state, n = a.match(context)
    window = context[max(0, len(context) - (depth - 1)):]
    # the longest suffix of the last depth-1 tokens that occurs anywhere
    expect = max((k for k in range(len(window) + 1) if occurs(seqs, window[len(window) - k:])), default=0)
    assert n == expect
    # every candidate on the suffix-link path has the brute-force continuation counts of its string
    for s, m in a.suffixes(state, n):
        x = tuple(window[len(window) - m:])
        assert a.continuations(s) == brute_continuations(seqs, x)
    assert len(a) == sum(len(s) for s in seqs)


@settings(max_examples=100, deadline=None)
@given(sequences, st.integers(2, 5))
def test_every_short_substring_has_its_count(seqs, depth):
    """Counts are kept for strings up to max_depth tokens, including those inside long repeats."""
    a = build(seqs, depth)
    for s in seqs:
        for i in range(len(s)):
            for k in range(1, depth):
                x = s[i : i + k]
                if len(x) < k:
                    break
                state, n = a.match(x)
                assert n == k
                assert a.continuations(state) == brute_continuations(seqs, tuple(x))


def test_greedy_path_follows_the_most_frequent_continuation():
    a = build([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [9, 2, 3, 5, 6]], 8)
    state, n = a.match([7, 2, 3])
    assert n == 2  # "2 3"
    tokens, score = a.greedy_path(state, n, 8, 0.0)
    # "2 3" is followed by 5 three times out of four; "2 3 5" by 6 in the one case it is followed at all
    assert tokens == [5, 6] and score == 0.75 + 0.75
    assert a.greedy_path(state, n, 8, 0.8) == ([], 0.0)  # 0.75 < 0.8 stops the path at once
    state, n = a.match([1, 2, 3])
    assert a.greedy_path(state, n, 8, 0.6) == ([5], 2 / 3)  # then "1 2 3 5" has no continuation
    assert a.greedy_path(state, n, 1, 0.0)[0] == [5]


def test_greedy_path_slides_past_max_depth():
    """A long repeat keeps drafting: the path conditions on its last max_depth - 1 tokens."""
    seq = list(range(20)) * 2
    a = build([seq], 4)
    state, n = a.match([0, 1, 2])
    tokens, _ = a.greedy_path(state, n, 30, 0.5)
    assert tokens == list(range(3, 20)) + list(range(0, 13))
