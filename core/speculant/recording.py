"""Keeping the target's states while it answers, so self-distilled data costs one pass of the target.

The self-distillation recipe decoded the answers first, then ran the target again over every
prompt + answer to keep its layers' states and its top-k (``training.collect``): 21 ms a row on
two AVX2 cores, about as long again as the answering. The target computes those states while it
answers. A :class:`StateRecorder` rides in the answering engine's chain like a speculator that
never drafts: it asks for the layers through ``hidden_layers`` and keeps each sequence's committed
rows, as a hidden-state drafter does. The top-k needs every row's logits, which the answering
does not compute (greedy rows take the argmax head, prompt chunks skip the head), so the recorder
also keeps the final-normed state (layer ``n_layers``) and puts a finished answer's rows through
the target's output head, ``PIECE_ROWS`` at a time.

A finished answer's rows are the positions of ``seq.tokens[:-1]``: the last token is never fed
(it has no next token to learn from anyway). Where the recorder lacks rows of an answer (a hook
raised, so the engine stopped calling it for that sequence), the answer is run through the
target as the collection used to, so that the sink gets every answer in the order it is handed
over.
"""
from __future__ import annotations

from typing import Callable

import torch

from speculant.drafting import PositionStates, committed_rows
from speculant.hookspecs import hookimpl
from speculant.types import Batch, Draft, SequenceView

# Rows put through the output head at once: the 1.5B's logits of 128 rows are 78 MB of floats.
PIECE_ROWS = 128

# sink(tokens, hidden [n, sum widths] float, top_ids [n, K], top_p [n, K]) -> None
Sink = Callable[[list, torch.Tensor, torch.Tensor, torch.Tensor], None]


class StateRecorder:
    """Keeps the states of `layers` (``Model.forward(hidden_layers=)`` numbers, concatenated in
    this order) and the target's top `top_k` for every committed row of the sequences an engine
    decodes; :meth:`finish` hands a finished sequence's rows to `sink` and returns how many
    (`rows` counts them all, from the caller's start)."""

    spec_type = "record"

    def __init__(self, target, layers: tuple[int, ...], top_k: int, sink: Sink, rows: int = 0):
        self.output = getattr(target, "output", None)
        if self.output is None:
            raise ValueError(f"{type(target).__name__} has no output head to take the top-k from while answering")
        self.target, self.layers, self.top_k, self.sink = target, tuple(layers), top_k, sink
        self.final = target.info.n_layers  # the final-normed state
        self.hidden_layers = tuple(sorted(set(self.layers) | {self.final}))
        self.width = target.info.n_embd
        self.seqs: dict[int, tuple[PositionStates, PositionStates]] = {}
        self.rows = rows  # handed to the sink so far (the caller's count to start from)
        self.recomputed = 0  # answers run through the target again (the recorder lacked rows)

    def _states(self, seq_id: int) -> tuple[PositionStates, PositionStates]:
        if seq_id not in self.seqs:
            taps = PositionStates(self.width * len(self.layers))
            final = PositionStates(self.width, data=torch.zeros(256, self.width, dtype=torch.float32))
            self.seqs[seq_id] = (taps, final)
        return self.seqs[seq_id]

    def _store(self, seq_id: int, start: int, hidden: dict, n: int) -> None:
        if n <= 0 or any(l not in hidden for l in self.hidden_layers):
            return
        taps, final = self._states(seq_id)
        if taps.put(start, torch.cat([hidden[l][:n] for l in self.layers], dim=-1)):
            final.put(start, hidden[self.final][:n])

    @hookimpl
    def begin(self, seq: SequenceView) -> None:
        self.seqs.pop(seq.seq_id, None)
        self._states(seq.seq_id)

    @hookimpl
    def prefill(self, seq: SequenceView, start: int, hidden: dict) -> None:
        self._store(seq.seq_id, start, hidden, len(next(iter(hidden.values()))) if hidden else 0)

    @hookimpl
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict, hidden_start: int) -> None:
        self._store(seq.seq_id, hidden_start, hidden, committed_rows(seq, draft, n_accepted, hidden, hidden_start))

    @hookimpl
    def truncate(self, seq: SequenceView, n: int) -> None:
        for states in self.seqs.get(seq.seq_id, ()):
            states.cut(n)

    @hookimpl
    def end(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def finish(self, seq_id: int, tokens: list[int]) -> int:
        """Hand the rows of finished sequence `seq_id`, whose tokens are `tokens`, to the sink
        (the positions of ``tokens[:-1]``); forget the sequence. Returns the rows handed over."""
        ids = list(tokens[:-1])
        n = len(ids)
        taps, final = self.seqs.pop(seq_id, (None, None))
        if taps is None or taps.n < n:
            hidden, top_ids, top_p = read_back(self.target, self.target.new_context(n + 1), ids, self.layers, self.top_k)
            self.recomputed += 1
        else:
            hidden = taps.data[:n]
            top_ids, top_p = self._top(final.data[:n])
        self.sink(ids, hidden, top_ids, top_p)
        self.rows += n
        return n

    def _top(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, probs = [], []
        for lo in range(0, len(normed), PIECE_ROWS):
            logits = self.output(normed[lo: lo + PIECE_ROWS].contiguous()).float()
            top = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            ids.append(top.indices)
            probs.append(top.values)
        return torch.cat(ids), torch.cat(probs)


def read_back(target, context, ids: list[int], layers: tuple[int, ...], top_k: int):
    """`ids` read by the target as a prompt (sequence 0 of `context`, dropped after): the states
    of `layers` side by side, and the top `top_k` next tokens and their probabilities, per row."""
    out = target.forward(Batch.for_sequence(0, 0, ids, logits="all"), context, hidden_layers=tuple(sorted(set(layers))))
    context.drop(0)
    top = torch.softmax(out.logits.float(), dim=-1).topk(top_k, dim=-1)
    return torch.cat([out.hidden[l].float() for l in layers], dim=-1), top.indices, top.values
