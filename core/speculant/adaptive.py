"""Adaptive draft length: pick the k that maximizes expected tokens per second.

Leviathan et al.'s cost model, measured on the fly. With alpha_i the chance that draft token i is
accepted given that the ones before it were, a step that verifies k draft tokens emits
E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j tokens and costs T(k) = t_verify(1 + k rows) + t_draft(k).
The controller keeps the k <= len(draft) with the best E(k)/T(k); k = 0 means "do not draft".
Acceptance is tracked per spec type with exponential forgetting, the forward cost per row count.
A declined spec type is still probed now and then so it can win back when text turns repetitive.
"""
from __future__ import annotations

import attrs

DECAY = 0.98  # per observation: acceptance estimates follow the last ~50 drafts
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.5, 1.0
PROBE_EVERY = 16  # after this many declined drafts in a row, let one through to refresh the estimate


@attrs.define
class ForwardCost:
    """EMA of forward seconds by number of rows; unseen row counts interpolate linearly."""

    seconds: dict[int, float] = attrs.field(factory=dict)

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def cost(self, rows: int) -> float | None:
        if rows in self.seconds:
            return self.seconds[rows]
        known = sorted(self.seconds)
        if not known:
            return None
        lo = max((r for r in known if r < rows), default=None)
        hi = min((r for r in known if r > rows), default=None)
        if lo is not None and hi is not None:
            w = (rows - lo) / (hi - lo)
            return (1 - w) * self.seconds[lo] + w * self.seconds[hi]
        if len(known) >= 2:  # extrapolate from the two nearest points
            a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
            slope = max(0.0, (self.seconds[b] - self.seconds[a]) / (b - a))
            ref = b if hi is None else a
            return self.seconds[ref] + slope * (rows - ref)
        return None


@attrs.define
class Acceptance:
    """Decayed counts of tried/accepted per draft position for one spec type."""

    tried: list[float] = attrs.field(factory=list)
    accepted: list[float] = attrs.field(factory=list)

    def observe(self, draft_len: int, n_accepted: int) -> None:
        n = max(len(self.tried), draft_len)
        self.tried = [t * DECAY for t in self.tried] + [0.0] * (n - len(self.tried))
        self.accepted = [a * DECAY for a in self.accepted] + [0.0] * (n - len(self.accepted))
        for i in range(min(n_accepted + 1, draft_len)):  # position i was tried if all before it were accepted
            self.tried[i] += 1
            if i < n_accepted:
                self.accepted[i] += 1

    def alpha(self, i: int) -> float:
        t = self.tried[i] if i < len(self.tried) else 0.0
        a = self.accepted[i] if i < len(self.accepted) else 0.0
        return (a + PRIOR_ACCEPT * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)


@attrs.define
class DraftLengthController:
    enabled: bool = True
    forward: ForwardCost = attrs.field(factory=ForwardCost)
    acceptance: dict[str, Acceptance] = attrs.field(factory=dict)
    draft_cost: dict[str, float] = attrs.field(factory=dict)  # EMA seconds per drafted token
    declined_in_a_row: dict[str, int] = attrs.field(factory=dict)

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.forward.observe(rows, seconds)

    def observe_draft(self, spec_type: str, n_drafted: int, n_accepted: int, seconds: float) -> None:
        self.acceptance.setdefault(spec_type, Acceptance()).observe(n_drafted, n_accepted)
        if n_drafted:
            old = self.draft_cost.get(spec_type)
            per_token = seconds / n_drafted
            self.draft_cost[spec_type] = per_token if old is None else 0.8 * old + 0.2 * per_token

    def best_length(self, spec_type: str, n: int) -> int:
        """How many of the n drafted tokens are worth verifying (0: none)."""
        if not self.enabled or n == 0:
            return n
        t1 = self.forward.cost(1)
        if t1 is None or self.forward.cost(2) is None:
            return n  # no cost measurements yet: verify and learn
        acc = self.acceptance.get(spec_type, Acceptance())
        draft_cost = self.draft_cost.get(spec_type, 0.0)
        best_k, best_rate = 0, 1.0 / t1
        expected, p = 1.0, 1.0
        for k in range(1, n + 1):
            p *= acc.alpha(k - 1)
            expected += p
            rate = expected / (self.forward.cost(1 + k) + draft_cost * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            streak = self.declined_in_a_row.get(spec_type, 0) + 1
            self.declined_in_a_row[spec_type] = streak
            if streak >= PROBE_EVERY:
                self.declined_in_a_row[spec_type] = 0
                return min(n, 2)  # probe
            return 0
        self.declined_in_a_row[spec_type] = 0
        return best_k
