"""--spec-type dflash (llama.cpp: draft-dflash): block-diffusion drafting from the target's hidden states.

The speculator asks the engine for the target's states entering the drafter's tap layers
(`hidden_layers`: the output of the layer before each tap) and turns every committed row into the
fused context g = hidden_norm(fc(taps)) as the engine hands them over (`prefill` for prompt
chunks, `accept` for each step). g is kept per sequence for every position (float16), so a
history cut anywhere (`truncate`, the prompt cache) can be resumed.

The drafter's KV cache (one context for all sequences, under the target's sequence ids) holds at
position P the keys and values every draft layer computes from g_P (llama.cpp's injection). It is
brought up to date lazily: at the next proposal, the rows not yet injected (normally the accepted
tokens of the last step) go in, for all sequences in one batch. Then one non-causal forward over
every drafting sequence's block [last token, MASK x (B-1)], at the positions after its committed
history, fills the block: row i's logits give draft token i. The block is never kept in the cache.
The whole block always goes through the layers (its rows see each other, so a shorter block would
change every row); the lm_head runs on the rows the draft can use only.

At temperature 0 each draft token is its row's argmax; the draft stops at the first row whose
probability is below p_min (llama.cpp's rule) and is dropped when shorter than n_min. At
temperature T > 0 each row's token is sampled from the drafter's softmax at T and returned with
that distribution, so the engine verifies by rejection sampling (the rows are drawn independently,
each from a distribution that depends on the context only: a valid proposal for every prefix).
"""
from __future__ import annotations

import torch

from speculant import (Draft, DraftLimits, DraftRequest, SequenceView, SpeculantError, SpeculatorState, hookimpl,
                       load_model_once)
from speculant.drafting import (PositionStates, committed_rows, draft_generator, export_positions, file_key, held_bytes,
                                import_positions, skip_unread_rows, store_encoded_taps)
from speculant.logs import get_logger
from speculant.speculator import SpeculatorConfig

from speculant_dflash.head import DFlashHead

log = get_logger(__name__)

# Context rows injected in one forward when the drafter catches up on a prompt (bounded
# temporaries: each row costs every layer's K and V projections only).
CATCH_UP_ROWS = 256


def load_head(path: str, backend: str, threads: int | None) -> DFlashHead:
    """The drafter at `path`, loaded once per process."""
    head = load_model_once(path, backend, threads, what="DFlash drafter")
    if not isinstance(head, DFlashHead):
        raise SpeculantError(f"{path}: not a DFlash drafter (architecture '{head.info.architecture}'); "
                             "use --spec-type draft-simple for a draft model")
    return head


class DFlash:
    spec_type = "dflash"

    @staticmethod
    def contract_draft_model(target_path: str, directory: str) -> str:
        """The contract suite's drafter: random, for its tiny target."""
        import os

        from speculant_dflash.testing import write_random_head

        return write_random_head(os.path.join(directory, "dflash-head.gguf"), target_path, n_draft_vocab=256)[0]

    def __init__(self, config: SpeculatorConfig):
        if not config.draft_model:
            raise SpeculantError(f"spec type {config.spec_type} needs a DFlash drafter: pass -md HEAD.gguf")
        target = config.target
        if target is None:
            raise SpeculantError(f"spec type {config.spec_type} needs the target model")
        self.head = load_head(config.draft_model, config.backend, config.option("threads", None))
        self.head_path = config.draft_model
        c = self.head.config
        n_layers = target.info.n_layers
        if c.n_embd != target.info.n_embd:
            raise SpeculantError(f"DFlash drafter {config.draft_model} has n_embd {c.n_embd}, the target "
                                 f"{target.info.path} {target.info.n_embd}: it was made for another target")
        bad = [l for l in c.target_layers if not 1 <= l <= n_layers]
        if bad:
            raise SpeculantError(f"DFlash drafter {config.draft_model} taps the input of layer {bad[0]}, "
                                 f"the target has layers 1..{n_layers} to tap")
        if c.n_target_vocab and abs(c.n_target_vocab - target.info.n_vocab) > 128:
            raise SpeculantError(f"DFlash drafter {config.draft_model} has a vocabulary of {c.n_target_vocab}, the target {target.info.n_vocab}")
        if not 0 <= c.mask_token_id < target.info.n_vocab:
            raise SpeculantError(f"DFlash drafter {config.draft_model}: mask token {c.mask_token_id} is outside the target's vocabulary")
        # The input of tap layer l is the output of layer l - 1 (speculant's hidden states are layer outputs).
        self.taps = tuple(l - 1 for l in c.target_layers)
        self.hidden_layers = tuple(sorted(set(self.taps)))
        self.embed = getattr(target, "embed", None) if self.head.parts["token_embd"] is None else None
        self.output = getattr(target, "output", None) if self.head.parts["output"] is None else None
        if self.head.parts["token_embd"] is None and self.embed is None:
            raise SpeculantError(f"DFlash drafter {config.draft_model} borrows token embeddings, the target model lends none")
        if self.head.parts["output"] is None and self.output is None:
            raise SpeculantError(f"DFlash drafter {config.draft_model} borrows the lm_head, the target model lends none")
        max_tokens = int(config.option("ctx_size", 0) or 0) or (1 << 20)
        self.context = self.head.new_context(max_tokens)
        self.n_vocab = target.info.n_vocab
        d2t = self.head.d2t
        if d2t is not None and int(d2t.max()) >= self.n_vocab:
            raise SpeculantError(f"DFlash drafter {config.draft_model} maps draft ids to target id {int(d2t.max())}, beyond the target's vocabulary")
        self.d2t = d2t
        self.block_size = c.block_size
        # The positions a training window held: a block there saw at most window - B + 1 context
        # rows before it, so it sees as many here, and a long prompt's older rows are never
        # injected (--spec-dflash-window overrides the file; 0: the whole context, as llama.cpp).
        window = config.option("spec_dflash_window", None)
        self.window = (self.head.trained_window if window is None else int(window)) if self.head.windowable() else 0
        if window and not self.head.windowable():
            log.warning("dflash_window_ignored", drafter=config.draft_model, window=int(window),
                        reason="a causal drafter, or one with sliding-window layers or sinks, keeps the whole context")
        self.context_rows = max(1, self.window - self.block_size + 1) if self.window else 0
        self.seed = int(config.option("seed", 0) or 0)
        self.seqs: dict[int, PositionStates] = {}

    # --- what the target computed ------------------------------------------------------------
    def _state(self, seq_id: int) -> PositionStates:
        state = self.seqs.get(seq_id)
        if state is None:  # the context row of position p is computed from g_p alone
            state = self.seqs[seq_id] = PositionStates(self.head.config.n_embd, state_offset=0, token_offset=None)
        return state

    def _store(self, seq_id: int, start: int, hidden: dict, n_valid: int) -> None:
        store_encoded_taps(self._state(seq_id), start, hidden, self.taps, n_valid, self.head.encode)

    # --- lifecycle -----------------------------------------------------------------------------
    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        self.end(seq.seq_id)
        self._state(seq.seq_id)

    @hookimpl
    def prefill(self, seq: SequenceView, start: int, hidden: dict) -> None:
        rows = len(next(iter(hidden.values()))) if hidden else 0
        self._store(seq.seq_id, start, hidden, rows)

    @hookimpl
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict, hidden_start: int) -> None:
        self._store(seq.seq_id, hidden_start, hidden, committed_rows(seq, draft, n_accepted, hidden, hidden_start))

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        state = self.seqs.get(seq.seq_id)
        if state is not None:
            state.cut(n)

    # Its states are the head's encoding of the target's taps: valid for this head file only.
    @hookimpl
    def export_state(self, seq_id: int, n: int) -> SpeculatorState | None:
        return export_positions(self.seqs.get(seq_id), n, file_key("dflash", self.head_path))

    @hookimpl
    def import_state(self, seq: SequenceView, state: SpeculatorState, n: int) -> bool:
        return import_positions(self._state(seq.seq_id), state, n, file_key("dflash", self.head_path))

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.context.drop(seq_id)

    @hookimpl
    def state_nbytes(self, seq_id: int) -> int:
        return held_bytes(self.context, self.seqs.get(seq_id), seq_id)

    # --- drafting ------------------------------------------------------------------------------
    @hookimpl
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        return self.propose_batch([DraftRequest(seq, limits)])[0]

    @hookimpl
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(requests)
        mask = self.head.config.mask_token_id
        drafting, blocks, inject = [], [], []
        for i, r in enumerate(requests):
            seq, state = r.seq, self.seqs.get(r.seq.seq_id)
            n = len(seq.tokens)
            # The block starts at the last token's position n-1: the context is positions 0..n-2.
            if r.limits.n_max <= 0 or state is None or state.n < n - 1 or n < 1:
                continue
            self.context.truncate(seq.seq_id, min(state.written, n - 1))
            start = (skip_unread_rows(self.context, seq.seq_id, n - 1 - self.context_rows, state) if self.context_rows
                     else self.context.length(seq.seq_id))
            for lo in range(start, n - 1, CATCH_UP_ROWS):
                inject.append((seq.seq_id, lo, state.data[lo : min(n - 1, lo + CATCH_UP_ROWS)]))
            drafting.append((i, r))
            blocks.append((seq.seq_id, [seq.tokens[-1]] + [mask] * (self.block_size - 1), min(r.limits.n_max, self.block_size - 1)))
        if not blocks:
            return out
        try:
            while inject:  # a long prompt's rows in pieces, every sequence's first piece together
                now, later, seen = [], [], set()
                for part in inject:
                    (later if part[0] in seen else now).append(part)
                    seen.add(part[0])
                self.head.inject(now, self.context)
                inject = later
            for i, r in drafting:
                self.seqs[r.seq.seq_id].written = len(r.seq.tokens) - 1
            logits = self.head.draft(blocks, self.context, self.embed, self.output, self.context_rows)
        except BaseException:
            for _, r in drafting:  # the drafter's rows for these sequences are unknown now: write them again
                self.context.drop(r.seq.seq_id)
                self.seqs[r.seq.seq_id].written = 0
            raise
        for (i, r), rows in zip(drafting, logits):
            out[i] = self._pick(r, rows)
        return out

    def _pick(self, r: DraftRequest, logits: torch.Tensor) -> Draft | None:
        """The draft from a block's rows: argmax (temperature 0) or samples with their
        distributions over the target's vocabulary (temperature > 0); stops below p_min."""
        seq, limits = r.seq, r.limits
        temperature = float(getattr(seq, "temperature", 0.0) or 0.0)
        logits = logits.float()
        tokens, probs, confidence = [], [], []
        if temperature <= 0:
            top = torch.argmax(logits, dim=-1)
            p = torch.exp(logits.gather(1, top[:, None])[:, 0] - torch.logsumexp(logits, -1))
            for j in range(len(logits)):
                if float(p[j]) < limits.p_min:
                    break
                tokens.append(self._target_id(int(top[j])))
                confidence.append(float(p[j]))
        else:
            gen = draft_generator(self.seed, seq)
            q = torch.softmax(logits / temperature, -1)
            picks = torch.multinomial(q, 1, generator=gen)[:, 0]
            for j in range(len(q)):
                pick = int(picks[j])
                if float(q[j, pick]) < limits.p_min:
                    break
                tokens.append(self._target_id(pick))
                confidence.append(float(q[j, pick]))
                full = torch.zeros(self.n_vocab)
                if self.d2t is None:
                    full[: min(q.shape[1], self.n_vocab)] = q[j, : self.n_vocab]
                else:
                    full[self.d2t] = q[j]
                probs.append(full)
        if not tokens or len(tokens) < limits.n_min:
            return None
        return Draft(tuple(tokens), self.spec_type, torch.stack(probs) if probs else None, tuple(confidence))

    def _target_id(self, draft_id: int) -> int:
        return int(self.d2t[draft_id]) if self.d2t is not None else draft_id
