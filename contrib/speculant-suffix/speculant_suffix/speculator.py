"""Suffix decoding (Arctic Inference's, arXiv 2411.04975) as a speculant speculator.

Two kinds of suffix index, each a counted suffix automaton (automaton.py):

* per sequence: its prompt and everything generated so far, extended token by token as they are
  accepted (what the request itself repeats: code being edited, a table being copied);
* global, shared by every sequence this speculator serves: the outputs of the sequences that
  have ended (what the workload repeats across requests). An output joins when its sequence
  ends, so the shared index only ever holds final text and a truncate never has to reach it.

To draft, the last ``max_depth - 1`` tokens are matched in each index. The match and each of its
shorter suffixes (one per suffix-automaton state, so a handful) is a candidate: follow its most
frequent continuation while the path's estimated probability stays above ``min_token_prob``,
for at most ``max_spec_factor x match length`` tokens. The candidate with the highest score (the
expected number of accepted tokens, sum of the path probabilities) is the draft.

Memory is bounded: the global index keeps at most ``max_cached_tokens`` tokens in two
generations; when the young one is full the old one is dropped and the young one takes its
place, so eviction is O(1) and there is never a rebuild. A sequence's own index is bounded by
its length (the context size); it is rebuilt only when its history is cut (truncate, restore).
"""
from __future__ import annotations

import sys

from speculant import Draft, DraftLimits, SequenceView, SpeculantError, hookimpl

from speculant_suffix.automaton import SuffixAutomaton

DEFAULTS = {  # vLLM's suffix_decoding_* defaults, except the cache, which counts tokens here
    "max_depth": 24,
    "max_spec_factor": 1.0,
    "min_token_prob": 0.1,
    "max_cached_tokens": 1 << 17,  # ~50 MB at ~0.4 KB per token
}


def _option(config, name: str, kind, low, high=None):
    value = config.options.get(f"spec_suffix_{name}")
    value = DEFAULTS[name] if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise SpeculantError(f"--spec-suffix-{name.replace('_', '-')} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise SpeculantError(f"--spec-suffix-{name.replace('_', '-')} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return kind(value)


class GlobalIndex:
    """Outputs of ended sequences in two generations of at most max_tokens / 2 tokens each."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.old: SuffixAutomaton | None = None
        self.young = SuffixAutomaton(max_depth)

    def add(self, tokens) -> None:
        half = self.max_tokens // 2
        if half == 0 or not tokens:
            return
        tokens = tokens[-half:]  # an output longer than a generation keeps its end
        if len(self.young) + len(tokens) > half:
            self.old, self.young = self.young, SuffixAutomaton(self.max_depth)
        self.young.start()
        self.young.extend(tokens)

    def automata(self):
        return [a for a in (self.young, self.old) if a is not None and len(a)]

    def __len__(self) -> int:
        return sum(len(a) for a in self.automata())


class _Seq:
    __slots__ = ("tokens", "n_prompt", "index", "saved")

    def __init__(self, tokens, n_prompt: int, max_depth: int):
        self.tokens: list[int] = []
        self.n_prompt = n_prompt
        self.index = SuffixAutomaton(max_depth)
        self.saved: int | None = None
        self.sync(tokens)

    def sync(self, tokens) -> None:
        """Make the index hold exactly `tokens` (the history only grows between calls, except
        after a cut, which rebuilds)."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[-1]):
            self.index = SuffixAutomaton(self.index.max_depth)
            self.tokens, n = [], 0
        new = tokens[n:]
        self.index.extend(new)
        self.tokens.extend(new)


class SuffixSpeculator:
    spec_type = "suffix"
    # The global index drafts for one sequence from the ended outputs of others: the contract's
    # isolation tests then check that unrelated text does not change a sequence's drafts.
    shared_across_sequences = True

    def __init__(self, config):
        self.max_depth = _option(config, "max_depth", int, 2, 1024)
        self.max_spec_factor = _option(config, "max_spec_factor", float, 0.0)
        self.min_token_prob = _option(config, "min_token_prob", float, 0.0, 1.0)
        self.global_index = GlobalIndex(self.max_depth, _option(config, "max_cached_tokens", int, 0))
        self.seqs: dict[int, _Seq] = {}

    def _seq(self, seq: SequenceView) -> _Seq:
        st = self.seqs.get(seq.seq_id)
        if st is None:  # no begin seen (a speculator added to a running chain): index what is there
            st = self.seqs[seq.seq_id] = _Seq(seq.tokens, seq.n_prompt, self.max_depth)
        else:
            st.sync(seq.tokens)
        return st

    # --- hooks ----------------------------------------------------------------------------------
    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        self.seqs[seq.seq_id] = _Seq(seq.tokens, seq.n_prompt, self.max_depth)

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        st = self._seq(seq)
        context = st.tokens
        min_prob = max(self.min_token_prob, limits.p_min)
        best, best_score = None, 0.0
        for index in (st.index, *self.global_index.automata()):
            state, n = index.match(context)
            for s, m in index.suffixes(state, n):
                k = min(limits.n_max, int(self.max_spec_factor * m + 1e-9))
                if k <= 0:
                    break  # shorter matches allow even fewer tokens
                tokens, score = index.greedy_path(s, m, k, min_prob)
                if score > best_score:
                    best, best_score = tokens, score
        if not best:
            return None
        return Draft(tuple(best), self.spec_type)

    @hookimpl
    def accept(self, seq: SequenceView) -> None:
        self._seq(seq)

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        self._seq(SequenceView(seq.seq_id, tuple(seq.tokens[:n]), min(seq.n_prompt, n)))

    @hookimpl
    def checkpoint(self, seq: SequenceView, action: str) -> None:
        st = self._seq(seq) if action == "save" else self.seqs.get(seq.seq_id)
        if st is None:
            return
        if action == "save":
            st.saved = len(st.tokens)
        elif action == "restore" and st.saved is not None:
            st.sync(st.tokens[: st.saved])
        if action != "save":
            st.saved = None

    @hookimpl
    def state_nbytes(self, seq_id: int) -> int | None:
        """The sequence's own index and token list (the global index is shared, not its)."""
        st = self.seqs.get(seq_id)
        return None if st is None else st.index.nbytes() + sys.getsizeof(st.tokens)

    @hookimpl
    def end(self, seq_id: int) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is not None:
            self.global_index.add(st.tokens[st.n_prompt:])
