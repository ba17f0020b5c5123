"""The state of a hybrid model (attention layers and recurrent layers) for many sequences.

Attention layers keep K/V rows in a KVCache, which can be cut back to any length. Recurrent
layers (a short convolution, a Gated DeltaNet, an SSM) keep a fixed-size state per sequence that
cannot: once a token went in, the state before it is gone. Two ways back exist:

- per-row states (`keep_rows`): a forward stores the state after each of its rows, so the
  sequence can be cut back to any point inside its last forward (a verification step's partial
  acceptance) with no re-decode. One use: the next forward replaces them. A layer whose state is
  large may hand over a function instead (`RowStates`) that recomputes the state after row j
  from the state before the forward and the inputs of its recurrence alone (no projections):
  cheaper than copying a large state per row when few rows are cut.
- checkpoints: `save` copies the whole state, `restore` goes back to it (and the engine replays
  the tokens after it). Prompt-cache resume points and the fallback for rollbacks that reach
  further back than the last forward.

A model's forward reads a layer's state with `read`, hands back the per-row states with `write`,
and ends with `commit`; the KV side goes through `kv` as for any transformer.
"""
from __future__ import annotations

from typing import Callable

import attrs
import torch

from speculant.context import KVCache


# The state after row j (0-based) of a forward, computed on demand: per_row for `write`.
RowStates = Callable[[int], list[torch.Tensor]]


@attrs.define
class _SeqState:
    states: dict[int, list[torch.Tensor]]  # recurrent layer -> its state tensors after `length` tokens
    length: int = 0
    # The last forward: its first row's position, the state before it, and per layer the states
    # after each of its rows (stacked [rows, ...], or a RowStates function), for `truncate` inside it.
    rows_start: int = -1
    before: dict[int, list[torch.Tensor]] = attrs.field(factory=dict)
    rows: dict[int, "list[torch.Tensor] | RowStates"] = attrs.field(factory=dict)
    pending: dict[int, tuple[list[torch.Tensor], "list[torch.Tensor] | RowStates | None"]] = attrs.field(factory=dict)


@attrs.define(eq=False)
class Checkpoint:
    """A copy of one sequence's recurrent state after `length` tokens (its KV rows stay in the
    cache: rows before `length` are never rewritten while the checkpoint is in use)."""

    length: int
    states: dict[int, list[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.states.values() for t in ts)


def _span_bytes(t: torch.Tensor) -> int:
    """The memory a view spans: a conv block's per-row states are overlapping windows of one
    buffer (lfm2: row j's state is rows j+1 .. j+s of [state | Bx]), whose `nbytes` would count
    each row's window whole, s times the buffer."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))) * t.element_size()


@attrs.define
class HybridCache:
    """`kv`: the attention layers' rows (its layer index is the model's own attention-layer
    count, see `kv_layers`); `state_shapes`: per recurrent layer, the shapes of its state
    tensors (zero at a sequence's start)."""

    kv: KVCache
    state_shapes: dict[int, tuple[tuple[int, ...], ...]]
    keep_rows: bool = True
    dtype: torch.dtype = torch.float32
    seqs: dict[int, _SeqState] = attrs.field(factory=dict)
    # The sequences whose rows of the next forward keep their states (the engine sets it to those
    # verifying a draft: a prompt chunk or a plain step never needs them); None: every sequence.
    rows_for: set[int] | None = None

    state_kind = "recurrent"

    # --- what the engine calls ---------------------------------------------------------
    def length(self, seq_id: int) -> int:
        s = self.seqs.get(seq_id)
        return 0 if s is None else s.length

    def rollback_floor(self, seq_id: int) -> int:
        """The shortest length `truncate` can cut the sequence back to now (its length where the
        last forward's per-row states are not kept)."""
        s = self.seqs.get(seq_id)
        if s is None:
            return 0
        return s.rows_start if s.rows_start >= 0 else s.length

    def can_truncate(self, seq_id: int, n: int) -> bool:
        return n >= self.rollback_floor(seq_id)

    def truncate(self, seq_id: int, n: int) -> None:
        """Cut the sequence back to n tokens: free for the attention rows, and for the recurrent
        layers possible only inside the last forward (ValueError below `rollback_floor`)."""
        s = self.seqs.get(seq_id)
        if s is None or n >= s.length:
            return
        if n < self.rollback_floor(seq_id):
            raise ValueError(f"sequence {seq_id}: recurrent state after {s.length} tokens cannot be cut back to {n} "
                             f"(per-row states reach back to {self.rollback_floor(seq_id)}); restore a checkpoint")
        j = n - s.rows_start  # rows of the last forward kept
        if j == 0:
            s.states = s.before
        else:
            s.states = {layer: ts(j - 1) if callable(ts) else [t[j - 1].clone() for t in ts] for layer, ts in s.rows.items()}
        s.length = n
        s.rows_start, s.before, s.rows = -1, {}, {}  # one use: the state now is not the last forward's
        self.kv.truncate(seq_id, n)

    def drop(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.kv.drop(seq_id)

    def save(self, seq_id: int) -> Checkpoint:
        s = self._seq(seq_id)
        return Checkpoint(s.length, {layer: [t.clone() for t in ts] for layer, ts in s.states.items()})

    def restore(self, seq_id: int, handle: Checkpoint) -> None:
        s = self._seq(seq_id)
        if handle.length > max(s.length, self.kv.length(seq_id)):
            raise ValueError(f"sequence {seq_id}: a checkpoint after {handle.length} tokens, the cache holds {s.length}")
        s.states = {layer: [t.clone() for t in ts] for layer, ts in handle.states.items()}
        s.length = handle.length
        s.rows_start, s.before, s.rows = -1, {}, {}
        self.kv.truncate(seq_id, handle.length)

    def nbytes(self, seq_id: int) -> int:
        """The sequence's memory: its KV buffers, its recurrent state and the per-row states kept."""
        s = self.seqs.get(seq_id)
        if s is None:
            return 0
        rec = sum(t.nbytes for ts in s.states.values() for t in ts)
        rec += sum(_span_bytes(t) for ts in s.rows.values() if not callable(ts) for t in ts)
        return self.kv.nbytes(seq_id) + rec

    def state_nbytes(self) -> int:
        """One sequence's recurrent state (the memory of one checkpoint)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return sum(item * _numel(shape) for shapes in self.state_shapes.values() for shape in shapes)

    # --- what a model's forward calls ----------------------------------------------------
    def read(self, seq_id: int, layer: int) -> list[torch.Tensor]:
        """The layer's state tensors for the sequence before this forward's rows (do not modify)."""
        return self._seq(seq_id).states[layer]

    def wants_rows(self, seq_id: int) -> bool:
        """Whether this forward should hand `write` the per-row states of the sequence."""
        return self.keep_rows and (self.rows_for is None or seq_id in self.rows_for)

    def write(self, seq_id: int, layer: int, final: list[torch.Tensor],
              per_row: "list[torch.Tensor] | RowStates | None" = None) -> None:
        """The layer's state after this forward's rows of the sequence, and (where
        `wants_rows(seq_id)`) the states after each row: stacked [rows, ...] (per_row[i][-1]
        equals final[i]), or a RowStates function giving row j's state."""
        self._seq(seq_id).pending[layer] = (final, per_row)

    def commit(self, seq_id: int, start: int, end: int) -> None:
        """After a forward: the sequence holds tokens [0, end); the rows [start, end) were this
        forward's."""
        s = self._seq(seq_id)
        if s.pending.keys() != self.state_shapes.keys():
            missing = sorted(self.state_shapes.keys() - s.pending.keys())
            raise RuntimeError(f"sequence {seq_id}: the forward wrote no state for recurrent layers {missing}")
        keep = self.keep_rows and all(per_row is not None for _, per_row in s.pending.values())
        s.before = s.states if keep else {}
        s.rows = {layer: per_row for layer, (_, per_row) in s.pending.items()} if keep else {}
        s.rows_start = start if keep else -1
        s.states = {layer: final for layer, (final, _) in s.pending.items()}
        s.pending = {}
        s.length = end
        self.kv.commit(seq_id, end)

    def reserve(self, seq_id: int, n_tokens: int) -> None:
        self._seq(seq_id)
        self.kv.reserve(seq_id, n_tokens)

    def _seq(self, seq_id: int) -> _SeqState:
        s = self.seqs.get(seq_id)
        if s is None:
            s = self.seqs[seq_id] = _SeqState({layer: [torch.zeros(shape, dtype=self.dtype, device=self.kv.device) for shape in shapes]
                                              for layer, shapes in self.state_shapes.items()})
        return s


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def kv_layers(layer_is_recurrent: list[bool]) -> dict[int, int]:
    """Model layer -> its index in the KVCache, for the attention layers of a hybrid stack."""
    out: dict[int, int] = {}
    for i, recurrent in enumerate(layer_is_recurrent):
        if not recurrent:
            out[i] = len(out)
    return out

