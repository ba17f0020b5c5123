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
    reserved: int = 0  # the capacity, kept apart so that a cache of no layers (an all-recurrent stack) works

    @property
    def capacity(self) -> int:
        return self.reserved


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

    def nbytes(self, seq_id: int) -> int:
        """The memory the sequence's buffers take (their capacity, not only the rows in use)."""
        s = self.seqs.get(seq_id)
        return 0 if s is None else sum(t.nbytes for t in s.k + s.v)

    def get_state(self, seq_id: int) -> dict[str, torch.Tensor]:
        """The sequence's rows as named tensors (for saving to a file): k.L and v.L per layer,
        [n_kv_heads, length, head_dim]."""
        s = self.seqs.get(seq_id)
        n = 0 if s is None else s.length
        out = {}
        for layer in range(self.n_layers):
            out[f"k.{layer}"] = s.k[layer][:, :n].contiguous() if s else torch.zeros(0)
            out[f"v.{layer}"] = s.v[layer][:, :n].contiguous() if s else torch.zeros(0)
        return out

    def set_state(self, seq_id: int, state: dict[str, torch.Tensor]) -> int:
        """Replace the sequence's rows with those of `get_state`; returns their count. A state of
        another shape (another model) raises ValueError and leaves the sequence as it was."""
        vd = self.v_head_dim or self.head_dim
        try:
            ks = [state[f"k.{layer}"] for layer in range(self.n_layers)]
            vs = [state[f"v.{layer}"] for layer in range(self.n_layers)]
        except KeyError as e:
            raise ValueError(f"the state has no tensor {e.args[0]} ({self.n_layers} layers expected)") from None
        n = ks[0].shape[1] if ks[0].dim() == 3 else -1
        for t, d in [(t, self.head_dim) for t in ks] + [(t, vd) for t in vs]:
            if tuple(t.shape) != (self.n_kv_heads, n, d):
                raise ValueError(f"a state tensor has shape {tuple(t.shape)}, this model's are ({self.n_kv_heads}, n, {d})")
        if n > self.max_tokens:
            raise ValueError(f"the state holds {n} tokens, the context holds {self.max_tokens}")
        self.drop(seq_id)
        self.reserve(seq_id, max(n, 1))
        s = self.seqs[seq_id]
        for layer in range(self.n_layers):
            s.k[layer][:, :n] = ks[layer]
            s.v[layer][:, :n] = vs[layer]
        s.length = n
        return n

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
        self.seqs[seq_id] = _SeqCache(k, v, s.length if s else 0, cap)

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [n_kv_heads, rows, head_dim] at positions start.. and return views of the
        sequence's whole cache up to the last written row."""
        s = self.seqs[seq_id]
        end = start + k.shape[1]
        s.k[layer][:, start:end] = k
        s.v[layer][:, start:end] = v
        return s.k[layer][:, :end], s.v[layer][:, :end]

    def buffers(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's whole K and V buffers of a layer ([n_kv_heads, capacity, head_dim]), for
        a kernel that stores rows itself (BackendKernels.fused_layer); reserve() first."""
        s = self.seqs[seq_id]
        return s.k[layer], s.v[layer]

    def commit(self, seq_id: int, end: int) -> None:
        """After a forward: the sequence now holds tokens [0, end)."""
        self.seqs[seq_id].length = end
