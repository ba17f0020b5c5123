"""What the engine needs from a model, a backend and a model's state (typing Protocols).

A Model is built by an architecture plugin from a GGUF file and a Backend; its forward is
device-free code that calls the backend for the heavy kernels. A Context is the model's state
for many sequences: a KVCache for transformers, or a recurrent state that can only be saved and
restored (``state_kind == "recurrent"``).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, Sequence, runtime_checkable

import attrs
import torch

from speculant.types import Batch, ForwardOutput


@attrs.frozen
class ModelInfo:
    path: str
    architecture: str
    n_vocab: int
    n_embd: int
    n_layers: int
    n_ctx_train: int
    file_bytes: int = 0


@runtime_checkable
class Context(Protocol):
    state_kind: str  # "kv": truncatable; "recurrent": needs save/restore

    def length(self, seq_id: int) -> int: ...
    def truncate(self, seq_id: int, n: int) -> None: ...
    def drop(self, seq_id: int) -> None: ...


@runtime_checkable
class RecurrentContext(Context, Protocol):
    def save(self, seq_id: int) -> Any: ...
    def restore(self, seq_id: int, handle: Any) -> None: ...


@runtime_checkable
class Model(Protocol):
    info: ModelInfo
    tokenizer: Any  # speculant.gguf.tokenizer.Tokenizer

    def new_context(self, max_tokens: int) -> Context: ...

    def forward(self, batch: Batch, context: Context, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """Run the rows of `batch` (any number of sequences) through the model, appending them to
        `context`. Returns float32 logits for rows with want_logits, in row order, and the
        hidden states (output of each requested layer) of all rows."""
        ...

    # Optional, for a model whose rows are not all computed alike:
    #   row_classes(positions, prompt_lens) -> sequence of ints, or None where all rows compute alike.
    #   Two rows at the same position, of the same tokens, compute the same bits exactly when
    #   their classes are equal, whatever else is in their batches; `prompt_lens[i]` is the prompt
    #   length of row i's request (a backend may compute prompt rows as its reference does a prompt).
    #   The prompt cache reuses a cached row for a new prompt only where the classes agree.
    #   warm_up() -> None: run a greedy row and wait for what that starts in the background, so
    #   that the first requests run at full speed (`speculant serve` calls it unless --no-warmup).


Linear = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class Backend(Protocol):
    """Kernels for one device. Weights arrive as GGUF TensorInfo and are turned into the device's
    own packed form. Every kernel must be batch-invariant: a row's result may not depend on the
    other rows computed with it (the engine's bit-exactness rests on it)."""

    name: str
    device: torch.device
    kv_dtype: torch.dtype

    def linear(self, weight: Any, bias: Any | None = None) -> Linear:
        """x [rows, in] float32 -> [rows, out] float32."""
        ...

    def embedding(self, weight: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """token ids [rows] -> [rows, n_embd] float32."""
        ...

    def tensor(self, weight: Any) -> torch.Tensor:
        """A small tensor (norm weights) as dense float32 on the device."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  scale: float, window: int = 0) -> torch.Tensor:
        """One sequence's rows. q [rows, n_head, head_dim] at absolute `positions`; k, v
        [n_kv_heads, n_cached, head_dim] hold the whole sequence so far. A row at position p
        attends to keys 0..p (only the last `window` of them if window > 0). -> [rows, n_head, v_dim]."""
        ...

    # Optional kernels: see BackendKernels below.


@attrs.frozen
class DecoderLayerSpec:
    """A pre-norm decoder layer of the llama family, as a backend's `fused_layer` takes it:
    x += Wo attn(rope(Wq n(x)), rope(Wk n(x)), Wv n(x)); x += Wd (silu(g) * u), [g | u] = Wgu n(x).
    The linears are the backend's own (from its `linear`); biases, where the model has them,
    belong to them."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    w_gate_up: Linear  # the gate rows, then the up rows
    w_down: Linear
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    eps: float
    neox: bool
    scale: float  # the attention's score scale
    window: int = 0  # sliding-window attention (0: none)


@attrs.frozen
class LayerRows:
    """What a fused layer needs of a forward's rows, besides x. `groups` holds, per sequence, its
    rows [first, end) (consecutive positions) and its whole K and V cache buffers of this layer
    ([n_kv_heads, capacity, head_dim], the backend's kv_dtype; KVCache.buffers), where the layer
    stores the rows' keys and values as KVCache.write would."""

    cos: torch.Tensor  # [rows, head_dim / 2], from rope_tables
    sin: torch.Tensor
    positions: torch.Tensor  # [rows] int64
    groups: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]


class BackendKernels(Protocol):
    """What a backend MAY add to `Backend`, for architectures to use where it has them (the CPU
    backend computes these as llama.cpp does); an architecture falls back to its own torch code
    for each one a backend lacks (`backend_kernel`). Signatures and meaning are fixed here, so an
    architecture and a backend from different distributions agree on them."""

    def batch(self, batch: Batch, prompt: bool = True) -> ContextManager[None]:
        """A scope around a forward's layers: the backend may compute each row's linear layers by
        its position and prompt length (`row_classes`); `prompt=False` marks every row a decode row
        (a nested scope, e.g. around the last layer's FFN of the rows that want logits)."""
        ...

    def row_classes(self, positions: Sequence[int], prompt_lens: Sequence[int], prompt: bool = True) -> Sequence[int] | None:
        """As Model.row_classes, for the rows' kernels (None: every row alike)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension, times the weight."""
        ...

    def rope_tables(self, positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows, head_dim / 2] for absolute positions (linear position scaling `scale`)."""
        ...

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
        """Rotate x [rows, heads, head_dim] by the tables; neox pairs i with i + d/2, else 2i with 2i+1."""
        ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up."""
        ...

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """GELU, tanh approximation."""
        ...

    def fused_layer(self, spec: DecoderLayerSpec) -> Callable[[torch.Tensor, LayerRows], torch.Tensor] | None:
        """The whole layer as one kernel, where the backend has one for these weights (None: the
        architecture runs the layer piece by piece). The callable maps x [rows, n_embd] to the
        layer's output, storing the rows' keys and values in their caches, with the bits of the
        piece-by-piece forward through this backend's kernels, inside the same `batch` scope."""
        ...

    def argmax_head(self, head: Linear) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """A cheaper form of the output projection `head` (from this backend's `linear`) for rows
        whose logits serve only their argmax (`Batch.argmax_only`), or None where it has none.
        Called once per head, at load. The callable takes x [rows, n_embd], inside the `batch`
        scope the head itself would run in, and returns logits [rows, n_vocab] whose argmax (the
        first maximum) is exactly the head's for every row, other entries free (-inf where not
        computed); or None, and the head runs. Where it prepares something in the background it
        may have a `wait()` that returns once that is ready (a model's warm_up calls it)."""
        ...

    def gated_delta_net(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        decay: torch.Tensor, beta: torch.Tensor, scale: float,
                        per_row: torch.Tensor | None = None) -> torch.Tensor:
        """The Gated DeltaNet recurrence over one sequence's n rows, updating `state` [heads, d_v,
        d_k] (float32, contiguous) in place: per row t and head h, S = S * decay[t, h];
        S_j += ((v[t, h, j] - S_j . k[t, h]) * beta[t, h]) k[t, h]; out[t, h, j] = S_j . q[t, h] * scale.
        q, k [n, heads, d_k], v [n, heads, d_v], decay, beta [n, heads]; `per_row` [n, heads, d_v,
        d_k], where given, receives the state after each row. -> out [n, heads, d_v]."""
        ...


BACKEND_KERNELS = tuple(n for n in vars(BackendKernels) if not n.startswith("_"))


def backend_kernel(backend: Any, name: str, fallback: Any = None) -> Any:
    """The backend's optional kernel `name` (one of BackendKernels'), else `fallback`."""
    if name not in BACKEND_KERNELS:
        raise AttributeError(f"'{name}' is not an optional backend kernel (BackendKernels: {', '.join(BACKEND_KERNELS)})")
    return getattr(backend, name, fallback)
