"""The objects passed between the engine, models, backends and speculators (attrs, frozen where they can be)."""
from __future__ import annotations

from typing import Sequence as Seq

import attrs
import torch


@attrs.frozen
class Batch:
    """Rows of (sequence id, position, token) from any number of sequences.

    `want_logits[i]` says whether row i's logits are returned; `ForwardOutput.logits` holds
    those rows in order. Rows of one sequence are contiguous and in increasing position.
    `argmax_only[i]` (optional, all False when empty) says that only the argmax of row i's
    logits is used (greedy, no logprobs, no grammar): the model may then return a row whose
    first maximum is the exact logits' but whose other entries are not logits.
    `prompt_lens[i]` (optional, 0: unknown) is the length of row i's sequence's prompt, so a
    backend can compute prompt rows the way its reference implementation computes a prompt.
    """

    seq_ids: tuple[int, ...]
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    want_logits: tuple[bool, ...]
    prompt_lens: tuple[int, ...] = ()
    argmax_only: tuple[bool, ...] = ()

    def __attrs_post_init__(self):
        n = len(self.tokens)
        if not (len(self.seq_ids) == len(self.positions) == len(self.want_logits) == n):
            raise ValueError("Batch fields must have one entry per row")
        if (self.prompt_lens and len(self.prompt_lens) != n) or (self.argmax_only and len(self.argmax_only) != n):
            raise ValueError("Batch fields must have one entry per row")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def for_sequence(cls, seq_id: int, start: int, tokens: Seq[int], logits: str = "last", prompt_len: int = 0,
                     argmax_only: bool = False) -> "Batch":
        """Rows for one sequence starting at position `start`; logits for 'last', 'all' or 'none' rows."""
        n = len(tokens)
        want = tuple((logits == "all") or (logits == "last" and i == n - 1) for i in range(n))
        return cls((seq_id,) * n, tuple(range(start, start + n)), tuple(tokens), want, (prompt_len,) * n if prompt_len else (),
                   (True,) * n if argmax_only else ())

    @classmethod
    def concat(cls, batches: Seq["Batch"]) -> "Batch":
        lens = tuple(p for b in batches for p in (b.prompt_lens or (0,) * len(b)))
        greedy = tuple(g for b in batches for g in (b.argmax_only or (False,) * len(b)))
        return cls(
            tuple(s for b in batches for s in b.seq_ids),
            tuple(p for b in batches for p in b.positions),
            tuple(t for b in batches for t in b.tokens),
            tuple(w for b in batches for w in b.want_logits),
            lens if any(lens) else (),
            greedy if any(greedy) else (),
        )

    def select(self, rows: Seq[int]) -> "Batch":
        """The batch of the given rows only, in that order."""
        return Batch(
            tuple(self.seq_ids[i] for i in rows),
            tuple(self.positions[i] for i in rows),
            tuple(self.tokens[i] for i in rows),
            tuple(self.want_logits[i] for i in rows),
            tuple(self.prompt_lens[i] for i in rows) if self.prompt_lens else (),
            tuple(self.argmax_only[i] for i in rows) if self.argmax_only else (),
        )

    def groups(self) -> list[tuple[int, int, int]]:
        """(seq_id, first row, end row) for each run of rows of one sequence."""
        out, start = [], 0
        for i in range(1, len(self) + 1):
            if i == len(self) or self.seq_ids[i] != self.seq_ids[start]:
                out.append((self.seq_ids[start], start, i))
                start = i
        return out


@attrs.frozen
class ForwardOutput:
    """logits: float32 [rows wanting logits, n_vocab]; hidden: layer index -> [all rows, n_embd]."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = attrs.field(factory=dict)


@attrs.frozen
class TokenLogprob:
    """An emitted token's log-probability under the target: log-softmax of the raw logits of the
    row that produced it (before temperature, top-k, top-p, min-p), and the `top` most likely
    tokens there as (token, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Draft:
    """Tokens a speculator proposes. `probs` [len(tokens), n_vocab] (the draft distribution each
    token was sampled from) enables rejection sampling; without it the engine uses sample-and-match.
    `confidence`: each token's probability under the speculator as it drafted it (at temperature 0
    its top probability), which the engine's controller weighs when it decides how much of the
    draft to verify; None where the speculator has no such number (a copy of earlier text)."""

    tokens: tuple[int, ...]
    spec_type: str = ""
    probs: torch.Tensor | None = attrs.field(default=None, eq=False)
    confidence: tuple[float, ...] | None = attrs.field(default=None, eq=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> Draft:
        """The first n tokens, with their distributions and confidences."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], self.spec_type, None if self.probs is None else self.probs[:n],
                     None if self.confidence is None else self.confidence[:n])


@attrs.frozen
class DraftLimits:
    """What the engine allows for one proposal: at most n_max tokens (already capped by the
    context and the remaining token budget); drafts shorter than n_min are not worth verifying."""

    n_max: int
    n_min: int = 0
    p_min: float = 0.0


@attrs.frozen
class DraftRequest:
    """One sequence's part of a batched proposal (the ``propose_batch`` hook): its history and
    the limits for its draft, exactly what ``propose(seq, limits)`` gets for one sequence."""

    seq: "SequenceView"
    limits: DraftLimits


@attrs.frozen
class SpeculatorState:
    """What a speculator keeps for the first positions of a sequence, taken out of it to be put
    into another process (a slot file): tensors of the speculator's own naming, and `key`, what
    they are valid for (a head's states are its encoding of the target's: they fit only the same
    head). A speculator takes back a state whose key is its own."""

    key: str
    tensors: dict = attrs.field(eq=False)


@attrs.frozen
class SequenceView:
    """What a speculator sees of a sequence: its id, full token history (prompt + generated),
    how many of those tokens were the prompt, and the temperature the target samples it at (0:
    greedy; a drafter that returns probabilities may draw its tokens at the same temperature).
    The history is a read-only tuple."""

    seq_id: int
    tokens: tuple[int, ...]
    n_prompt: int
    temperature: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)
