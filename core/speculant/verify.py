"""Verification: which draft tokens the target keeps, plus the one token the target adds.

Two modes:
* sample-and-match (drafts without probabilities, and always at temperature 0): the target samples
  each position with its own sampler and a draft token is kept while it equals the sample. The
  random stream is consumed exactly as plain decoding would, so the tokens are identical.
* rejection sampling (drafts with probabilities, temperature > 0): keep token x with probability
  min(1, p(x)/q(x)); on rejection draw from the normalized residual max(p - q, 0). The output is
  distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).
No draft token is kept after an end-of-generation token.

With a constraint (speculant.constraint), row i is masked with the constraint's state after the
draft's first i tokens: the constraint advances with each token emitted, in order, so the rows
are masked lazily as they are reached and the state ends at the tokens emitted (the caller rolls
it back if it keeps fewer). Rejection sampling masks the draft's probabilities the same way and
renormalises them: a draft token the constraint allows is, given that it is allowed, a draw from
the masked draft distribution, and one it rejects never reaches verification (the engine cuts the
draft there), so the output is distributed as constrained sampling.
"""
from __future__ import annotations

import torch

from speculant.constraint import Constraint, apply_mask, mask_probs
from speculant.sampling import Sampler
from speculant.types import Draft


class _Rows:
    """The verification's logits rows, masked by the constraint (if any) as they are reached."""

    def __init__(self, logits: torch.Tensor, constraint: Constraint | None, eog: frozenset[int]):
        self.logits, self.constraint, self.eog = logits, constraint, eog
        self.allowed: torch.Tensor | None = None

    def row(self, i: int) -> torch.Tensor:
        if self.constraint is None:
            return self.logits[i]
        allowed = self.constraint.mask()
        n = self.logits.shape[-1]
        if allowed.shape[0] != n:  # the model's vocabulary may be padded past the tokenizer's
            allowed = torch.nn.functional.pad(allowed[:n], (0, max(0, n - allowed.shape[0])))
        self.allowed = allowed
        return apply_mask(self.logits[i], allowed, self.eog)

    def sample(self, sampler: Sampler, i: int) -> int:
        """sampler.sample of row i, masked. Greedy, when the constraint allows the raw argmax, that
        is the masked argmax too (the same first maximum), and no mask is built: the common case
        of a model that follows its grammar costs one check instead of a mask over the vocabulary."""
        if self.constraint is not None and sampler.params.greedy:
            t = int(torch.argmax(self.logits[i]))
            if self.constraint.valid_prefix((t,)) == 1:
                return t
        return sampler.sample(self.row(i))

    def emit(self, emitted: list[int], t: int) -> None:
        emitted.append(t)
        if self.constraint is not None:
            self.constraint.advance(t)


def verify(sampler: Sampler, logits: torch.Tensor, draft: Draft | None, eog: frozenset[int],
           constraint: Constraint | None = None) -> tuple[list[int], int]:
    """logits: [len(draft) + 1, V], row i predicts the token after draft[:i].
    Returns (emitted tokens, number of draft tokens among them). `constraint` is advanced by
    every emitted token."""
    tokens = draft.tokens if draft is not None else ()
    rows = _Rows(logits, constraint, eog)
    if draft is not None and draft.probs is not None and not sampler.params.greedy:
        return _rejection(sampler, rows, draft, eog)
    emitted: list[int] = []
    n_accepted = 0
    for i in range(len(tokens) + 1):
        t = rows.sample(sampler, i)
        rows.emit(emitted, t)
        if i == len(tokens) or t != tokens[i]:
            break
        n_accepted += 1
        if t in eog:
            break
    return emitted, n_accepted


def _rejection(sampler: Sampler, rows: _Rows, draft: Draft, eog: frozenset[int]) -> tuple[list[int], int]:
    emitted: list[int] = []
    for i, x in enumerate(draft.tokens):
        p = sampler.probs(rows.row(i))
        q = draft.probs[i].float()
        if rows.constraint is not None:
            q = mask_probs(q, rows.allowed)
        u = torch.rand((), generator=sampler.generator, dtype=torch.float64)
        if q[x] > 0 and u * q[x] <= p[x]:
            rows.emit(emitted, x)
            if x in eog:
                return emitted, len(emitted)
            continue
        residual = torch.clamp(p - q, min=0)
        t = sampler.sample_from(residual) if residual.sum() > 0 else sampler.sample_from(p)
        rows.emit(emitted, t)
        return emitted, i
    rows.emit(emitted, rows.sample(sampler, len(draft.tokens)))
    return emitted, len(draft.tokens)
