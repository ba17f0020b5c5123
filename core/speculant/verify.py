"""Verification: which draft tokens the target keeps, plus the one token the target adds.

Two modes:
* sample-and-match (drafts without probabilities, and always at temperature 0): the target samples
  each position with its own sampler and a draft token is kept while it equals the sample. The
  random stream is consumed exactly as plain decoding would, so the tokens are identical.
* rejection sampling (drafts with probabilities, temperature > 0): keep token x with probability
  min(1, p(x)/q(x)); on rejection draw from the normalized residual max(p - q, 0). The output is
  distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).
No draft token is kept after an end-of-generation token.
"""
from __future__ import annotations

import torch

from speculant.sampling import Sampler
from speculant.types import Draft


def verify(sampler: Sampler, logits: torch.Tensor, draft: Draft | None, eog: frozenset[int]) -> tuple[list[int], int]:
    """logits: [len(draft) + 1, V], row i predicts the token after draft[:i].
    Returns (emitted tokens, number of draft tokens among them)."""
    tokens = draft.tokens if draft is not None else ()
    if draft is not None and draft.probs is not None and not sampler.params.greedy:
        return _rejection(sampler, logits, draft, eog)
    emitted: list[int] = []
    n_accepted = 0
    for i in range(len(tokens) + 1):
        t = sampler.sample(logits[i])
        emitted.append(t)
        if i == len(tokens) or t != tokens[i]:
            break
        n_accepted += 1
        if t in eog:
            break
    return emitted, n_accepted


def _rejection(sampler: Sampler, logits: torch.Tensor, draft: Draft, eog: frozenset[int]) -> tuple[list[int], int]:
    emitted: list[int] = []
    for i, x in enumerate(draft.tokens):
        p = sampler.probs(logits[i])
        q = draft.probs[i].float()
        u = torch.rand((), generator=sampler.generator, dtype=torch.float64)
        if q[x] > 0 and u * q[x] <= p[x]:
            emitted.append(x)
            if x in eog:
                return emitted, len(emitted)
            continue
        residual = torch.clamp(p - q, min=0)
        t = sampler.sample_from(residual) if residual.sum() > 0 else sampler.sample_from(p)
        emitted.append(t)
        return emitted, i
    emitted.append(sampler.sample(logits[len(draft.tokens)]))
    return emitted, len(draft.tokens)
