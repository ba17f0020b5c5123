"""Draft-model speculators: a smaller model with the target's vocabulary drafts greedily.

``draft-simple`` (llama.cpp's name and semantics): ``-md DRAFT.gguf --spec-type draft-simple``,
also in a chain (``ngram-simple,draft-simple``). One draft context serves every sequence, and
each draft step is one batched forward for all sequences still drafting (``propose_batch``).
"""
from __future__ import annotations

from speculant import hookimpl

from speculant_draft.simple import DraftSimple, load_draft_model
from speculant_draft.vocab import vocab_mismatch

SPECULATORS = {DraftSimple.spec_type: DraftSimple}

__all__ = ["DraftSimple", "SPECULATORS", "load_draft_model", "vocab_mismatch"]


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)
