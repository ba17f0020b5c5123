"""Dequantize GGUF tensors with vectorized PyTorch ops.

Results equal gguf-py's reference `gguf.quants.dequantize` bit for bit: every type below
replays the reference's float32 operations in the same order (e.g. Q4_K is `(d*sc)*q - dmin*m`,
not `d*(sc*q)`), and all integer unpacking is exact, so nothing depends on rounding luck.
One exception, irrelevant for weights: F16 signalling NaNs come out as quiet NaNs (torch's
half->float conversion sets the quiet bit; numpy keeps the payload as is).

Block layouts (bytes, in file order; "f16" is one IEEE half; K-quants hold 256 values, the rest 32):

    Q8_0  f16 d | int8 q[32]                                   w = q*d
    Q4_0  f16 d | q[16] nibbles (low: values 0-15, high: 16-31)   w = (q-8)*d
    Q4_1  f16 d | f16 m | q[16] nibbles                         w = d*q + m
    Q5_0  f16 d | qh u32 (bit i = 5th bit of value i) | q[16]    w = (q-16)*d
    Q5_1  f16 d | f16 m | qh u32 | q[16]                        w = d*q + m
    Q2_K  sc[16] (low nibble scale, high min) | q[64] 2-bit | f16 d | f16 dmin
    Q3_K  hmask[32] | q[64] 2-bit | 6-bit scales packed in 12 bytes | f16 d
    Q4_K  f16 d | f16 dmin | 8 6-bit scales + 8 6-bit mins in 12 bytes | q[128] nibbles
    Q5_K  like Q4_K, plus qh[32] (5th bits) between the scales and the nibbles
    Q6_K  ql[128] nibbles | qh[64] 2-bit | int8 scales[16] | f16 d

Memory: the output is allocated once and filled a chunk of blocks at a time, so the integer
intermediates (uint8/int8 only, never int64) stay a few MB even for a 150k x 1536 embedding.
Raw numpy memmaps are wrapped without copying; only the bytes of the current chunk get read.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from speculant.errors import ModelFileError

__all__ = [
    "SUPPORTED_TYPES", "dequantize", "dequantize_rows", "unpack_q4_groups", "as_bytes",
    "row_nbytes", "fp16_field", "unpack_nibbles", "unpack_crumbs", "unpack_bits", "k_scale_min",
]

# Output elements per chunk: large enough that Python overhead per chunk is negligible,
# small enough that the uint8/float temporaries of one chunk stay cache-friendly.
CHUNK_ELEMENTS = 1 << 20


# ---------------------------------------------------------------- raw bytes

def as_bytes(raw) -> torch.Tensor:
    """The raw tensor data as a flat uint8 torch tensor, without copying.

    Accepts numpy arrays (including read-only memmaps, and float arrays as gguf-py gives
    F32/F16 tensors) and torch tensors. The result may share memory with a read-only mapping:
    callers must never write to it (nothing in this module does).
    """
    if isinstance(raw, torch.Tensor):
        t = raw.detach().contiguous()
        return t.view(torch.uint8).reshape(-1) if t.dtype != torch.uint8 else t.reshape(-1)
    arr = np.ascontiguousarray(raw)
    arr = arr.reshape(-1).view(np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # torch warns about every non-writable array; we only ever read from it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def row_nbytes(qtype: Q, cols: int) -> int:
    """Bytes one row of `cols` values takes in the file."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return cols // block * type_size


# ---------------------------------------------------------------- unpacking helpers

def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at byte `offset` of every block, as float32 [n, 1] (exact conversion).

    Viewing a 2-byte slice as float16 needs no copy: all block sizes are even.
    """
    return blocks[:, offset:offset + 2].view(torch.float16).float()


def _unpack(x: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., m] -> [..., 8 // width, m]: field i holds bits [i*width, (i+1)*width) of each byte.

    One scalar shift and one scalar mask per field, written straight into the result: scalar
    ops on uint8 vectorize well, whereas a broadcast shift by a tensor of shifts is ~3x slower.
    """
    k = 8 // width
    out = x.new_empty((*x.shape[:-1], k, x.shape[-1]))
    for i in range(k):
        field = out.select(-2, i)
        if i:
            torch.bitwise_right_shift(x, i * width, out=field)
        else:
            field.copy_(x)
        if i < k - 1:  # the top field has nothing above it to mask off
            field.bitwise_and_((1 << width) - 1)
    return out


def unpack_nibbles(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> [..., 2, m]: all low nibbles, then all high nibbles (ggml's order)."""
    return _unpack(x, 4)


def unpack_crumbs(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> [..., 4, m]: 2-bit fields at shifts 0, 2, 4, 6."""
    return _unpack(x, 2)


def unpack_bits(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> [..., 8, m]: bit b of every byte, b = 0..7."""
    return _unpack(x, 1)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 packed bytes [n, 12] -> 6-bit (scales, mins), uint8 [n, 8] each.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for mins; bytes 8-11 the low 4 bits of scale 4-7 (low nibble) and min 4-7 (high).
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: the little-endian u32 qh [n, 4 bytes] -> bit i of value i, uint8 [n, 32]."""
    return unpack_bits(qh.unsqueeze(-1)).reshape(qh.shape[0], 32)


# ---------------------------------------------------------------- block kernels
# Each kernel reads uint8 blocks [n, type_size] and fills float32 out [n, block_size].

def _affine(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minus=None, plus=None) -> None:
    """out = scale * q (- minus | + plus), rounding after each op exactly as the reference does.

    q (uint8/int8) is converted into `out` first and scaled in place: a mixed-dtype torch.mul
    would allocate a float temporary for q anyway. Multiplication commutes, so q*scale == scale*q.
    """
    out.copy_(q)
    out.mul_(scale)
    if minus is not None:
        out.sub_(minus)
    if plus is not None:
        out.add_(plus)


def _f32(b, out):
    out.copy_(b.view(torch.float32))


def _f16(b, out):
    out.copy_(b.view(torch.float16))


def _bf16(b, out):
    out.copy_(b.view(torch.bfloat16))  # bf16 -> f32 is a 16-bit shift, as in the reference


def _q8_0(b, out):
    _affine(out, b[:, 2:].view(torch.int8), fp16_field(b, 0))


def _q4_0_quants(b):
    return unpack_nibbles(b[:, 2:18]).view(-1, 32)


def _q4_0(b, out):
    _affine(out, _q4_0_quants(b).view(torch.int8).sub_(8), fp16_field(b, 0))


def _q4_1_quants(b):
    return unpack_nibbles(b[:, 4:20]).view(-1, 32)


def _q4_1(b, out):
    _affine(out, _q4_1_quants(b), fp16_field(b, 0), plus=fp16_field(b, 2))


def _q5_quants(b, qh_at):
    """Q5_0/Q5_1 5-bit values [n, 32]: nibbles, plus bit i of the little-endian u32 qh as bit 4."""
    q = unpack_nibbles(b[:, qh_at + 4:qh_at + 20]).view(-1, 32)
    high = unpack_bits(b[:, qh_at:qh_at + 4].unsqueeze(-1)).view(-1, 32)  # byte-major: bit i = byte i//8, bit i%8
    return q.bitwise_or_(high.bitwise_left_shift_(4))


def _q5_0(b, out):
    _affine(out, _q5_quants(b, 2).view(torch.int8).sub_(16), fp16_field(b, 0))


def _q5_1(b, out):
    _affine(out, _q5_quants(b, 4), fp16_field(b, 0), plus=fp16_field(b, 2))


def _q2_k(b, out):
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = fp16_field(b, 80) * (sc & 0x0F)
    ml = fp16_field(b, 82) * (sc >> 4)
    q = unpack_crumbs(b[:, 16:80].view(n, 2, 32)).view(n, 16, 16)
    _affine(out.view(n, 16, 16), q, dl.unsqueeze(-1), minus=ml.unsqueeze(-1))


def _q3_k(b, out):
    n = b.shape[0]
    sc = b[:, 96:108]
    low = unpack_nibbles(sc[:, 0:8]).view(n, 16)
    high = unpack_crumbs(sc[:, 8:12]).view(n, 16)
    scale = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    dl = fp16_field(b, 108) * scale
    # A *clear* high bit subtracts 4: q = low2 - 4 * (1 - hbit), in -4..3.
    q = unpack_crumbs(b[:, 32:96].view(n, 2, 32)).view(n, 256).view(torch.int8)
    hm = unpack_bits(b[:, 0:32]).view(n, 256)
    q.sub_(hm.bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8))
    _affine(out.view(n, 16, 16), q.view(n, 16, 16), dl.unsqueeze(-1))


def _q4_k_scales(b):
    """Q4_K/Q5_K per-32-group float32 (scale, min) [n, 8], rounded exactly as the reference does."""
    sc, mn = k_scale_min(b[:, 4:16])
    return fp16_field(b, 0) * sc, fp16_field(b, 2) * mn


def _q4_k_quants(b):
    n = b.shape[0]
    return unpack_nibbles(b[:, 16:144].view(n, 4, 32)).view(n, 8, 32)


def _q4_k(b, out):
    n = b.shape[0]
    scale, mn = _q4_k_scales(b)
    _affine(out.view(n, 8, 32), _q4_k_quants(b), scale.unsqueeze(-1), minus=mn.unsqueeze(-1))


def _q5_k(b, out):
    n = b.shape[0]
    scale, mn = _q4_k_scales(b)
    q = unpack_nibbles(b[:, 48:176].view(n, 4, 32)).view(n, 8, 32)
    q.bitwise_or_(unpack_bits(b[:, 16:48]).bitwise_left_shift_(4))
    _affine(out.view(n, 8, 32), q, scale.unsqueeze(-1), minus=mn.unsqueeze(-1))


def _q6_k(b, out):
    n = b.shape[0]
    scale = fp16_field(b, 208) * b[:, 192:208].view(torch.int8)
    q = unpack_nibbles(b[:, 0:128].view(n, 2, 64)).view(n, 256)
    q.bitwise_or_(unpack_crumbs(b[:, 128:192].view(n, 2, 32)).view(n, 256).bitwise_left_shift_(4))
    q = q.view(torch.int8).sub_(32)
    _affine(out.view(n, 16, 16), q.view(n, 16, 16), scale.unsqueeze(-1))


_KERNELS: dict[Q, Callable[[torch.Tensor, torch.Tensor], None]] = {
    Q.F32: _f32, Q.F16: _f16, Q.BF16: _bf16,
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[Q] = frozenset(_KERNELS)


# ---------------------------------------------------------------- public API

def _check(raw, qtype: Q, shape: tuple[int, ...]) -> tuple[torch.Tensor, int, int, int, int]:
    """Validate; return (flat bytes, block size, type size, rows, cols)."""
    qtype = Q(qtype)
    if qtype not in _KERNELS:
        names = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))
        raise ModelFileError(f"tensor type {qtype.name} is not supported (supported: {names})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    cols = shape[-1] if shape else 1
    n = math.prod(shape)
    if cols % block:
        raise ModelFileError(f"tensor of shape {shape}: row length {cols} is not a multiple of the {qtype.name} block size {block}")
    data = as_bytes(raw)
    if data.numel() != n // block * type_size:
        raise ModelFileError(f"{qtype.name} tensor of shape {shape} needs {n // block * type_size} bytes, got {data.numel()}")
    return data, block, type_size, (n // cols if cols else 0), cols


def _run(kernel, blocks: torch.Tensor, out_blocks: torch.Tensor, block: int) -> None:
    step = max(1, CHUNK_ELEMENTS // block)
    # Kernels compute in float32; a narrower output gets each chunk rounded into it, so a
    # bf16 weight never needs a full-size float32 copy.
    tmp = None if out_blocks.dtype == torch.float32 else torch.empty(min(step, blocks.shape[0]), block)
    for i in range(0, blocks.shape[0], step):
        if tmp is None:
            kernel(blocks[i:i + step], out_blocks[i:i + step])
        else:
            n = min(step, blocks.shape[0] - i)
            kernel(blocks[i:i + n], tmp[:n])
            out_blocks[i:i + n] = tmp[:n]


def dequantize(raw, qtype: Q, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole tensor as `dtype` (float32 by default, exact) of `shape` (PyTorch order, last dim
    fastest); always a new tensor. Other dtypes are rounded from float32 chunk by chunk."""
    data, block, type_size, _, _ = _check(raw, qtype, shape)
    out = torch.empty(tuple(shape), dtype=dtype)
    _run(_KERNELS[Q(qtype)], data.view(-1, type_size), out.view(-1, block), block)
    return out


def dequantize_rows(raw, qtype: Q, shape: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a 2-D tensor as float32 [*rows.shape, cols], reading only those rows' bytes.

    For embedding lookup in a quantized token_embd: 16 rows of a 150k-row table cost microseconds.
    """
    data, block, type_size, n_rows, cols = _check(raw, qtype, shape)
    rows = torch.as_tensor(rows, dtype=torch.long)
    picked = data.view(n_rows, -1).index_select(0, rows.reshape(-1))
    out = torch.empty((picked.shape[0], cols), dtype=torch.float32)
    _run(_KERNELS[Q(qtype)], picked.view(-1, type_size), out.view(-1, block), block)
    return out.view(*rows.shape, cols)


# Per-block (4-bit quants [n, block], scale [n, groups], offset [n, groups]) for unpack_q4_groups.
def _q4_0_groups(b):
    d = fp16_field(b, 0)
    return _q4_0_quants(b), d, d * -8.0


def _q4_1_groups(b):
    return _q4_1_quants(b), fp16_field(b, 0), fp16_field(b, 2)


def _q4_k_groups(b):
    scale, mn = _q4_k_scales(b)
    return _q4_k_quants(b).view(-1, 256), scale, mn.neg_()


_Q4_GROUPS = {Q.Q4_0: _q4_0_groups, Q.Q4_1: _q4_1_groups, Q.Q4_K: _q4_k_groups}


def unpack_q4_groups(raw, qtype: Q, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1/Q4_K as 4-bit quants plus an affine map per group of 32 values along a row.

    Returns q uint8 [rows, cols] (0..15), scale and offset float32 [rows, cols // 32] with
    `q * scale + offset` (float32, per group) equal to the reference dequantization, whether
    computed as mul-then-add or as one fused multiply-add: q*scale is always exact (an 11-bit
    f16 mantissa times a <=6-bit scale times a 4-bit q fits in float32's 24 bits), so the add
    is the only rounding, as in the reference. Per type:
      Q4_1: scale = d, offset = m                bitwise equal
      Q4_K: scale = d*sc, offset = -(dmin*m)     bitwise equal (x + -y is x - y in IEEE)
      Q4_0: scale = d, offset = -8*d             equal in value; all ops are exact, but where
            q == 8 and d < 0 the reference's d*(q-8) is -0.0 and 8d + -8d is +0.0. Max abs
            difference 0; only the sign of those zeros differs.
    For torch's int4 packed kernels, which compute (q - 8) * scale + zero, use
    zero = offset + 8 * scale: exact for Q4_0 (zero = 0), one rounding for Q4_1/Q4_K.
    """
    qtype = Q(qtype)
    if qtype not in _Q4_GROUPS:
        raise ModelFileError(f"unpack_q4_groups: tensor type {qtype.name} is not a 4-bit type (Q4_0, Q4_1, Q4_K)")
    data, block, type_size, n_rows, cols = _check(raw, qtype, shape)
    blocks = data.view(-1, type_size)
    n_blocks, groups = blocks.shape[0], block // 32
    q = torch.empty((n_blocks, block), dtype=torch.uint8)
    scale = torch.empty((n_blocks, groups), dtype=torch.float32)
    offset = torch.empty((n_blocks, groups), dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // block)
    for i in range(0, n_blocks, step):
        qi, si, oi = _Q4_GROUPS[qtype](blocks[i:i + step])
        q[i:i + step].copy_(qi)
        scale[i:i + step].copy_(si)
        offset[i:i + step].copy_(oi)
    return q.view(n_rows, cols), scale.view(n_rows, cols // 32), offset.view(n_rows, cols // 32)
