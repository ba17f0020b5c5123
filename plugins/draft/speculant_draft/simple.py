"""draft-simple: an independent small model drafts greedily for every sequence at once.

Semantics follow llama.cpp's ``common_speculative_impl_draft_simple``: each draft token is the
draft model's argmax; a sequence stops drafting when that token's probability is below
``p_min`` (the token is not kept) or when its draft reaches ``n_max``; a draft shorter than
``n_min`` is dropped (None, so the next speculator of the chain is asked). One difference: the
probability is taken over the full softmax of the draft's logits at temperature 1, not over the
renormalised top 10 (which overestimates it).

One draft context (one KV cache from ``model.new_context``) holds every sequence under the
target's sequence id. It is kept in step with the target lazily: each sequence remembers the
tokens whose KV the draft context holds (``fed``); at the next proposal the part that no longer
matches the history (rejected draft tokens) is truncated away and only the tokens the draft has
not seen (normally the target's correction token, plus the last draft token when the whole
draft was accepted) are fed, as the first rows of the first draft step. A draft step is one
forward for all sequences still drafting, one row each.

A draft model with recurrent state (a hybrid such as lfm2 or qwen35) cannot cut its draft tokens
away afterwards. Its state is saved after the first draft step (which holds the whole history)
and restored when the draft is done, so the context again holds the history and nothing else;
the lazy sync above then works as for a KV cache. The engine's `checkpoint` calls need nothing
from it: the draft context never runs ahead of the history it was synced to. A history that
changed inside what the recurrent context holds (a client edited the conversation) is fed again
from the start.
"""
from __future__ import annotations

import attrs
import torch

from speculant import Batch, Draft, DraftLimits, DraftRequest, SequenceView, SpeculantError, hookimpl, load_model_once
from speculant.speculator import SpeculatorConfig

from speculant_draft.vocab import vocab_mismatch

PREFILL_CHUNK = 512  # rows per forward when a prompt is fed to the draft model


def load_draft_model(path: str, backend: str = "cpu", threads: int | None = None):
    """The draft model at `path`, loaded once per process (a benchmark builds its speculators
    afresh for every run; the model has no per-run state, its contexts do)."""
    return load_model_once(path, backend, threads, what="draft model")


@attrs.define
class _Seq:
    fed: list[int] = attrs.field(factory=list)  # tokens whose KV the draft context holds, from position 0
    good: int = 0  # fed[:good] is known to equal the sequence's history


@attrs.define
class _Drafting:
    """A sequence in the current draft loop."""

    index: int
    seq_id: int
    state: _Seq
    n_max: int
    n_min: int
    p_min: float
    tokens: list[int] = attrs.field(factory=list)
    confidence: list[float] = attrs.field(factory=list)


class DraftSimple:
    spec_type = "draft-simple"

    def __init__(self, config: SpeculatorConfig):
        if not config.draft_model:
            raise SpeculantError("spec type draft-simple needs a draft model: pass -md DRAFT.gguf")
        target = config.target
        if target is None:
            raise SpeculantError("spec type draft-simple needs the target model to check the draft's vocabulary")
        self.model = load_draft_model(config.draft_model, config.backend, config.option("threads", None))
        why = vocab_mismatch(target.tokenizer, self.model.tokenizer)
        if why is not None:
            raise SpeculantError(f"draft model {config.draft_model} cannot draft for {target.info.path}: {why}")
        max_tokens = int(config.option("ctx_size", 0) or 0) or (1 << 20)
        self.context = self.model.new_context(max_tokens)
        self.recurrent = getattr(self.context, "state_kind", "kv") == "recurrent"
        if self.recurrent and not (hasattr(self.context, "save") and hasattr(self.context, "restore")):
            raise SpeculantError(f"draft model {config.draft_model}: its recurrent state can be neither cut nor saved")
        if hasattr(self.context, "keep_rows"):  # drafting rolls back by checkpoints, not per-row states
            self.context.keep_rows = False
        # Draft tokens must be ids the target has; history tokens the draft does not know are fed as 0.
        self.n_draft_vocab = self.model.info.n_vocab
        self.n_out = min(self.n_draft_vocab, target.info.n_vocab)
        self.seqs: dict[int, _Seq] = {}

    # --- lifecycle ---------------------------------------------------------------------------
    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        """Feed the prompt (all but its last token, which the first draft step feeds)."""
        self.end(seq.seq_id)
        state = self.seqs[seq.seq_id] = _Seq()
        prompt = seq.tokens[:-1]
        try:
            for start in range(0, len(prompt), PREFILL_CHUNK):
                chunk = prompt[start : start + PREFILL_CHUNK]
                self.model.forward(Batch.for_sequence(seq.seq_id, start, self._feedable(chunk), logits="none"), self.context)
                state.fed.extend(chunk)
        except BaseException:
            self.end(seq.seq_id)
            raise
        state.good = len(state.fed)

    @hookimpl
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(requests)
        active: list[_Drafting] = []
        rows: list[tuple[int, ...]] = []  # per active sequence, the tokens of this step's rows
        for i, r in enumerate(requests):
            if r.limits.n_max <= 0 or not r.seq.tokens:
                continue
            state = self.seqs.get(r.seq.seq_id)
            if state is None:  # not begun here (a chain built after the sequence started): feed it all now
                state = self.seqs[r.seq.seq_id] = _Seq()
            rows.append(self._sync(r.seq.seq_id, state, r.seq.tokens))
            active.append(_Drafting(i, r.seq.seq_id, state, r.limits.n_max, r.limits.n_min, r.limits.p_min))
        saved: dict[int, tuple[int, object]] = {}  # recurrent draft: seq -> (history length, state after it)
        try:
            while active:
                batch = Batch.concat([Batch.for_sequence(a.seq_id, len(a.state.fed), self._feedable(toks), logits="last")
                                      for a, toks in zip(active, rows)])
                logits = self.model.forward(batch, self.context).logits
                for a, toks in zip(active, rows):
                    a.state.fed.extend(toks)
                    if self.recurrent and a.seq_id not in saved:  # the state after the whole history
                        saved[a.seq_id] = (len(a.state.fed), self.context.save(a.seq_id))
                still, rows = [], []
                for a, tok, p in zip(active, *self._greedy(logits)):
                    if p < a.p_min:  # not confident enough: this token is not kept, the draft ends
                        self._finish(out, a)
                        continue
                    a.tokens.append(tok)
                    a.confidence.append(p)
                    if len(a.tokens) >= a.n_max:
                        self._finish(out, a)
                        continue
                    still.append(a)
                    rows.append((tok,))
                active = still
        except BaseException:
            for a in active:  # the draft context's rows for these sequences are unknown now: start them over
                self.context.drop(a.seq_id)
                a.state.fed.clear()
                a.state.good = 0
                saved.pop(a.seq_id, None)
            raise
        finally:
            for seq_id, (n, handle) in saved.items():  # drop the draft tokens: back to the history's state
                self.context.restore(seq_id, handle)
                del self.seqs[seq_id].fed[n:]
        return out

    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        """One sequence alone (the chain uses propose_batch; this serves direct callers)."""
        return self.propose_batch([DraftRequest(seq, limits)])[0]

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        state = self.seqs.get(seq.seq_id)
        if state is not None:
            state.good = min(state.good, n)

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.context.drop(seq_id)

    @hookimpl
    def state_nbytes(self, seq_id: int) -> int | None:
        """The draft model's KV rows (or recurrent state) kept for the sequence."""
        nbytes = getattr(self.context, "nbytes", None)
        return None if nbytes is None else nbytes(seq_id)

    # --- helpers -----------------------------------------------------------------------------
    def _sync(self, seq_id: int, state: _Seq, history: tuple[int, ...]) -> tuple[int, ...]:
        """Cut the draft context back to the longest prefix of `history` it holds (leaving at
        least the last token to feed) and return the tokens still to feed."""
        limit = min(len(state.fed), len(history) - 1)
        p = min(state.good, limit)
        fed = state.fed
        while p < limit and fed[p] == history[p]:
            p += 1
        if p < len(fed):
            if self.recurrent and not getattr(self.context, "can_truncate", lambda s, n: False)(seq_id, p):
                self.context.drop(seq_id)  # the state cannot go back there: feed the history again
                p = 0
            del fed[p:]
            self.context.truncate(seq_id, p)
        state.good = len(history)  # true once the rows below are fed
        return history[p:]

    def _feedable(self, tokens) -> list[int]:
        n = self.n_draft_vocab
        return [t if 0 <= t < n else 0 for t in tokens]

    def _greedy(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Per row: the argmax over the ids both models have, and its probability under the
        draft's full softmax (temperature 1)."""
        logits = logits.float()
        top = logits[:, : self.n_out].argmax(dim=-1)
        p = torch.exp(logits.gather(1, top[:, None])[:, 0] - torch.logsumexp(logits, dim=-1))
        return top.tolist(), p.tolist()

    def _finish(self, out: list[Draft | None], a: _Drafting) -> None:
        """A sequence stopped drafting; a draft shorter than n_min is dropped, as in llama.cpp."""
        if a.tokens and len(a.tokens) >= a.n_min:
            out[a.index] = Draft(tuple(a.tokens), self.spec_type, confidence=tuple(a.confidence))
