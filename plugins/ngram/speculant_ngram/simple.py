"""ngram-simple: llama.cpp's plain backwards search of the history (no state at all).

The last N tokens (prompt's last N-1 plus id_last) are looked up in the history, most recent
occurrence first, and the up to M tokens that followed that occurrence are the draft.
"""
from __future__ import annotations

from speculant import Draft, DraftLimits, SequenceView, hookimpl
from speculant.speculator import SpeculatorConfig

from speculant_ngram._common import History, int_option, tokens_of


class NgramSimple:
    spec_type = "ngram-simple"
    # The plugin contract's texts repeat segments of 4-12 tokens: shorter n-grams make them draft.
    contract_options = {"spec_ngram_simple_size_n": 3, "spec_ngram_simple_size_m": 8}

    def __init__(self, config: SpeculatorConfig):
        self.size_n = int_option(config, "spec_ngram_simple_size_n", 12, 1, 1024)
        self.size_m = int_option(config, "spec_ngram_simple_size_m", 48, 1, 1024)
        # llama.cpp has the flag but ngram-simple never reads it; kept so the flag set matches.
        self.min_hits = int_option(config, "spec_ngram_simple_min_hits", 1, 1)
        self.n_max = self.size_m

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        t = tokens_of(seq)
        n, m = self.size_n, self.size_m
        L = len(t) - 1  # len(prompt); t[L] is id_last
        if L <= n + m + 1:  # llama.cpp wants more than N + M + 1 tokens before it searches
            return None
        key = t[L - n + 1 :]  # prompt[L-N+1:L] + [id_last], N tokens
        # Descending from L-N-1: the occurrence overlapping the key by all but one token (j = L-N)
        # is skipped, and j = 0 is never tried (0 means "no match" in llama.cpp).
        match = History(t).rfind(key, 1, L - n - 1)
        if match < 0:
            return None
        k = min(m, L - (match + n))
        if k < n:  # quirk kept: fewer than N follow-up tokens means no draft at all
            return None
        k = min(k, limits.n_max)  # the caller's per-round cap truncates afterwards, as llama.cpp's dispatcher does
        if k <= 0:
            return None
        return Draft(t[match + n : match + n + k], self.spec_type)
