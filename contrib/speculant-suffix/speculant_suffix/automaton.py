"""A counted suffix automaton over token sequences, built online.

The automaton of a set of sequences has one state per class of substrings that end at the same
set of positions ("endpos"), at most 2N states for N tokens, and accepts every substring. Each
state also counts its positions, which is what suffix decoding needs: for the string x of a
state, ``count[next[x][t]]`` is how often x was followed by token t.

Counting every position on every state would cost O(N) per token (a position belongs to every
suffix of the text before it), so counts are kept for strings of at most ``max_depth`` tokens
only, as Arctic Inference's depth-limited suffix tree does: appending a token walks the suffix
links from the state of the last ``max_depth`` tokens to the root, O(max_depth). Lookups
therefore condition on at most ``max_depth - 1`` tokens, so every count they read is kept.

Several sequences share one automaton (a generalized suffix automaton: each sequence starts again
from the root), so a substring's count is its number of occurrences over all of them.
Nothing can be removed; callers bound memory by dropping a whole automaton (speculator.py).

Memory: at most 2 states and 3 transitions per token; measured ~0.4 KB per token in CPython 3.11
(the per-state dicts dominate).
"""
from __future__ import annotations

import sys
from array import array


class SuffixAutomaton:
    __slots__ = ("max_depth", "length", "link", "count", "next", "last", "tail", "tail_len", "n_tokens")

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2 (one token of context and one to predict)")
        self.max_depth = max_depth
        self.length = array("i", [0])  # longest string of each state
        self.link = array("i", [-1])  # suffix link: the state of the longest suffix in another class
        self.count = array("i", [0])  # positions of the state (kept for states with strings <= max_depth)
        self.next: list[dict[int, int]] = [{}]  # token -> state
        self.last = 0  # state of the whole sequence being appended
        self.tail = 0  # state of its last min(max_depth, n) tokens ...
        self.tail_len = 0  # ... and that length
        self.n_tokens = 0

    def __len__(self) -> int:
        return self.n_tokens

    def nbytes(self) -> int:
        """The memory the automaton takes (its arrays, and each state's transition dict): what a
        kept conversation's index costs the prompt cache."""
        return (sys.getsizeof(self.length) + sys.getsizeof(self.link) + sys.getsizeof(self.count)
                + sys.getsizeof(self.next) + sum(map(sys.getsizeof, self.next)))

    # --- building ---------------------------------------------------------------------------
    def start(self) -> None:
        """The next append begins a new sequence."""
        self.last = self.tail = self.tail_len = 0

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        self._extend(token)
        length, link, count = self.length, self.link, self.count
        # Follow the sequence's last max_depth tokens: their state before this token may have
        # been split by _extend (its shorter strings moved to the clone, which is its link).
        v, n = self.tail, self.tail_len
        if v and n <= length[link[v]]:
            v = link[v]
        v, n = self.next[v][token], n + 1
        if n > self.max_depth:
            n = self.max_depth
            while length[link[v]] >= n:
                v = link[v]
        self.tail, self.tail_len = v, n
        # The new position ends every suffix of those tokens: one more occurrence for each state
        # on the suffix-link path (at most max_depth of them).
        while v > 0:
            count[v] += 1
            v = link[v]
        self.n_tokens += 1

    def _new_state(self, length: int, link: int, count: int, nxt: dict) -> int:
        self.length.append(length)
        self.link.append(link)
        self.count.append(count)
        self.next.append(nxt)
        return len(self.next) - 1

    def _clone(self, q: int, length: int) -> int:
        clone = self._new_state(length, self.link[q], self.count[q], dict(self.next[q]))
        self.link[q] = clone
        return clone

    def _redirect(self, p: int, token: int, q: int, clone: int) -> None:
        nxt, link = self.next, self.link
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]

    def _extend(self, c: int) -> None:
        """The textbook online construction, generalized to several sequences."""
        nxt, length, link = self.next, self.length, self.link
        last = self.last
        q = nxt[last].get(c)
        if q is not None:  # the sequence so far plus c occurred already (in an earlier sequence)
            if length[q] == length[last] + 1:
                self.last = q
            else:
                clone = self._clone(q, length[last] + 1)
                self._redirect(last, c, q, clone)
                self.last = clone
            return
        cur = self._new_state(length[last] + 1, 0, 0, {})
        p = last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._clone(q, length[p] + 1)
                self._redirect(p, c, q, clone)
                link[cur] = clone
        self.last = cur

    # --- lookups --------------------------------------------------------------------------------
    def match(self, context) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context`, at most max_depth - 1 tokens long,
        that occurs in the automaton; (0, 0) when not even its last token does."""
        nxt, link, length = self.next, self.link, self.length
        v = n = 0
        for c in context[max(0, len(context) - (self.max_depth - 1)):]:
            while v and c not in nxt[v]:
                v = link[v]
                n = length[v]
            u = nxt[v].get(c)
            if u is None:
                v = n = 0
            else:
                v, n = u, n + 1
        return v, n

    def suffixes(self, state: int, n: int):
        """(state, match length) for the match and each shorter suffix with a different set of
        continuations, longest first (the suffix-link path), root excluded."""
        length, link = self.length, self.link
        while state > 0:
            yield state, n
            state = link[state]
            n = length[state]

    def continuations(self, state: int) -> dict[int, int]:
        """token -> how often the state's string was followed by it."""
        count = self.count
        return {t: count[u] for t, u in self.next[state].items()}

    def greedy_path(self, state: int, n: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent continuation from (state, n) while the path's probability
        (product of count(child) / count(all children) along it) stays >= min_prob.

        Returns the tokens and their score, the sum of the path probabilities after each token:
        the expected number of them the target accepts if the counts are its distribution."""
        nxt, count, link, length = self.next, self.count, self.link, self.length
        limit = self.max_depth - 1
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < max_tokens:
            best_t = best_u = -1
            best = total = 0
            for t, u in nxt[state].items():
                c = count[u]
                total += c
                if c > best:  # strict: ties keep the first-seen token (deterministic)
                    best, best_t, best_u = c, t, u
            if best == 0:
                break
            prob *= best / total
            if prob < min_prob:
                break
            tokens.append(best_t)
            score += prob
            state, n = best_u, n + 1
            if n > limit:  # condition on the last max_depth - 1 tokens only
                n = limit
                while length[link[state]] >= n:
                    state = link[state]
        return tokens, score
