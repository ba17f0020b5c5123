"""--spec-type mtp (llama.cpp: draft-mtp): drafting with the target's NextN / MTP block.

Where the block comes from: the `-md` file when it holds one (a sidecar, `mtp-....gguf`), else the
target's own GGUF (`{arch}.nextn_predict_layers` > 0), as llama.cpp creates its MTP context on the
target's weights when no draft file is given.

The speculator asks the engine for the target's final hidden state (`hidden_layers` =
(n_layers,): the state after output_norm, llama.cpp's h_nextn) and keeps it per sequence for
every position (float16), handed over by `prefill` (prompt chunks) and `accept` (each step), so a
history cut anywhere (`truncate`, the prompt cache) can be resumed.

The head's KV cache (one context for all sequences, under the target's sequence ids) holds at
position q the pair (x_q, h_{q-1}), position 0 pairing x_0 with a zero state as llama.cpp's first
batch does. It is written lazily: at the next proposal the rows not yet written (the accepted
tokens and the correction, or a prompt) go in as the first draft step, whose last row (the last
token, at position n-1, with h_{n-2}) predicts the first draft token; each further step feeds
(draft token, the previous row's output state) at the next position, as llama.cpp's draft-mtp
does. Rows written from drafts are cut away before the next proposal. Every step is one batched
head forward for all sequences still drafting.

Where the file carries a draft vocabulary (`speculant.mtp.draft_vocab`, written by `speculant train
mtp`), drafts come from those tokens only, through those rows of the lm_head (a quarter of the
cost of a draft step on a 150k-token target); `--spec-mtp-full-vocab` uses the whole vocabulary.

At temperature 0 the draft is the head's argmax (p_min, n_min and n_max as llama.cpp's); at
temperature T > 0 draft tokens are sampled from the head's softmax at T and returned with those
probabilities, so the engine verifies them by rejection sampling.
"""
from __future__ import annotations

import os
import threading

import torch

from speculant import (Batch, Draft, DraftLimits, DraftRequest, ModelFileError, SequenceView, SpeculantError,
                       SpeculatorState, hookimpl)
from speculant.drafting import (DraftChain, PositionStates, committed_rows, draft_generator, export_positions,
                                held_bytes, import_positions, pick_token, skip_unread_rows)
from speculant.speculator import SpeculatorConfig

from speculant_mtp.head import MtpHead
from speculant_mtp.layout import has_nextn

# Rows of the head written in one forward when it catches up on a prompt (bounded temporaries).
CATCH_UP_ROWS = 64

_heads: dict[tuple, MtpHead] = {}
_heads_lock = threading.Lock()


def load_head(path: str, target, full_vocab: bool = False) -> MtpHead:
    """The MTP block in `path` for `target`, loaded once per process and target."""
    from speculant.gguf import open_gguf

    try:
        st = os.stat(path)
    except OSError as e:
        raise SpeculantError(f"{path}: cannot read the MTP head: {e.strerror or e}") from None
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size, id(target), full_vocab)
    with _heads_lock:
        head = _heads.get(key)
        if head is None or head.backend is not target.backend:
            try:
                head = MtpHead.load(open_gguf(path), target, full_vocab=full_vocab)
            except OSError as e:
                raise SpeculantError(f"{path}: cannot read the MTP head: {e.strerror or e}") from None
            _heads[key] = head
    return head


def head_source(draft_model: str | None, target) -> str:
    """The file whose MTP block drafts: the -md file if it has one, else the target's."""
    from speculant.gguf import open_gguf

    if draft_model:
        try:
            if has_nextn(open_gguf(draft_model)):
                return draft_model
        except OSError as e:
            raise SpeculantError(f"{draft_model}: cannot read the MTP head: {e.strerror or e}") from None
    path = getattr(getattr(target, "info", None), "path", None)
    if path and os.path.exists(path) and has_nextn(open_gguf(path)):
        return path
    if draft_model:
        raise SpeculantError(f"{draft_model} holds no MTP block ('nextn_predict_layers' and blk.N.nextn.* tensors), "
                             f"nor does the target {path}: pass an MTP sidecar (mtp-....gguf) or train one with "
                             "`speculant train mtp`")
    raise SpeculantError(f"the target {path} has no MTP block: pass an MTP sidecar with -md mtp-....gguf "
                         "(`speculant train mtp` trains one)")


class Mtp:
    spec_type = "mtp"

    @staticmethod
    def contract_draft_model(target_path: str, directory: str) -> str:
        """The contract suite's sidecar: a random MTP block for its tiny target."""
        from speculant_mtp.testing import write_random_sidecar

        return write_random_sidecar(os.path.join(directory, "mtp-head.gguf"), target_path)[0]

    def __init__(self, config: SpeculatorConfig):
        target = config.target
        if target is None:
            raise SpeculantError(f"spec type {config.spec_type} needs the target model")
        path = head_source(config.draft_model, target)
        try:
            self.head = load_head(path, target, bool(config.option("spec_mtp_full_vocab", False)))
        except ModelFileError as e:
            raise SpeculantError(str(e)) from None
        self.hidden_layers = (target.info.n_layers,)
        window = config.option("spec_mtp_window", None)
        self.window = self.head.trained_window if window is None else int(window)
        max_tokens = int(config.option("ctx_size", 0) or 0) or (1 << 20)
        self.context = self.head.new_context(max_tokens)
        self.n_vocab = target.info.n_vocab
        self.vocab = self.head.vocab  # token ids of the head's logit columns, or None: all
        self.seed = int(config.option("seed", 0) or 0)
        self.seqs: dict[int, PositionStates] = {}

    # --- what the target computed ------------------------------------------------------------
    def _state(self, seq_id: int) -> PositionStates:
        state = self.seqs.get(seq_id)
        if state is None:  # the block's row q pairs (x_q, h_{q-1})
            state = self.seqs[seq_id] = PositionStates(self.head.config.n_embd, state_offset=-1, token_offset=0)
        return state

    def _store(self, seq_id: int, start: int, hidden: dict, n_valid: int) -> None:
        h = hidden.get(self.hidden_layers[0])
        if h is not None and n_valid > 0:
            self._state(seq_id).put(start, h[:n_valid])  # after a gap, drafting waits

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

    # Its states are the target's own final-normed rows: valid for any head on this target.
    @hookimpl
    def export_state(self, seq_id: int, n: int) -> SpeculatorState | None:
        return export_positions(self.seqs.get(seq_id), n, f"hidden:{self.hidden_layers[0]}")

    @hookimpl
    def import_state(self, seq: SequenceView, state: SpeculatorState, n: int) -> bool:
        return import_positions(self._state(seq.seq_id), state, n, f"hidden:{self.hidden_layers[0]}")

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
            # The first draft step is row n-1: (last token, h_{n-2}).
            if r.limits.n_max <= 0 or state is None or state.n < n - 1 or n < 1:
                continue
            # Cut the draft rows of the last proposal; row n-1 is computed again if need be, as
            # its logits give the first draft token.
            self.context.truncate(seq.seq_id, min(state.written, n - 1))
            # Windowed, row n-1 reads rows from n - window on: a long prompt's earlier rows are
            # never read, so they are not computed (1000 prompt rows took 0.8 s on a Zen 3 core).
            start = (skip_unread_rows(self.context, seq.seq_id, n - self.window, state) if self.window
                     else self.context.length(seq.seq_id))
            while n - start > CATCH_UP_ROWS:  # a prompt's rows, written ahead in pieces
                end = start + CATCH_UP_ROWS
                self.head.decode(Batch.for_sequence(seq.seq_id, start, seq.tokens[start:end], logits="none"), self.context,
                                 state.rows(start, end), self.window)
                start = end
            parts.append((Batch.for_sequence(seq.seq_id, start, seq.tokens[start:n], logits="last"), state.rows(start, n)))
            state.written = n
            temperature = float(getattr(seq, "temperature", 0.0) or 0.0)
            active.append(DraftChain(i, seq.seq_id, r.limits, temperature, draft_generator(self.seed, seq)))
        try:
            while active:
                batch = Batch.concat([b for b, _ in parts])
                logits, states = self.head.decode(batch, self.context, torch.cat([h for _, h in parts]), self.window)
                ends = [sum(len(b) for b, _ in parts[: j + 1]) - 1 for j in range(len(parts))]
                still, parts = [], []
                for row, (a, end) in enumerate(zip(active, ends)):
                    token, p, probs = pick_token(logits[row], a.temperature, a.generator, self.vocab, self.n_vocab)
                    if not a.add(token, p, probs):
                        out[a.index] = a.draft(self.spec_type)
                        continue
                    still.append(a)
                    parts.append((Batch.for_sequence(a.seq_id, batch.positions[end] + 1, [token], logits="last"),
                                  states[end : end + 1]))
                active = still
        except BaseException:
            for a in active:  # the head's rows for these sequences are unknown now: write them again
                self.context.drop(a.seq_id)
                self.seqs[a.seq_id].written = 0
            raise
        return out
