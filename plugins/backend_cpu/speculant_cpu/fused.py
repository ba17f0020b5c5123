"""A llama-family decoder layer as one native call (spk_llama_layer in native/layer.cpp).

The layer runs the same native kernels in the same order as the architecture's piece-by-piece
forward through this backend, so its bits are the same; what goes is the Python and torch around
some fifteen calls a layer. The structures mirror spk.h field for field (every field 8 bytes).
"""
from __future__ import annotations

import ctypes

import torch

from speculant import DecoderLayerSpec, LayerRows

MAX_HEAD_DIM = 1024  # attention.cpp's


class SpkMatrix(ctypes.Structure):
    _fields_ = [("qtype", ctypes.c_int64), ("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class SpkLlamaLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("d", "n_head", "n_kv", "head_dim", "n_ff", "neox")] + [
        ("eps", ctypes.c_double), ("attn_scale", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("attn_norm", "ffn_norm", "bq", "bk", "bv")] + [
        (name, SpkMatrix) for name in ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")]


class SpkRowGroup(ctypes.Structure):
    _fields_ = [("first", ctypes.c_int64), ("end", ctypes.c_int64), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_head_stride", ctypes.c_int64), ("v_head_stride", ctypes.c_int64)]


class SpkLayerCall(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("cos_t", "sin_t", "positions", "kinds", "groups")] + [
        (name, ctypes.c_int64) for name in ("n_groups", "window", "exact_below")]


def _matrix(linear) -> SpkMatrix:
    return SpkMatrix(linear.qtype, linear.ptr, linear.out_features, linear.in_features)


class FusedLlamaLayer:
    """spec's layer bound to its weights: call with (x, rows) inside the backend's batch scope.
    Rows from position `exact_below` on take the attention's fp32 path (backend.LLAMA_SPLIT_KV)."""

    def __init__(self, backend, spec: DecoderLayerSpec, exact_below: int):
        self.backend, self.lib, self.spec, self.exact_below = backend, backend.native, spec, exact_below
        self.d = spec.wq.in_features
        bias = [lin.bias for lin in (spec.wq, spec.wk, spec.wv)]
        # the weights the structure points at stay alive with this object
        self._keep = [t.contiguous().float() for t in (spec.attn_norm, spec.ffn_norm)] + [
            None if b is None else b.contiguous().float() for b in bias]
        an, fn, bq, bk, bv = (None if t is None else t.data_ptr() for t in self._keep)
        self.layer = SpkLlamaLayer(self.d, spec.n_head, spec.n_kv_head, spec.head_dim, spec.n_ff, int(spec.neox),
                                   spec.eps, spec.scale, an, fn, bq, bk, bv,
                                   *(_matrix(m) for m in (spec.wq, spec.wk, spec.wv, spec.wo, spec.w_gate_up, spec.w_down)))

    def __call__(self, x: torch.Tensor, rows: LayerRows) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        groups = (SpkRowGroup * len(rows.groups))(*(
            SpkRowGroup(a, b, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)) for a, b, k, v in rows.groups))
        kinds = self.backend.row_kinds_ptr
        call = SpkLayerCall(rows.cos.data_ptr(), rows.sin.data_ptr(), rows.positions.data_ptr(), kinds,
                            ctypes.addressof(groups), len(rows.groups), self.spec.window, self.exact_below)
        if self.lib.spk_llama_layer(ctypes.addressof(self.layer), ctypes.addressof(call), x.data_ptr(), out.data_ptr(), x.shape[0]):
            raise RuntimeError(f"the native layer refused a {x.shape[0]}x{self.d} input")
        return out


def fused_layer(backend, spec: DecoderLayerSpec, native_linear: type, exact_below: int) -> FusedLlamaLayer | None:
    """The layer as one native call where every piece can take it: the native library, its
    linear kernels for all six matrices, an fp16 cache and head sizes the attention kernel has."""
    linears = (spec.wq, spec.wk, spec.wv, spec.wo, spec.w_gate_up, spec.w_down)
    if backend.native is None or backend.kv_dtype != torch.float16 or spec.head_dim > MAX_HEAD_DIM:
        return None
    if not all(isinstance(m, native_linear) for m in linears) or spec.wo.bias is not None or spec.w_gate_up.bias is not None \
            or spec.w_down.bias is not None or spec.w_gate_up.out_features != 2 * spec.n_ff:
        return None
    return FusedLlamaLayer(backend, spec, exact_below)
