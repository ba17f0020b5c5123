"""The decode loop: propose -> one target forward over all sequences -> verify -> accept/truncate.

Everything works on token ids; the engine knows nothing of text. Per step, each active sequence
contributes the rows its target state still lacks (normally just its last token) plus its draft;
one forward runs all of them; each sequence keeps the longest draft prefix the target agrees with
plus one token of the target's own, and its target state is cut back to what was kept (KV
truncate, or checkpoint restore and replay for recurrent state).
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import attrs
import torch

from speculant.chain import SpeculatorChain
from speculant.errors import LimitError
from speculant.model import Model
from speculant.sampling import Sampler, SamplingParams
from speculant.types import Batch, Draft, DraftLimits, SequenceView
from speculant.verify import verify

PREFILL_CHUNK = 512


@attrs.frozen
class EngineConfig:
    n_ctx: int = 4096
    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0

    def __attrs_post_init__(self):
        if self.n_ctx < 2:
            raise LimitError(f"context size {self.n_ctx} is too small")


@attrs.define
class SeqStats:
    n_prompt: int = 0
    n_generated: int = 0
    n_drafts: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    accepted_at: list[int] = attrs.field(factory=list)  # accepted_at[i]: drafts whose token i was accepted
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0


@attrs.define
class Sequence:
    seq_id: int
    tokens: list[int]
    n_prompt: int
    max_new_tokens: int
    sampler: Sampler
    n_cached: int = 0  # tokens[:n_cached] are in the target's state
    finish_reason: str | None = None
    stats: SeqStats = attrs.field(factory=SeqStats)
    saved: Any = None  # recurrent-state checkpoint taken before verifying a draft

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def view(self) -> SequenceView:
        return SequenceView(self.seq_id, tuple(self.tokens), self.n_prompt)


class Engine:
    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), speculators: list[Any] = ()):
        self.model, self.config = model, config
        self.context = model.new_context(config.n_ctx)
        self.recurrent = getattr(self.context, "state_kind", "kv") == "recurrent"
        self.chain = SpeculatorChain(list(speculators))
        self.eog = frozenset(getattr(model.tokenizer, "eog_ids", ()) or ())
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0

    # --- sequences ---------------------------------------------------------------------
    def add(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams()) -> Sequence:
        if not prompt:
            raise LimitError("the prompt is empty")
        if len(prompt) >= self.config.n_ctx:
            raise LimitError(f"prompt has {len(prompt)} tokens, the context holds {self.config.n_ctx} (prompt plus at least one new token)")
        if max_new_tokens < 1:
            raise LimitError(f"max new tokens must be >= 1, got {max_new_tokens}")
        seq = Sequence(self._next_id, list(prompt), len(prompt), max_new_tokens, Sampler(params))
        seq.stats.n_prompt = len(prompt)
        self._next_id += 1
        self.sequences[seq.seq_id] = seq
        self.chain.begin(seq.view())
        return seq

    def release(self, seq: Sequence) -> None:
        self.sequences.pop(seq.seq_id, None)
        self.context.drop(seq.seq_id)
        self.chain.end(seq.seq_id)

    def active(self) -> list[Sequence]:
        return [s for s in self.sequences.values() if s.finish_reason is None]

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """Advance every active sequence by at least one token; returns the new tokens per id."""
        seqs = self.active()
        for seq in seqs:
            if seq.n_cached == 0:  # a new prompt; replayed rows of a recurrent state ride with the step
                self._prefill(seq)
        drafts = {seq.seq_id: self._propose(seq) for seq in seqs}

        parts = []
        for seq in seqs:
            draft = drafts[seq.seq_id]
            pending = seq.tokens[seq.n_cached:]
            rows = pending + list(draft.tokens if draft else ())
            want = "all" if draft else "last"
            b = Batch.for_sequence(seq.seq_id, seq.n_cached, rows, logits=want)
            if draft:  # logits only from the last pending row on
                b = attrs.evolve(b, want_logits=tuple(i >= len(pending) - 1 for i in range(len(rows))))
            if draft and self.recurrent:
                seq.saved = self.context.save(seq.seq_id)
                self.chain.checkpoint(seq.view(), "save")
            parts.append(b)
        t0 = time.perf_counter()
        out = self.model.forward(Batch.concat(parts), self.context, self.chain.hidden_layers)
        dt = time.perf_counter() - t0

        new: dict[int, list[int]] = {}
        row = 0
        hidden_row = 0
        for seq, b in zip(seqs, parts):
            draft = drafts[seq.seq_id]
            n_logits = sum(b.want_logits)
            logits = out.logits[row : row + n_logits]
            hidden = {l: h[hidden_row : hidden_row + len(b)] for l, h in out.hidden.items()}
            row += n_logits
            hidden_row += len(b)
            new[seq.seq_id] = self._verify(seq, draft, logits, hidden, len(b))
            seq.stats.decode_seconds += dt / len(seqs)
        return new

    def _prefill(self, seq: Sequence) -> None:
        """Feed all but the last uncached token (the step feeds that one with the draft)."""
        t0 = time.perf_counter()
        end = len(seq.tokens) - 1
        while seq.n_cached < end:
            n = min(PREFILL_CHUNK, end - seq.n_cached)
            b = Batch.for_sequence(seq.seq_id, seq.n_cached, seq.tokens[seq.n_cached : seq.n_cached + n], logits="none")
            self.model.forward(b, self.context)
            seq.n_cached += n
        seq.stats.prompt_seconds += time.perf_counter() - t0

    def _propose(self, seq: Sequence) -> Draft | None:
        if not self.chain:
            return None
        room = min(self.config.n_ctx - len(seq.tokens) - 1, seq.max_new_tokens - seq.n_generated - 1)
        limits = DraftLimits(min(self.config.draft_n_max, room), self.config.draft_n_min, self.config.draft_p_min)
        t0 = time.perf_counter()
        draft = self.chain.propose(seq.view(), limits)
        seq.stats.draft_seconds += time.perf_counter() - t0
        if draft is not None and len(draft) < max(1, limits.n_min):
            return None
        return draft

    def _verify(self, seq: Sequence, draft: Draft | None, logits: torch.Tensor, hidden: dict, n_rows: int) -> list[int]:
        n_before = len(seq.tokens)
        emitted, n_accepted = verify(seq.sampler, logits, draft, self.eog)
        # Never past the budget or the context (the draft limits make this a no-op normally).
        budget = min(seq.max_new_tokens - seq.n_generated, self.config.n_ctx - n_before)
        emitted = emitted[:budget]
        n_accepted = min(n_accepted, len(emitted))
        seq.tokens.extend(emitted)

        fed_end = seq.n_cached + n_rows  # the state now holds tokens up to here (pending + draft rows)
        kept_end = n_before + n_accepted  # ... of which these are right; the last emitted token is pending
        if draft is not None:
            s = seq.stats
            s.n_drafts += 1
            s.n_drafted += len(draft)
            s.n_accepted += n_accepted
            s.accepted_at.extend([0] * (len(draft) - len(s.accepted_at)))
            for i in range(n_accepted):
                s.accepted_at[i] += 1
        if self.recurrent and draft is not None and kept_end < fed_end:
            # Recurrent state cannot be cut: go back to before the draft; the kept tokens are
            # fed again as the first rows of the next step.
            self.context.restore(seq.seq_id, seq.saved)
            self.chain.checkpoint(seq.view(), "restore")
        else:
            if draft is not None and self.recurrent:
                self.chain.checkpoint(seq.view(), "discard")
            self.context.truncate(seq.seq_id, kept_end)
            seq.n_cached = kept_end
        seq.saved = None
        self.chain.accept(seq.view(), draft, n_accepted, hidden)

        seq.stats.n_generated = seq.n_generated
        if emitted and emitted[-1] in self.eog:
            seq.finish_reason = "stop"
        elif seq.n_generated >= seq.max_new_tokens:
            seq.finish_reason = "length"
        elif len(seq.tokens) >= self.config.n_ctx:
            seq.finish_reason = "length"
        return emitted

    # --- convenience -----------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams()) -> Iterator[int]:
        """Generate for one sequence, yielding tokens as they are accepted."""
        seq = self.add(prompt, max_new_tokens, params)
        try:
            while seq.finish_reason is None:
                yield from self.step()[seq.seq_id]
        finally:
            self.last_sequence = seq
            self.release(seq)
