"""The target's sampler chain (llama.cpp's order: top-k, top-p, min-p, then temperature).

One seeded generator per sequence and exactly one uniform draw per emitted token, so
sample-and-match verification consumes the same random stream as plain decoding and gives the
same tokens for the same seed.
"""
from __future__ import annotations

import random

import attrs
import torch

from speculant.types import TokenLogprob


@attrs.frozen
class SamplingParams:
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(self.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from, over the whole vocabulary [V] (float32).
        Greedy is the one-hot of the argmax."""
        logits = logits.float()
        if self.params.greedy:
            return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).float()
        ids, kept = self._filtered(logits)
        p = torch.zeros_like(logits)
        p[ids] = self._softmax(kept).float()
        return p

    def sample(self, logits: torch.Tensor) -> int:
        """One token from logits [V]."""
        if self.params.greedy:
            return int(torch.argmax(logits))  # first index among equal maxima, like llama.cpp
        ids, kept = self._filtered(logits.float())
        return int(ids[self._draw(self._softmax(kept))])

    def _softmax(self, kept: torch.Tensor) -> torch.Tensor:
        """softmax(kept / T) in float64 after subtracting the maximum: a tiny T (1e-39, even
        5e-324) then sends the others to -inf (probability 0) and the maximum to 0, never
        inf - inf = NaN; in float32, logits / T overflows below T ~ 1e-37. It tends to greedy."""
        x = kept.double()
        return torch.softmax((x - x.max()) / self.params.temperature, dim=-1)

    def sample_from(self, p: torch.Tensor) -> int:
        """One token from an explicit distribution [V] (rejection sampling's residual)."""
        return self._draw(p / p.sum())

    def _draw(self, p: torch.Tensor) -> int:
        u = torch.rand((), generator=self.generator, dtype=torch.float64)
        cdf = torch.cumsum(p.double(), 0)
        return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), p.shape[0] - 1)

    def _filtered(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (sorted by logit, descending) and their logits that survive the filters."""
        k = self.params.top_k
        if 0 < k < logits.shape[-1]:
            kept, ids = torch.topk(logits, k)
        else:
            kept, ids = torch.sort(logits, descending=True)
        if self.params.top_p < 1.0:
            cum = torch.cumsum(torch.softmax(kept, -1), -1)
            n = int(torch.searchsorted(cum, torch.tensor(self.params.top_p), right=False)) + 1
            kept, ids = kept[:n], ids[:n]
        if self.params.min_p > 0.0:
            p = torch.softmax(kept, -1)
            n = max(1, int((p >= self.params.min_p * p[0]).sum()))
            kept, ids = kept[:n], ids[:n]
        return ids, kept


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the raw distribution of its row (logits [>= len(tokens),
    V], row i produced tokens[i]) and the n_top most likely tokens there. Row by row, so a row's
    values do not depend on the rows beside it: equal logits give equal bits (plain decoding's one
    row or a verification's several)."""
    out = []
    for i, t in enumerate(tokens):
        lp = torch.log_softmax(logits[i].float(), -1)
        top = ()
        if n_top > 0:
            values, ids = torch.topk(lp, min(n_top, lp.shape[-1]))
            # equal values by token id, as greedy sampling breaks ties (the first maximum)
            top = tuple(sorted(zip(ids.tolist(), values.tolist()), key=lambda x: (-x[1], x[0])))
        out.append(TokenLogprob(t, float(lp[t]), top))
    return out
