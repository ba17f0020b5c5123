"""--spec-type eagle3 (llama.cpp: draft-eagle3): drafting from the target's own hidden states.

The speculator asks the engine for the target's states entering its three tap layers
(`hidden_layers`: the output of the layer before each tap) and turns every committed row into
g = fc(taps) as the engine hands them over (`prefill` for prompt chunks, `accept` for each step).
g is kept per sequence for every position (float16), so a history cut anywhere (`truncate`, the
prompt cache) can be resumed.

The head's KV cache (one context for all sequences, under the target's sequence ids) holds at
position P the pair (t_{P+1}, g_P), so it can be written only once the token after P is known.
It is brought up to date lazily, like draft-simple's: at the next proposal, the rows not yet
written (normally the accepted tokens and the correction) go in as the first draft step, whose
last row predicts the first draft token; each further step feeds (draft token, the previous
step's pre-norm state) at the next position. Rows written from drafts are cut away before the
next proposal. Every step is one batched head forward for all sequences still drafting.

At temperature 0 the draft is the head's argmax (p_min, n_min and n_max as llama.cpp's); at
temperature T > 0 draft tokens are sampled from the head's softmax at T and returned with those
probabilities, so the engine verifies them by rejection sampling.
"""
from __future__ import annotations

import torch

from speculant import (Batch, Draft, DraftLimits, DraftRequest, SequenceView, SpeculantError, SpeculatorState, hookimpl,
                       load_model_once)
from speculant.drafting import (DraftChain, PositionStates, committed_rows, draft_generator, export_positions, file_key,
                                held_bytes, import_positions, pick_token, skip_unread_rows, store_encoded_taps)
from speculant.speculator import SpeculatorConfig

from speculant_eagle3.head import Eagle3Head

# Rows of the head written in one forward when it catches up on a prompt. All of a 935-token
# prompt's rows at once took ~100 MB of temporaries (its FFN alone 3 x rows x 4096 floats), kept
# by the allocator after: the head's peak RSS over plain decoding was 144 MB for a 47 MB file.
CATCH_UP_ROWS = 64


def load_head(path: str, backend: str, threads: int | None) -> Eagle3Head:
    """The head at `path`, loaded once per process."""
    head = load_model_once(path, backend, threads, what="EAGLE3 head")
    if not isinstance(head, Eagle3Head):
        raise SpeculantError(f"{path}: not an EAGLE3 head (architecture '{head.info.architecture}'); "
                             "use --spec-type draft-simple for a draft model")
    return head


class Eagle3:
    spec_type = "eagle3"

    @staticmethod
    def contract_draft_model(target_path: str, directory: str) -> str:
        """The contract suite's head: random, for its tiny target."""
        import os

        from speculant_eagle3.testing import write_random_head

        return write_random_head(os.path.join(directory, "eagle3-head.gguf"), target_path, n_draft_vocab=256)[0]

    def __init__(self, config: SpeculatorConfig):
        if not config.draft_model:
            raise SpeculantError(f"spec type {config.spec_type} needs an EAGLE3 head: pass -md HEAD.gguf")
        target = config.target
        if target is None:
            raise SpeculantError(f"spec type {config.spec_type} needs the target model")
        self.head = load_head(config.draft_model, config.backend, config.option("threads", None))
        self.head_path = config.draft_model
        c = self.head.config
        n_layers = target.info.n_layers
        if c.target_hidden != target.info.n_embd:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} was made for a target with n_embd {c.target_hidden}, "
                                 f"{target.info.path} has {target.info.n_embd}")
        bad = [l for l in c.target_layers if not 1 <= l <= n_layers]
        if bad:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} taps layer {bad[0]}, the target has layers 1..{n_layers} to tap")
        if c.n_target_vocab and abs(c.n_target_vocab - target.info.n_vocab) > 128:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} has a vocabulary of {c.n_target_vocab}, the target {target.info.n_vocab}")
        # The input of tap layer l is the output of layer l - 1 (speculant's hidden states are layer outputs).
        self.taps = tuple(l - 1 for l in c.target_layers)
        self.hidden_layers = tuple(sorted(set(self.taps)))
        self.embed = getattr(target, "embed", None) if self.head.parts["token_embd"] is None else None
        self.output = getattr(target, "output", None) if self.head.parts["output"] is None else None
        if self.head.parts["token_embd"] is None and self.embed is None:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} borrows token embeddings, the target model lends none")
        if self.head.parts["output"] is None and self.output is None:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} borrows the lm_head, the target model lends none")
        max_tokens = int(config.option("ctx_size", 0) or 0) or (1 << 20)
        self.context = self.head.new_context(max_tokens)
        self.n_vocab = target.info.n_vocab
        d2t = self.head.d2t
        if d2t is not None and int(d2t.max()) >= self.n_vocab:
            raise SpeculantError(f"EAGLE3 head {config.draft_model} maps draft ids to target id {int(d2t.max())}, beyond the target's vocabulary")
        self.d2t = d2t
        window = config.option("spec_eagle3_window", None)
        self.window = self.head.trained_window if window is None else int(window)
        self.seed = int(config.option("seed", 0) or 0)
        self.seqs: dict[int, PositionStates] = {}

    # --- what the target computed ------------------------------------------------------------
    def _state(self, seq_id: int) -> PositionStates:
        state = self.seqs.get(seq_id)
        if state is None:  # the head's row P pairs (t_{P+1}, g_P)
            state = self.seqs[seq_id] = PositionStates(self.head.config.n_embd, state_offset=0, token_offset=1)
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
        return export_positions(self.seqs.get(seq_id), n, file_key("eagle3", self.head_path))

    @hookimpl
    def import_state(self, seq: SequenceView, state: SpeculatorState, n: int) -> bool:
        return import_positions(self._state(seq.seq_id), state, n, file_key("eagle3", self.head_path))

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
        active: list[DraftChain] = []
        parts: list[tuple[Batch, torch.Tensor]] = []
        for i, r in enumerate(requests):
            seq, state = r.seq, self.seqs.get(r.seq.seq_id)
            n = len(seq.tokens)
            # The first draft step needs g of every position up to the one before the last token.
            if r.limits.n_max <= 0 or state is None or state.n < n - 1 or n < 2:
                continue
            # Cut the draft rows of the last proposal; row n-2 is computed again if need be, as
            # its logits give the first draft token.
            self.context.truncate(seq.seq_id, min(state.written, n - 2))
            # Windowed, row n-2 reads rows from n - 1 - window on: a long prompt's earlier rows
            # are never read, so they are not computed.
            start = (skip_unread_rows(self.context, seq.seq_id, n - 1 - self.window, state) if self.window
                     else self.context.length(seq.seq_id))
            tokens = seq.tokens[start + 1 : n]
            while len(tokens) > CATCH_UP_ROWS:  # a prompt's rows, written ahead in pieces
                self.head.decode(Batch.for_sequence(seq.seq_id, start, tokens[:CATCH_UP_ROWS], logits="none"), self.context,
                                 state.rows(start, start + CATCH_UP_ROWS), self.embed, self.output, self.window)
                start, tokens = start + CATCH_UP_ROWS, tokens[CATCH_UP_ROWS:]
            parts.append((Batch.for_sequence(seq.seq_id, start, tokens, logits="last"), state.rows(start, n - 1)))
            state.written = n - 1
            temperature = float(getattr(seq, "temperature", 0.0) or 0.0)
            active.append(DraftChain(i, seq.seq_id, r.limits, temperature, draft_generator(self.seed, seq)))
        try:
            while active:
                batch = Batch.concat([b for b, _ in parts])
                logits, prenorm = self.head.decode(batch, self.context, torch.cat([g for _, g in parts]), self.embed, self.output,
                                                   self.window)
                ends = [sum(len(b) for b, _ in parts[: j + 1]) - 1 for j in range(len(parts))]
                still, parts = [], []
                for row, (a, end) in enumerate(zip(active, ends)):
                    token, p, probs = pick_token(logits[row], a.temperature, a.generator, self.d2t, self.n_vocab)
                    if not a.add(token, p, probs):
                        out[a.index] = a.draft(self.spec_type)
                        continue
                    pos = batch.positions[end] + 1
                    still.append(a)
                    parts.append((Batch.for_sequence(a.seq_id, pos, [token], logits="last"), prenorm[end : end + 1]))
                active = still
        except BaseException:
            for a in active:  # the head's rows for these sequences are unknown now: write them again
                self.context.drop(a.seq_id)
                self.seqs[a.seq_id].written = 0
            raise
        return out
