"""Logits constraints: a per-sequence rule on which tokens may come next (a grammar, a JSON schema).

The core knows no grammar engine. A `Constraint` is whatever object answers these five questions
about its own state, which the engine advances with every token the sequence emits:

* ``mask()``: the tokens allowed next, a bool tensor [n_vocab];
* ``advance(token)``: the sequence emitted `token` (one the mask allowed);
* ``rollback(n)``: forget the last n tokens advanced;
* ``forced()``: the tokens the rule forces from here, whatever the model says (may be empty): the
  engine drafts them without asking a speculator;
* ``valid_prefix(tokens)``: how many leading tokens of a draft the rule would accept, the state
  unchanged; it must agree with ``mask()`` (greedy verification asks it about the raw argmax
  and builds the mask only when the answer is no).

What the engine does with one (Engine.add(..., constraint=)): every row the target samples from
has the rejected tokens' logits set to -inf before the sampler chain (top-k, top-p, min-p,
temperature), so plain decoding draws from the constrained distribution; a draft is cut before
its first rejected token; row i of a verification is masked with the state after the draft's
first i tokens (the constraint advances with each token verification emits, so it is always in
the state of the tokens kept); with rejection sampling the draft's probabilities are masked with
the same mask and renormalised. Greedy output is then constrained plain decoding's, token for
token, and sampled output is distributed as constrained sampling (docs/architecture.md).
The server's implementation is llguidance's (speculant_server.grammar).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    def mask(self) -> torch.Tensor:
        """bool [n_vocab]: True for the tokens allowed next."""

    def advance(self, token: int) -> None:
        """The sequence emitted `token`."""

    def rollback(self, n: int) -> None:
        """Undo the last `n` advances."""

    def forced(self) -> list[int]:
        """Tokens that must come next whatever the model prefers (empty when there is a choice)."""

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` would be accepted from the current state (the state unchanged)."""


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor, eog: frozenset[int] = frozenset()) -> torch.Tensor:
    """`logits` [V] with the tokens not `allowed` at -inf (a new tensor). A mask that allows
    nothing (a constraint in an error state) allows the end-of-generation tokens instead, so the
    sequence ends rather than draws from nothing."""
    if not bool(allowed.any()):
        allowed = torch.zeros_like(allowed)
        allowed[list(eog) or [int(torch.argmax(logits))]] = True
    return logits.float().masked_fill(~allowed, float("-inf"))


def mask_probs(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A draft distribution restricted to `allowed` and renormalised (all zero if none is left)."""
    q = q.float() * allowed
    s = q.sum()
    return q / s if s > 0 else q
