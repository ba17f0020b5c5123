"""The unified multi-sequence KV cache: one object per loaded model, many sequences by id.

Each sequence owns per-layer K and V buffers with spare capacity; appending writes in place,
truncating to n tokens only moves the sequence's length (no copy), and growth doubles the
capacity. The same class serves a target and any draft model.
"""
from __future__ import annotations

import attrs
import torch

from speculant.errors import LimitError


@attrs.define
class _SeqCache:
    k: list[torch.Tensor]  # per layer [n_kv_heads, capacity, head_dim]
    v: list[torch.Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@attrs.define
class KVCache:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_tokens: int  # per sequence: the context size
    dtype: torch.dtype = torch.float32
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    v_head_dim: int | None = None
    seqs: dict[int, _SeqCache] = attrs.field(factory=dict)

    state_kind = "kv"

    # --- sequence management -----------------------------------------------------------
    def length(self, seq_id: int) -> int:
        s = self.seqs.get(seq_id)
        return 0 if s is None else s.length

    def truncate(self, seq_id: int, n: int) -> None:
        """Keep the first n tokens of the sequence. Later appends overwrite the rest in place."""
        s = self.seqs.get(seq_id)
        if s is not None:
            s.length = min(s.length, max(0, n))

    def drop(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    # --- used by the model's forward ------------------------------------------------------
    def reserve(self, seq_id: int, n_tokens: int) -> None:
        """Make room for the sequence to hold n_tokens in total."""
        if n_tokens > self.max_tokens:
            raise LimitError(f"sequence {seq_id} needs {n_tokens} tokens, the context holds {self.max_tokens}")
        s = self.seqs.get(seq_id)
        if s is not None and s.capacity >= n_tokens:
            return
        cap = min(self.max_tokens, max(256, n_tokens, 2 * (s.capacity if s else 0)))
        vd = self.v_head_dim or self.head_dim
        k = [torch.zeros(self.n_kv_heads, cap, self.head_dim, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        v = [torch.zeros(self.n_kv_heads, cap, vd, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        if s is not None:
            for layer in range(self.n_layers):
                k[layer][:, : s.length] = s.k[layer][:, : s.length]
                v[layer][:, : s.length] = s.v[layer][:, : s.length]
        self.seqs[seq_id] = _SeqCache(k, v, s.length if s else 0)

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [n_kv_heads, rows, head_dim] at positions start.. and return views of the
        sequence's whole cache up to the last written row."""
        s = self.seqs[seq_id]
        end = start + k.shape[1]
        s.k[layer][:, start:end] = k
        s.v[layer][:, start:end] = v
        return s.k[layer][:, :end], s.v[layer][:, :end]

    def commit(self, seq_id: int, end: int) -> None:
        """After a forward: the sequence now holds tokens [0, end)."""
        self.seqs[seq_id].length = end
