"""Can a draft model draft for a target? llama.cpp's rules (common/speculative.cpp):

* the same vocabulary type (SentencePiece or byte-level BPE);
* the same add-BOS flag and, when it is set, the same BOS id; likewise for EOS;
* vocabulary sizes differ by at most 128 (model families pad their vocabularies differently);
* the same text for every token id from 5 up to the smaller size (ids 0..4 are specials that
  families name differently).
"""
from __future__ import annotations

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


def vocab_mismatch(target, draft) -> str | None:
    """Why the draft tokenizer cannot serve the target tokenizer, or None when it can."""
    if target.vocab_type != draft.vocab_type:
        return f"vocabulary types differ (target {target.vocab_type}, draft {draft.vocab_type})"
    for what, add, tok in (("BOS", "add_bos", "bos_id"), ("EOS", "add_eos", "eos_id")):
        t_add, d_add = bool(getattr(target, add)), bool(getattr(draft, add))
        if t_add != d_add or (t_add and getattr(target, tok) != getattr(draft, tok)):
            return (f"{what} tokens differ (target adds {what}: {t_add}, id {getattr(target, tok)}; "
                    f"draft adds {what}: {d_add}, id {getattr(draft, tok)})")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return (f"vocabulary sizes differ by {diff} (target {target.n_vocab}, draft {draft.n_vocab}; "
                f"at most {VOCAB_MAX_SIZE_DIFFERENCE} allowed)")
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        t, d = target.token_text(i), draft.token_text(i)
        if t != d:
            return f"token {i} differs (target {t!r}, draft {d!r})"
    return None
