"""The CPU kernels: packed linear layers, quantized embedding lookup, batch-invariant attention."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from speculant.gguf import dequantize, dequantize_rows, unpack_q4_groups
from speculant.logs import get_logger

from speculant_cpu import fused, hugepages, native, screen

INT4_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q4_K}
GROUP = 32
# From this many rows in a batch llama.cpp's attention takes a tiled float32 path we do not
# reproduce, so a prompt batch that long cannot come out as llama.cpp's anyway: its rows take the
# fast kernels (the prompt-row kernels run without AMX: three times slower on a long prompt).
LLAMA_FA_TILE_Q = 64
# From this position on, llama.cpp's decode attention splits the keys between threads (its key
# count is padded to a multiple of 256 and split from 512), which we do not reproduce either.
# Its bits being out of reach there, rows from this position on take plain fp32 flash attention
# (attention.cpp's exact_below), 2-3 times faster than its fp16 rounding after every key.
LLAMA_SPLIT_KV = 256


def _two_rows_at_least(matmul, x: torch.Tensor) -> torch.Tensor:
    """oneDNN takes a matrix-vector path for a single row whose rounding can differ from its
    matrix-matrix path (seen on real weights); the int4 kernel is row-invariant from 2 rows on.
    So one row is computed as two: the cost is the same (the weights are read once either way)."""
    if x.shape[0] == 1:
        return matmul(x.expand(2, -1).contiguous())[:1]
    return matmul(x)


DENSE_TILE = 16


def _fixed_tiles(matmul, x: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM's summation order depends on the row count, so every call gets exactly
    DENSE_TILE rows (padded with zeros); a row's result then depends only on its own values. The
    matmul is bound by reading the weights, so 16 rows cost about what 1 does."""
    n = x.shape[0]
    pad = (-n) % DENSE_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([matmul(tile) for tile in x.split(DENSE_TILE)])[:n]


class Int4Linear:
    """y = x @ W.T (+ b) with W stored as torch int4 pack, group 32, bf16 scale and zero."""

    def __init__(self, info, bias):
        q, scale, offset = unpack_q4_groups(info.data, info.qtype, info.shape)
        # GGUF: w = q*scale + offset; torch's format: w = (q - 8)*scale + zero.
        zero = offset + 8 * scale
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = bias
        self.out_features = info.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _two_rows_at_least(lambda a: torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.packed, GROUP, self.scale_zero),
                               x.to(torch.bfloat16)).float()
        return y if self.bias is None else y + self.bias


class NativeLinear:
    """y = x @ W.T (+ b) by the native fused kernels, W in its GGUF format: a copy in huge pages
    (hugepages.py), or where those are off straight from the file's memory map. Either way
    resident memory stays about the size of the file. x is quantized per call to 8 bits as
    llama.cpp does (Q8_K or Q8_0), and the arithmetic is llama.cpp's, so the results are its
    results. The backend's `batch` scope says how each row is computed (prompt rows take the
    arithmetic llama.cpp uses for a prompt)."""

    def __init__(self, backend, lib, info, bias):
        self.backend = backend
        self.lib, self.qtype = lib, int(info.qtype)
        copied = hugepages.copy(info.data, lib)
        # the loader must not release the file's pages of a tensor read from its map
        self.uses_mapping = copied is None
        self.raw = info.data if copied is None else copied  # keeps the mapping, or the copy, alive
        self.ptr = self.raw.ctypes.data
        self.out_features, self.in_features = info.shape
        if copied is None:
            lib.spk_prefault(self.ptr, self.raw.nbytes)  # fault the pages in now, not in the first forward
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        mode = self.backend.row_mode(self.qtype, x.shape[0])
        if mode is None:  # rows of different kinds
            failed = self.lib.spk_linear_prompt(self.qtype, self.ptr, self.out_features, self.in_features, x.data_ptr(),
                                                x.shape[0], y.data_ptr(), self.backend.row_kinds_ptr)
        elif mode:
            failed = self.lib.spk_linear_mode(self.qtype, self.ptr, self.out_features, self.in_features, x.data_ptr(),
                                              x.shape[0], y.data_ptr(), mode)
        else:
            failed = self.lib.spk_linear(self.qtype, self.ptr, self.out_features, self.in_features, x.data_ptr(), x.shape[0], y.data_ptr())
        if failed:
            raise RuntimeError(f"native linear refused a {x.shape[0]}x{self.in_features} input")
        return y if self.bias is None else y + self.bias


class DenseLinear:
    """y = x @ W.T (+ b) with W dequantized once to bf16, computed in fixed 16-row tiles."""

    def __init__(self, info, bias):
        self.weight = dequantize(info.data, info.qtype, info.shape, dtype=torch.bfloat16)
        self.bias = bias
        self.out_features = info.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _fixed_tiles(lambda a: F.linear(a, self.weight), x.to(torch.bfloat16)).float()
        return y if self.bias is None else y + self.bias


def _source(data: np.ndarray) -> tuple[int, int]:
    """Where a tensor's bytes are (address, size): the same table loaded twice is the same key."""
    return data.__array_interface__["data"][0], data.nbytes


class QuantEmbedding:
    """Token embedding lookup that reads rows straight from the file's memory map (or from the
    output head's copy of the same table, where the model ties them) and dequantizes only the
    rows used: the table never becomes resident memory of its own."""

    def __init__(self, info, copy: np.ndarray | None = None):
        # a read-only view into the mapping, which it keeps open, or the head's copy
        self.raw = info.data if copy is None else copy
        self.qtype, self.shape = info.qtype, info.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.raw, self.qtype, self.shape, ids)


log = get_logger(__name__)
_warned: set[str] = set()
# Plain decoding with torch's kernels against the native ones: the 1.5B Q4_K_M on 2 threads,
# 3.1-3.8 tok/s against 18.0 (AVX2) and 19.7 (AVX-512) (docs/benchmarks.md, "AVX2 path").
TORCH_DECODE_SLOWDOWN = 5


def _warn_once(message: str, level: str = "warning", **fields) -> None:
    if message not in _warned:
        _warned.add(message)
        getattr(log, level)(message, **fields)


class CpuBackend:
    name = "cpu"
    device = torch.device("cpu")
    kv_dtype = torch.float32

    def __init__(self, threads: int | None = None, use_native: bool | None = None):
        threads = threads or int(os.environ.get("SPECULANT_THREADS", "0")) or os.cpu_count() or 1
        self.threads = threads
        chosen = use_native is not None  # by the caller (tests); else by SPECULANT_NATIVE and the CPU
        if use_native is None:
            use_native = os.environ.get("SPECULANT_NATIVE", "1") != "0"
        self.native = native.load() if use_native else None
        if self.native is not None:
            self.rms_norm, self.apply_rope = self._native_rms_norm, self._native_apply_rope
            self.gated_delta_net = self._native_gated_delta_net
        self._gelu_table: torch.Tensor | None = None
        self.row_kinds: np.ndarray | None = None  # set inside `batch`: how each row is computed
        self.row_kinds_ptr: int | None = None
        self._modes: dict[int, int | None] = {}
        self._copies: dict[tuple[int, int], np.ndarray] = {}  # huge-page copies by their source bytes
        if self.native is None and not chosen:
            # one line at start-up: which kernels, why, and what it costs
            _warn_once(f"using torch's CPU kernels: decoding is about {TORCH_DECODE_SLOWDOWN}x slower than with the native ones",
                       level="warning" if use_native else "info",
                       reason=native.why_unavailable() if use_native else "SPECULANT_NATIVE=0")
        elif self.native is not None:
            _warn_once("native CPU kernels", level="debug", isa=native.isa_of(self.native))
        # An fp16 cache, as llama.cpp keeps by default: half the memory, and its rounding.
        self.kv_dtype = torch.float16 if self.native is not None else torch.float32
        if self.native is not None:
            # The native kernels bring their own threads; torch keeps one, for the small ops
            # between matmuls, so its idle workers do not compete with ours for the cores.
            self.native.spk_set_threads(threads)
            torch.set_num_threads(1)
        else:
            torch.set_num_threads(threads)

    def linear(self, weight, bias=None):
        b = None if bias is None else self.tensor(bias)
        rows, cols = weight.shape
        if self.native is not None and self.native.spk_supports(int(weight.qtype), cols):
            out = NativeLinear(self, self.native, weight, b)
            if not out.uses_mapping:
                self._copies[_source(weight.data)] = out.raw
            return out
        if weight.qtype in INT4_TYPES and cols % GROUP == 0 and rows % 16 == 0:  # the pack's own constraints
            return Int4Linear(weight, b)
        return DenseLinear(weight, b)

    def argmax_head(self, head):
        """The screened form of an output head (screen.py) for greedy rows, or None where it
        would not pay (or SPECULANT_SCREEN=0). Called once, at load; the copy is built or read
        from the cache in a thread started by the first greedy call."""
        if not isinstance(head, NativeLinear) or not screen.enabled() or not screen.ScreenedHead.worth_it(head):
            return None
        return screen.ScreenedHead(head)

    @contextlib.contextmanager
    def batch(self, batch, prompt: bool = True):
        """A forward's layers run inside this scope: it says how each row's linear layers are
        computed (spk_linear_prompt), by `row_classes`. Which applies to a row follows from its
        position and its sequence's prompt length alone, so plain decoding and speculation compute
        every row the same way. `prompt=False`: every row as a decode row (llama.cpp's last layer
        computes its FFN for the rows that want logits only). Scopes nest: the previous marking
        comes back when an inner scope ends."""
        kinds = self.row_classes(batch.positions, batch.prompt_lens or (0,) * len(batch), prompt)
        if kinds is not None and not kinds.any():
            kinds = None
        outer = self.row_kinds, self.row_kinds_ptr, self._modes
        self.row_kinds = kinds
        self.row_kinds_ptr = kinds.ctypes.data if kinds is not None else None
        self._modes = {}
        if kinds is not None:  # per type: the one mode of every row, or None where they differ
            for qtype, modes in ((int(Q.Q4_K), kinds & 1), (int(Q.Q6_K), np.where(kinds & 2, 1, np.where(kinds & 4, 2, 0)))):
                self._modes[qtype] = int(modes[0]) if (modes == modes[0]).all() else None
        try:
            yield
        finally:
            self.row_kinds, self.row_kinds_ptr, self._modes = outer

    def row_classes(self, positions, prompt_lens, prompt: bool = True) -> np.ndarray | None:
        """How each row is computed (spk_linear_prompt's kinds), from its position and its
        sequence's prompt length alone; None without the native library (every row alike).

        - A prompt shorter than LLAMA_FA_TILE_Q is one llama.cpp batch of under 64 rows: its rows
          take llama.cpp's prompt arithmetic (Q4_K's gemm for the rows filling whole groups of
          four, Q6_K's tiled matmul from eight rows), its decode rows llama.cpp's decode
          arithmetic up to LLAMA_SPLIT_KV, and the kernels llama.cpp cannot be matched with past it.
        - A sequence whose prompt is LLAMA_FA_TILE_Q tokens or longer cannot come out as
          llama.cpp's anyway (its prompt attention is llama.cpp's tiled path), so all its rows,
          prompt and decode, take the fast kernels (kind 4). That makes a row's kind the same
          whether it was computed as a prompt row or a decode row, which is what lets the next
          request reuse the rows a previous one generated (the prompt cache) and still compute
          exactly what a cold start computes."""
        if self.native is None:
            return None
        kinds = np.empty(len(positions), np.uint8)
        for i, (p, n) in enumerate(zip(positions, prompt_lens)):
            if n >= LLAMA_FA_TILE_Q or p >= LLAMA_SPLIT_KV:
                kinds[i] = 4
            elif prompt and p < n:
                kinds[i] = int(p < n // 4 * 4) | 2 * int(n >= 8)
            else:
                kinds[i] = 0
        return kinds

    def row_mode(self, qtype: int, rows: int) -> int | None:
        """The kernel mode of spk_linear_mode for a call of `rows` rows inside the current `batch`
        scope: 0 (llama.cpp's decode arithmetic) outside one or for rows another matrix
        (the output head takes only the rows that want logits), None where its rows differ."""
        if self.row_kinds is None or rows != len(self.row_kinds):
            return 0
        return self._modes.get(qtype, 0)

    # With the native library, the element-wise pieces below are llama.cpp's CPU arithmetic bit for
    # bit (elementwise.cpp), like the linear layers and attention: a forward's logits are then
    # llama.cpp's, and greedy output follows it even where two tokens are close.

    def gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """tanh-GELU; natively as llama.cpp evaluates it, from a table of every fp16 input's result
        rounded to fp16 (x itself from 10 up, 0 from -10 down)."""
        if self.native is None:
            return F.gelu(x, approximate="tanh")
        if self._gelu_table is None:
            table = np.zeros(65536, np.uint16)
            self.native.spk_gelu_table(table.ctypes.data)
            self._gelu_table = torch.from_numpy(table.view(np.float16).astype(np.float32))
        y = self._gelu_table[x.half().view(torch.int16).long() & 0xFFFF]
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up; natively with ggml's vector exp approximation."""
        if self.native is None:
            return F.silu(gate) * up
        # rows of one stride (the halves of a joined gate/up product) are read in place
        if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.stride(0) != up.stride(0):
            gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty(gate.shape, dtype=torch.float32)
        ld = gate.stride(0) if gate.dim() == 2 else gate.shape[-1]
        self.native.spk_swiglu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel() // gate.shape[-1], gate.shape[-1], ld)
        return out

    def _native_gated_delta_net(self, state, q, k, v, decay, beta, scale, per_row=None):
        """The DeltaNet recurrence in one native call (ggml's dot-product order, its FMAs), heads
        in parallel; see BackendKernels.gated_delta_net."""
        n, hv, dk = q.shape
        dv = v.shape[-1]
        q, k, v = q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
        decay, beta = decay.float().contiguous(), beta.float().contiguous()
        if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != (hv, dv, dk):
            raise ValueError(f"gated_delta_net: state must be a contiguous float32 [{hv}, {dv}, {dk}] tensor")
        if per_row is not None and (not per_row.is_contiguous() or tuple(per_row.shape) != (n, hv, dv, dk)):
            raise ValueError(f"gated_delta_net: per_row must be a contiguous [{n}, {hv}, {dv}, {dk}] tensor")
        out = torch.empty(n, hv, dv, dtype=torch.float32)
        self.native.spk_gated_delta_net(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(),
                                        beta.data_ptr(), n, hv, dv, dk, scale, out.data_ptr(),
                                        0 if per_row is None else per_row.data_ptr())
        return out

    # rms_norm and apply_rope are offered only with the native library (set in __init__); without
    # it the architectures' own torch versions, which do the same arithmetic, take over.

    def _native_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm times the weight over the last dimension in one native call (the sum of squares
        in double, in order, as llama.cpp sums it)."""
        x = x.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        self.native.spk_rms_norm(x.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
        return out

    def _native_apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
        """Rotate x [rows, heads, head_dim] in place, with llama.cpp's FMAs."""
        x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        self.native.spk_rope_apply(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2], int(neox))
        return x

    def rope_tables(self, positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0):
        """cos, sin [rows, head_dim / 2]; natively with the angle chained in float and libm's
        cosf/sinf, as llama.cpp builds them."""
        if self.native is None:  # angles in float64, rounded once
            inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
            return angles.cos().float(), angles.sin().float()
        pos = positions.to(torch.int64).contiguous()
        cos = torch.empty(len(pos), head_dim // 2)
        sin = torch.empty(len(pos), head_dim // 2)
        self.native.spk_rope_table(pos.data_ptr(), len(pos), head_dim, base, 1.0 / scale, cos.data_ptr(), sin.data_ptr())
        return cos, sin

    def fused_layer(self, spec):
        """The layer as one native call (fused.py), where the native kernels take all of it."""
        return fused.fused_layer(self, spec, NativeLinear, LLAMA_SPLIT_KV)

    def embedding(self, weight):
        # A table the output head reads too (tied embeddings) is looked up in the head's copy:
        # the loader released its pages in the file's map, and lookups there would fault them
        # back in, up to the whole table again over a long session.
        return QuantEmbedding(weight, self._copies.get(_source(weight.data)))

    def tensor(self, weight) -> torch.Tensor:
        return dequantize(weight.data, weight.qtype, weight.shape)

    def attention(self, q, k, v, positions, scale, window=0):
        """Every row on its own: the row at position p sees exactly keys 0..p (the last `window`),
        whatever else is in the batch, so a row's result is the same in a prompt chunk of any
        size, in plain decoding and in verification. That is what keeps speculation exact, and
        what lets a prompt continue from cached rows with a cold start's bits (the prompt cache)."""
        n_rows, n_head, head_dim = q.shape
        n_kv = k.shape[0]
        group = n_head // n_kv
        if k.dtype == torch.float16 and self.native is not None:
            q = q.to(torch.float32).contiguous()
            out = torch.empty(n_rows, n_head, v.shape[-1])
            pos = positions.to(torch.int64).contiguous()
            if self.native.spk_attention_f16(q.data_ptr(), n_rows, n_head, n_kv, head_dim, v.shape[-1], k.data_ptr(),
                                             v.data_ptr(), k.stride(0), v.stride(0), pos.data_ptr(), window, scale,
                                             out.data_ptr(), 1, LLAMA_SPLIT_KV) == 0:
                return out
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = []
        for i, p in enumerate(positions.tolist()):
            lo = max(0, p + 1 - window) if window else 0
            qi = q[i].view(n_kv, group, head_dim)  # the heads sharing a kv head are its query rows
            out.append(F.scaled_dot_product_attention(qi, k[:, lo : p + 1], v[:, lo : p + 1], scale=scale))
        return torch.stack(out).view(n_rows, n_head, -1)
