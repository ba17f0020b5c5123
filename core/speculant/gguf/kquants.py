"""Round-to-nearest K-quant quantization (Q2_K..Q6_K) of float arrays, which gguf-py's
`gguf.quants.quantize` does not do. Not llama.cpp's error-minimizing search: valid blocks (finite
fp16 scales) that dequantize back to approximately the input. The tiny test models are written
with it, and the CPU backend's screened output head (speculant_cpu.screen) requantizes a head
with it."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b == 0 (all-zero sub-blocks)."""
    nz = b != 0
    return np.where(nz, a / np.where(nz, b, 1), 0).astype(np.float32)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes as (n, 2) uint8, the fp16 value back in float32 shaped (n, 1))."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32).reshape(-1, 1)


def _pack(vals: np.ndarray, groups: int, bits: int) -> np.ndarray:
    """Pack `vals` (n, ..., groups, m) of `bits`-bit fields: field k of byte j is vals[..., k, j]."""
    out = np.zeros(vals.shape[:-2] + vals.shape[-1:], dtype=np.uint8)
    for k in range(groups):
        out |= (vals[..., k, :].astype(np.uint8) << np.uint8(bits * k)).astype(np.uint8)
    return out.reshape(vals.shape[0], -1)


def _min_scale(sub: np.ndarray, nmax: int, scale_max: int):
    """Asymmetric sub-block scales: x ~= d*sc*q - dmin*m with q in [0, nmax], sc/m in [0, scale_max]."""
    mn = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - mn) / nmax
    d_bytes, d = _fp16(scale.max(-1) / scale_max)
    dmin_bytes, dmin = _fp16((-mn).max(-1) / scale_max)
    sc = np.clip(np.round(_div(scale, d)), 0, scale_max).astype(np.uint8)
    m = np.clip(np.round(_div(-mn, dmin)), 0, scale_max).astype(np.uint8)
    eff = (d * sc.astype(np.float32))[..., None]
    off = (dmin * m.astype(np.float32))[..., None]
    q = np.clip(np.round(_div(sub + off, eff)), 0, nmax).astype(np.uint8)
    return q, sc, m, d_bytes, dmin_bytes


def _k_scales_12(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins into Q4_K/Q5_K's 12 bytes."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    q, sc, m, d, dmin = _min_scale(blocks.reshape(n, 16, 16), 3, 15)
    scales = sc | (m << 4)
    qs = _pack(q.reshape(n, 2, 4, 32), 4, 2)
    return np.concatenate([scales, qs, d, dmin], axis=1)


def _quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 3
    d_bytes, d = _fp16(scale.max(-1) / 31)
    sc = np.clip(np.round(_div(scale, d)), 0, 31)
    eff = (d * sc)[..., None]
    u = (np.clip(np.round(_div(sub, eff)), -4, 3) + 4).astype(np.uint8).reshape(n, 256)
    hmask = _pack((u >> 2).reshape(n, 8, 32), 8, 1)
    qs = _pack((u & 3).reshape(n, 2, 4, 32), 4, 2)
    t = (sc + 32).astype(np.uint8)  # stored as scale + 32 in 6 bits
    low = (t[:, :8] & 0x0F) | ((t[:, 8:] & 0x0F) << 4)
    high = _pack((t >> 4).reshape(n, 4, 4), 4, 2)
    return np.concatenate([hmask, qs, low, high, d_bytes], axis=1)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    q, sc, m, d, dmin = _min_scale(blocks.reshape(n, 8, 32), 15, 63)
    qs = _pack(q.reshape(n, 4, 2, 32), 2, 4)
    return np.concatenate([d, dmin, _k_scales_12(sc, m), qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    q, sc, m, d, dmin = _min_scale(blocks.reshape(n, 8, 32), 31, 63)
    q = q.reshape(n, 256)
    qh = _pack((q >> 4).reshape(n, 8, 32), 8, 1)
    qs = _pack((q & 0x0F).reshape(n, 4, 2, 32), 2, 4)
    return np.concatenate([d, dmin, _k_scales_12(sc, m), qh, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _fp16(scale.max(-1) / 127)
    sc = np.clip(np.round(_div(scale, d)), 0, 127).astype(np.int8)
    eff = (d * sc.astype(np.float32))[..., None]
    u = (np.clip(np.round(_div(sub, eff)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql = _pack((u & 0x0F).reshape(n, 2, 2, 64), 2, 4)
    qh = _pack((u >> 4).reshape(n, 2, 4, 32), 4, 2)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


_K_QUANTIZERS = {
    GGMLQuantizationType.Q2_K: _quantize_q2_k, GGMLQuantizationType.Q3_K: _quantize_q3_k,
    GGMLQuantizationType.Q4_K: _quantize_q4_k, GGMLQuantizationType.Q5_K: _quantize_q5_k,
    GGMLQuantizationType.Q6_K: _quantize_q6_k,
}


def quantize_k(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Round-to-nearest K-quant (Q2_K..Q6_K) of a float array whose last dim is a multiple of 256.
    Returns uint8 of shape (*data.shape[:-1], row_bytes)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _K_QUANTIZERS:
        raise ValueError(f"{qtype.name} is not a K-quant")
    data = np.asarray(data, dtype=np.float32)
    if data.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {QK_K}, got {data.shape[-1]}")
    if not np.isfinite(data).all():
        raise ValueError("cannot quantize non-finite values")
    blocks = _K_QUANTIZERS[qtype](data.reshape(-1, QK_K))
    return blocks.reshape(*data.shape[:-1], -1)
