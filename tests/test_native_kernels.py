"""The native fused kernels (speculant_cpu.native) against a float64 reference.

The reference quantizes the activations the way llama.cpp does (Q8_K for the K-quants, Q8_0
otherwise) and multiplies with the dequantized weights in float64, so the only difference left
is float32 rounding of the kernel's accumulation. Each row must also come out bit-identical
however many rows are computed with it.

Every test here runs once per instruction set this CPU can run (native.available_isas(): on an
AVX-512 box the AVX-512 kernels, and the AVX2 ones with and without AVX-VNNI), each against the
same references; tests/test_native_isa.py compares the ISAs' results with each other."""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from speculant.gguf.quants import dequantize
from speculant.testing.tiny_gguf import quantize
from speculant_cpu import native

ISAS = native.available_isas() or [None]
with ThreadPoolExecutor(len(ISAS)) as _pool:  # first use: the ISAs' libraries compile side by side
    list(_pool.map(native.load, ISAS))
lib = native.load()  # the selected ISA's; the `isa` fixture below sets each ISA's in turn
pytestmark = pytest.mark.skipif(lib is None, reason=f"native kernels unavailable here: {native.why_unavailable()}")


@pytest.fixture(scope="module", autouse=True, params=ISAS)
def isa(request):
    """Run the module on each ISA: `lib` is that ISA's library, and SPECULANT_ISA names it, so a
    CpuBackend made in a test loads the same one."""
    global lib
    outer = lib
    lib = native.load(request.param)
    with pytest.MonkeyPatch.context() as mp:
        if request.param is not None:
            mp.setenv("SPECULANT_ISA", request.param)
        yield request.param
    lib = outer


def zmm() -> bool:
    """The AVX-512 build: it has the tiled VNNI kernels in both group sizes (and AMX where the
    compiler knows it)."""
    return native.isa_of(lib) == "avx512"


def tiled_path(rows: int) -> int:
    """What spk_last_path() says after a call of `rows` rows that the tiled kernels take where the
    build has them: 5 where the rows past the last whole group of 16 are few enough for the
    per-row kernels (spk_set_tiled_tail_rows); else on AVX-512, 4 where they take groups of 8 rows
    (a call of up to 64 rows whose last 16-row group would be half empty or worse), else 3; on
    AVX2, with AVX-VNNI or without, 3 (ymm halves of the 16-row groups)."""
    if per_row_tail(rows):
        return 5  # whole groups of 16 (AVX2, of 9-15 rows: the first 8) tiled, the rows past them on the per-row kernels
    if native.isa_of(lib) != "avx512":
        return 3
    return 4 if rows <= 64 and 0 < rows % 16 <= 8 else 3


def per_row_tail(rows: int) -> int:
    """The rows of a tiled call of `rows` rows that the per-row kernels take: those past the last
    whole group of 16 (on AVX2, of 9-15 rows those past the first 8), where there are at most
    spk_set_tiled_tail_rows of them; else 0."""
    limit = lib.spk_set_tiled_tail_rows(0)
    lib.spk_set_tiled_tail_rows(limit)
    tail = rows % 16 if rows > 16 else rows - 8 if 8 < rows < 16 and not zmm() else 0
    return tail if tail <= limit else 0


K_QUANTS = {Q.Q4_K, Q.Q6_K}


def q8k_reference(row: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_K, dequantized (float64)."""
    out = np.zeros(row.shape, np.float64)
    for b in range(0, row.size, 256):
        block = row[b : b + 256].astype(np.float32)
        top = block[np.argmax(np.abs(block))]
        if top == 0:
            continue
        iscale = np.float32(-127.0) / top
        q = np.minimum(127, np.rint(iscale * block))
        out[b : b + 256] = q * np.float64(np.float32(1.0) / iscale)
    return out


def q80_reference(row: np.ndarray) -> np.ndarray:
    """llama.cpp's x86 quantize_row_q8_0, dequantized (float64)."""
    out = np.zeros(row.shape, np.float64)
    for b in range(0, row.size, 32):
        block = row[b : b + 32].astype(np.float32)
        amax = np.abs(block).max()
        if amax == 0:
            continue
        d = np.float16(amax / np.float32(127.0))
        out[b : b + 32] = np.rint(block * (np.float32(127.0) / amax)) * np.float64(np.float32(d))
    return out


def run(raw: np.ndarray, qtype: Q, n: int, k: int, x: np.ndarray) -> torch.Tensor:
    x = np.ascontiguousarray(x, np.float32)
    y = torch.empty(x.shape[0], n)
    assert lib.spk_linear(int(qtype), raw.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.data_ptr()) == 0
    return y


@pytest.mark.parametrize("qtype,n,k", [(Q.Q4_K, 48, 512), (Q.Q6_K, 40, 768), (Q.Q8_0, 33, 96),
                                       (Q.Q5_0, 20, 160), (Q.Q4_0, 17, 64)])
def test_kernel_matches_float64_reference_and_is_row_invariant(qtype, n, k):
    rng = np.random.default_rng(int(qtype))
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    weights = dequantize(raw, qtype, (n, k)).double().numpy()
    x = (rng.standard_normal((70, k)) * 3).astype(np.float32)
    x[5] = 0.0  # an all-zero row quantizes to scale 0
    quant = q8k_reference if qtype in K_QUANTS else q80_reference
    expected = np.stack([quant(r) for r in x]) @ weights.T
    alone = torch.cat([run(raw, qtype, n, k, x[i : i + 1]) for i in range(len(x))])
    assert np.abs(alone.numpy() - expected).max() <= 2e-6 * np.abs(expected).max()
    for m in (2, 3, 5, 6, 7, 8, 9, 16, 70):  # tiles of 8 rows (5-8 rows share a pass over a block), remainders, many rows
        assert torch.equal(run(raw, qtype, n, k, x[:m]), alone[:m]), f"{m} rows"
    if qtype not in K_QUANTS:  # the modes are the K-quants' arithmetic; other types take decode's in any mode
        for mode in (1, 2):
            for m in (1, 8, 70):
                assert torch.equal(run_mode(raw, qtype, n, k, x[:m], mode), alone[:m]), f"mode {mode}, {m} rows"


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_0])
def test_32_blocks_tiled_give_the_per_row_kernels_bits(qtype, b32_tiled_min_rows):
    """Q5_0/Q4_0 calls of 8 rows or more decode each weight row once and take tiles (AVX2 and
    AVX-512 builds; spk_set_b32_tiled_min_rows): the same bits as the per-row kernels, for weight
    rows left over from the tiles of 3, activation rows left over from the tiles (on AVX-512 an
    odd last row), and calls of more than ACT_TILE rows."""
    rng = np.random.default_rng(7)
    n, k = 37, 320
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    x = (rng.standard_normal((130, k)) * 3).astype(np.float32)
    b32_tiled_min_rows(0)
    per_row = {m: run(raw, qtype, n, k, x[:m]) for m in (8, 13, 64, 130)}
    b32_tiled_min_rows(8)
    for m, expected in per_row.items():
        assert torch.equal(run(raw, qtype, n, k, x[:m]), expected), f"{m} rows"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_decode_prefetch_order_and_distance_leave_the_bits(qtype, w4_prefetch):
    """The four-row decode kernels' prefetch (spk_set_w4_prefetch: 0 the per-row order, else the
    four rows' span in address order that many bytes ahead, past the matrix's end too) moves no
    result: one and two activation rows, weight rows in whole groups of four and a remainder."""
    rng = np.random.default_rng(11)
    n, k = 42, 512
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    x = (rng.standard_normal((2, k)) * 3).astype(np.float32)
    w4_prefetch(0)
    expected = {m: run(raw, qtype, n, k, x[:m]) for m in (1, 2)}
    for distance in (64, 4096, 1 << 20):
        w4_prefetch(distance)
        for m, want in expected.items():
            assert torch.equal(run(raw, qtype, n, k, x[:m]), want), f"{distance} bytes ahead, {m} rows"


def _zen5_or_later() -> bool:
    info = Path("/proc/cpuinfo").read_text()
    family = next((int(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu family")), 0)
    return "AuthenticAMD" in info and family >= 0x1A


def test_decode_prefetch_default_follows_the_cpu():
    """The library's default prefetch (what a fresh process gets): on AVX-512 the per-row order,
    or 8 KiB ahead where one-row decode takes the ymm kernel (a Zen 5 measured); on AVX2 8 KiB
    ahead where the CPU has AVX-512 (a Zen 4 measured) and 4 KiB where it has not (a Zen 3);
    SPECULANT_W4_PREFETCH overrides it. The ymm kernel is the AVX-512 build's default on AMD Zen 5
    and later only; SPECULANT_W4_YMM overrides that."""
    isa = native.isa_of(lib)
    code = ("from speculant_cpu import native; lib = native.load(); "
            "print(lib.spk_set_w4_prefetch(0), lib.spk_set_w4_ymm(0))")
    env = {**os.environ, "SPECULANT_ISA": isa}
    env.pop("SPECULANT_W4_PREFETCH", None)
    env.pop("SPECULANT_W4_YMM", None)

    def defaults() -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        prefetch, ymm = out.split()
        return int(prefetch), int(ymm)

    avx512_cpu = "avx512f" in native._cpu_flags().split()
    ymm = int(isa == "avx512" and _zen5_or_later())
    assert defaults() == ((8192 if ymm else 0) if isa == "avx512" else 8192 if avx512_cpu else 4096, ymm)
    env["SPECULANT_W4_YMM"] = "1"
    assert defaults() == (8192 if isa == "avx512" else 8192 if avx512_cpu else 4096, 1)
    env["SPECULANT_W4_YMM"] = "0"
    env["SPECULANT_W4_PREFETCH"] = "12288"
    assert defaults() == (12288, 0)


@pytest.fixture
def w4_ymm():
    """Set whether the AVX-512 build's one-row Q4_K decode takes the ymm kernel (w4_ymm.h)."""
    yield from _path_threshold(lib.spk_set_w4_ymm)


def test_decode_ymm_kernel_leaves_the_bits(w4_ymm, w4_prefetch):
    """The AVX-512 build's one-row Q4_K decode on the ymm kernel (reading the activations in
    q4k_order) gives the zmm kernel's bits, with either prefetch; the AVX2 build ignores the knob.
    Weight rows in whole groups of four and a remainder, several blocks a row."""
    rng = np.random.default_rng(12)
    n, k = 42, 1024
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), Q.Q4_K)
    x = (rng.standard_normal((1, k)) * 3).astype(np.float32)
    w4_ymm(0)
    w4_prefetch(0)
    expected = run(raw, Q.Q4_K, n, k, x)
    for distance in (0, 8192):
        w4_prefetch(distance)
        w4_ymm(1)
        assert torch.equal(run(raw, Q.Q4_K, n, k, x), expected), f"ymm kernel, prefetch {distance}"
        w4_ymm(0)
        assert torch.equal(run(raw, Q.Q4_K, n, k, x), expected), f"zmm kernel, prefetch {distance}"


def _path_threshold(setter):
    """Yield `setter` (one of the library's spk_set_* knobs), its old value restored afterwards."""
    old = setter(0)
    setter(old)
    yield setter
    setter(old)


@pytest.fixture
def b32_tiled_min_rows():
    """Set the row count from which Q5_0/Q4_0 calls take dot_b32_tiled."""
    yield from _path_threshold(lib.spk_set_b32_tiled_min_rows)


@pytest.fixture
def w4_prefetch():
    """Set the four-row decode kernels' prefetch (0 per row, else linear that many bytes ahead)."""
    yield from _path_threshold(lib.spk_set_w4_prefetch)


@pytest.fixture
def amx_min_rows():
    """Set the row count from which calls take the AMX path (where it has their type and mode)."""
    yield from _path_threshold(lib.spk_set_amx_min_rows)


@pytest.fixture
def tiled_min_rows():
    """Set the row count from which Q4_K calls that do not take AMX take the tiled VNNI kernels
    (Q6_K ones too where k > 4096, else from twice as many: tiled_from_rows)."""
    yield from _path_threshold(lib.spk_set_tiled_min_rows)


def tiled_from_rows(qtype, k: int, rows: int) -> int:
    """linear.cpp's tiled_min_rows: the row count from which a call takes the tiled kernels when
    spk_set_tiled_min_rows(rows) (rows > 0) is in force."""
    return 2 * rows if qtype == Q.Q6_K and k <= 4096 else rows


# --- llama.cpp's arithmetic for the K-quants, emulated in numpy ---------------------------------
# The kernels must give llama.cpp's x86 results bit for bit (checked against its own tensors when
# they were written). Integer parts are exact; the float steps are emulated one IEEE operation at a
# time: fma(a, b, c) is a*b + c in long double (the product is exact), rounded once to float32.

F32 = np.float32


def fma(a, b, c):
    return (np.longdouble(a) * np.longdouble(b) + np.longdouble(c)).astype(F32)


def q8k(x: np.ndarray):
    """quantize_row_q8_K per 256-block of each row: int values, float scale, sums of each 16."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 256, 256).astype(F32)
    idx = np.abs(xb).argmax(-1)
    top = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(top == 0, F32(0), F32(-127.0) / top).astype(F32)
    q = np.minimum(127, np.rint((iscale[..., None] * xb).astype(F32))).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(iscale == 0, F32(0), F32(1.0) / iscale).astype(F32)
    return q, d, q.reshape(rows, k // 256, 16, 16).sum(-1)


def q4k_parts(raw: np.ndarray, n: int, k: int):
    """A Q4_K matrix as d, dmin [n, nb], sub-block scales and mins [n, nb, 8], values [n, nb, 256]."""
    blocks = raw.reshape(n, k // 256, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)
    s = blocks[..., 4:16].astype(np.int64)
    sc = np.empty(s.shape[:-1] + (8,), np.int64)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:].astype(np.int64).reshape(n, k // 256, 4, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k // 256, 256)
    return d, dmin, sc, mn, q


def q6k_parts(raw: np.ndarray, n: int, k: int):
    """A Q6_K matrix as d [n, nb], scales [n, nb, 16], values (q - 32) [n, nb, 256]."""
    blocks = raw.reshape(n, k // 256, 210)
    ql = blocks[..., :128].astype(np.int64).reshape(n, k // 256, 2, 64)
    qh = blocks[..., 128:192].astype(np.int64).reshape(n, k // 256, 2, 32)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.int64)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(F32)
    parts = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
             (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.concatenate(parts, axis=-1).reshape(n, k // 256, 256) - 32
    return d, sc, q


def llamacpp_q4k(raw, n, k, x, gemm: bool) -> np.ndarray:
    """llama.cpp's repacked Q4_K: gemv (one FMA step per block) or gemm (one per sub-block pair)."""
    d, dmin, sc, mn, q = q4k_parts(raw, n, k)
    xq, xd, bs16 = q8k(x)
    sub = np.einsum("nbjv,mbjv->nmbj", q.reshape(n, -1, 8, 32), xq.reshape(len(x), -1, 8, 32))  # [n, m, nb, 8]
    isum = sub * sc[:, None]
    msum = mn[:, None] * bs16.reshape(len(x), -1, 8, 2).sum(-1)[None]
    acc = np.zeros((n, len(x)), F32)
    macc = np.zeros((n, len(x)), F32)
    for b in range(k // 256):
        dd = (d[:, b, None] * xd[None, :, b]).astype(F32)
        dm = (dmin[:, b, None] * xd[None, :, b]).astype(F32)
        steps = [slice(2 * p, 2 * p + 2) for p in range(4)] if gemm else [slice(0, 8)]
        for j in steps:
            acc = fma(isum[:, :, b, j].sum(-1).astype(F32), dd, acc)
            macc = fma(msum[:, :, b, j].sum(-1).astype(F32), dm, macc)
    return (acc - macc).astype(F32).T


def llamacpp_q6k(raw, n, k, x, tiled: bool) -> np.ndarray:
    """llama.cpp's Q6_K: ggml_vec_dot_q6_K_q8_K (eight lane sums, each its own FMA chain, then
    hsum_float_8), or its tiled matmul for prompt batches (one sum per block)."""
    d, sc, q = q6k_parts(raw, n, k)
    xq, xd, bs16 = q8k(x)
    # 4-value groups of the stored values (q + 32, 0..63); lane l sums the groups g with g % 8 == l
    # and takes off 32 * (sc_2l * bsum16_2l + sc_2l+1 * bsum16_2l+1): the same total per block, split
    # over the lanes as ggml splits it
    g4 = np.einsum("nbgv,mbgv->nmbg", (q + 32).reshape(n, -1, 64, 4), xq.reshape(len(x), -1, 64, 4))
    g4 = g4 * np.repeat(sc, 4, axis=-1)[:, None]
    corr = 32 * (sc[:, None] * bs16[None]).reshape(n, len(x), -1, 8, 2).sum(-1)
    lanes = g4.reshape(n, len(x), -1, 8, 8).sum(-2) - corr
    acc = np.zeros((n, len(x), 8), F32) if not tiled else np.zeros((n, len(x)), F32)
    for b in range(k // 256):
        dd = (xd[None, :, b] * d[:, b, None]).astype(F32)
        if tiled:
            t = (lanes[:, :, b].sum(-1).astype(F32) * d[:, b, None]).astype(F32)
            acc = fma(t, xd[None, :, b], acc)
        else:
            acc = fma(dd[..., None], lanes[:, :, b].astype(F32), acc)
    if tiled:
        return acc.T
    a = acc
    return (((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))).astype(F32).T


def run_prompt(raw, qtype, n, k, x, kinds) -> torch.Tensor:
    x = np.ascontiguousarray(x, np.float32)
    y = torch.empty(x.shape[0], n)
    kinds = np.ascontiguousarray(kinds, np.uint8)
    assert lib.spk_linear_prompt(int(qtype), raw.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.data_ptr(), kinds.ctypes.data) == 0
    return y


def run_mode(raw, qtype, n, k, x, mode) -> torch.Tensor:
    x = np.ascontiguousarray(x, np.float32)
    y = torch.empty(x.shape[0], n)
    assert lib.spk_linear_mode(int(qtype), raw.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.data_ptr(), mode) == 0
    return y


def k_quant_case(qtype, n, k):
    rng = np.random.default_rng(k + n)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    x = (rng.standard_normal((70, k)) * 3).astype(np.float32)
    x[5] = 0.0
    x[9, ::7] = 40.0  # a block whose largest magnitude is positive (it maps to -127)
    return raw, x


# Shapes of the 1.5B model's layers (k = 1536 and 8960) with n not a multiple of the 16-row chunks.
K_SHAPES = [(Q.Q4_K, 37, 1536), (Q.Q6_K, 45, 1536), (Q.Q4_K, 21, 8960), (Q.Q6_K, 19, 8960)]


@pytest.mark.parametrize("qtype,n,k", K_SHAPES)
def test_k_quant_rows_are_llamacpp_arithmetic_whatever_the_row_count_and_path(qtype, n, k, amx_min_rows, tiled_min_rows):
    raw, x = k_quant_case(qtype, n, k)
    expected = torch.from_numpy((llamacpp_q4k if qtype == Q.Q4_K else llamacpp_q6k)(raw, n, k, x, False))
    amx_min_rows(0)  # the VNNI kernels only
    tiled_min_rows(0)
    alone = torch.cat([run(raw, qtype, n, k, x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, expected)
    # never AMX or tiled; tiled from 1 row (Q4_K on the AMX layout without AMX); the default split;
    # always AMX (even 1 row; where the CPU has it)
    for amx, tiled in ((0, 0), (0, 1), (0, 4), (1, 0), (4, 0)):
        amx_min_rows(amx)
        tiled_min_rows(tiled)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70):
            assert torch.equal(run(raw, qtype, n, k, x[:m]), alone[:m]), f"{m} rows, AMX from {amx} rows, tiled from {tiled}"
        assert torch.equal(run(raw, qtype, n, k, x[40:57]), alone[40:57])  # rows at other offsets of a tile
    if qtype == Q.Q4_K:
        tiled_min_rows(1)
        amx_min_rows(0)
        for m in (3, 9, 70):
            run(raw, qtype, n, k, x[:m])
            assert lib.spk_last_path() == tiled_path(m)  # the tiled kernels did run (where the build has them)


def assert_rows_by_kind(got, kinds, bit, prompt, decode):
    """The rows whose kind has `bit` are `prompt`'s rows, the others `decode`'s, bit for bit."""
    flagged = torch.from_numpy(kinds & bit != 0)
    assert torch.equal(got[flagged], prompt[flagged])
    assert torch.equal(got[~flagged], decode[~flagged])


@pytest.mark.parametrize("qtype,n,k", K_SHAPES)
def test_prompt_rows_take_llamacpp_prompt_arithmetic(qtype, n, k):
    """spk_linear_prompt: flagged rows as llama.cpp computes a prompt (Q4_K: its gemm; Q6_K: its
    tiled matmul), the others as decode rows, in any mix."""
    raw, x = k_quant_case(qtype, n, k)
    emulate = llamacpp_q4k if qtype == Q.Q4_K else llamacpp_q6k
    prompt = torch.from_numpy(emulate(raw, n, k, x, True))
    decode = run(raw, qtype, n, k, x)
    bit = 1 if qtype == Q.Q4_K else 2
    kinds = np.zeros(len(x), np.uint8)
    kinds[3:30] = bit
    kinds[41:66] = 3
    assert_rows_by_kind(run_prompt(raw, qtype, n, k, x, kinds), kinds, bit, prompt, decode)
    assert not torch.equal(prompt, decode)  # the two arithmetics do differ on these inputs
    other = run_prompt(raw, qtype, n, k, x, np.full(len(x), 3 - bit, np.uint8))  # the other type's flag: no effect
    assert torch.equal(other, decode)


def random_k_quant_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """Random bytes in GGUF block format: every value, scale and min pattern (the 6-bit and int8
    scales at their extremes included), with finite fp16 block scales of any magnitude, subnormals
    and negatives included."""
    size, scale_at, n_scales = (144, 0, 2) if qtype == Q.Q4_K else (210, 208, 1)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = rng.integers(0, 1 << 16, (n, k // 256, n_scales), dtype=np.uint16)
    scales[(scales & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf or NaN
    raw[..., scale_at : scale_at + 2 * n_scales] = scales.view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype,n,k", K_SHAPES)
def test_prompt_arithmetic_is_the_same_on_every_path(qtype, n, k, amx_min_rows, tiled_min_rows):
    """spk_linear_mode 1 (llama.cpp's prompt arithmetic): the AMX kernel and the tiled VNNI kernels
    give the per-row VNNI kernels' bits for every row count (partial groups of 16 included), on
    random blocks with extreme scales, and for prompt rows mixed with decode rows in one
    spk_linear_prompt call."""
    rng = np.random.default_rng(n + k + int(qtype))
    raw = random_k_quant_blocks(qtype, n, k, rng)
    _, x = k_quant_case(qtype, n, k)
    x[12] = -2.0  # every value quantizes to -127: the largest sums
    x[13] = np.abs(x[13]) * 5
    amx_min_rows(0)
    tiled_min_rows(0)
    alone = torch.cat([run_mode(raw, qtype, n, k, x[i : i + 1], 1) for i in range(len(x))])
    emulate = llamacpp_q4k if qtype == Q.Q4_K else llamacpp_q6k
    assert torch.equal(alone, torch.from_numpy(emulate(raw, n, k, x, True)))
    decode = run(raw, qtype, n, k, x)
    amx = 2 if lib.spk_amx_available() else 1
    # always AMX, the default AMX split; then without AMX: tiled from 1 row, from 4 (Q6_K 8)
    for amx_from, tiled_from in ((1, 0), (5, 0), (0, 1), (0, 4)):
        amx_min_rows(amx_from)
        tiled_min_rows(tiled_from)
        for m in (1, 2, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 45, 48, 63, 64, 65, 70):
            got = run_mode(raw, qtype, n, k, x[:m], 1)
            path = amx if amx_from and m >= amx_from else tiled_path(m) if tiled_from and m >= tiled_from_rows(qtype, k, tiled_from) else 1
            assert lib.spk_last_path() == path, f"{m} rows"
            assert torch.equal(got, alone[:m]), f"{m} rows, AMX from {amx_from} rows, tiled from {tiled_from}"
        assert torch.equal(run_mode(raw, qtype, n, k, x[21:66], 1), alone[21:66])  # rows at another offset
        bit = 1 if qtype == Q.Q4_K else 2
        kinds = np.zeros(len(x), np.uint8)
        kinds[2:9] = bit  # runs of prompt rows of 7, 45 and 7 rows between decode rows
        kinds[12:57] = bit
        kinds[63:70] = 3
        assert_rows_by_kind(run_prompt(raw, qtype, n, k, x, kinds), kinds, bit, alone, decode)


@pytest.fixture
def tiled_tail_rows():
    """Set how many rows past a tiled call's last whole group of 16 take the per-row kernels."""
    yield from _path_threshold(lib.spk_set_tiled_tail_rows)


@pytest.mark.parametrize("qtype,n,k", K_SHAPES)
def test_rows_past_the_tiled_groups_are_the_same_on_the_per_row_kernels(qtype, n, k, amx_min_rows, tiled_min_rows,
                                                                       tiled_tail_rows):
    """A tiled call's rows past its last whole group of 16 (path 5: on the per-row kernels, the
    weight rows in cache) give the bits of every other path, in every mode, whatever the tail's
    length; with the tail off the padded groups (and on AVX-512 the 8-row groups) take them."""
    rng = np.random.default_rng(7 * n + k)
    raw = random_k_quant_blocks(qtype, n, k, rng)
    _, x = k_quant_case(qtype, n, k)
    amx_min_rows(0)
    tiled_min_rows(0)
    modes = (0, 1, 2) if qtype == Q.Q6_K else (0, 1)
    alone = {mode: torch.cat([run_mode(raw, qtype, n, k, x[i : i + 1], mode) for i in range(len(x))]) for mode in modes}
    tiled_min_rows(1)
    for tail in (0, 1, 4, 8, 15):
        tiled_tail_rows(tail)
        for m in (8, 9, 12, 15, 16, 17, 20, 24, 25, 33, 40, 49, 63, 65, 70):
            for mode in modes:
                got = run_mode(raw, qtype, n, k, x[:m], mode)
                if mode or qtype == Q.Q4_K:  # Q6_K's decode arithmetic has no tiled form
                    assert lib.spk_last_path() == tiled_path(m), f"{m} rows, tail {tail}"
                    assert (lib.spk_last_path() == 5) == (per_row_tail(m) > 0)
                    assert per_row_tail(m) <= tail
                assert torch.equal(got, alone[mode][:m]), f"{m} rows, mode {mode}, tail up to {tail}"


def test_amx_path_is_taken_where_available(amx_min_rows, tiled_min_rows):
    rng = np.random.default_rng(3)
    raw = quantize(rng.standard_normal((32, 512)).astype(np.float32), Q.Q4_K)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    amx_min_rows(4)
    tiled_min_rows(8)
    run(raw, Q.Q4_K, 32, 512, x[:1])
    assert lib.spk_last_path() == 1  # VNNI
    run(raw, Q.Q4_K, 32, 512, x)
    expected = 2 if lib.spk_amx_available() else tiled_path(16)  # AMX, else VNNI on the AMX layout
    assert lib.spk_last_path() == expected
    amx_min_rows(0)
    run(raw, Q.Q4_K, 32, 512, x)
    assert lib.spk_last_path() == tiled_path(16)
    run(raw, Q.Q4_K, 32, 512, x[:8])
    assert lib.spk_last_path() == tiled_path(8)
    tiled_min_rows(0)
    run(raw, Q.Q4_K, 32, 512, x)
    assert lib.spk_last_path() == 1
    raw80 = quantize(rng.standard_normal((32, 512)).astype(np.float32), Q.Q8_0)
    amx_min_rows(1)
    run(raw80, Q.Q8_0, 32, 512, x)
    assert lib.spk_last_path() == 1  # no AMX kernel for the 32-blocks


def test_amx_is_available_on_a_cpu_with_amx_int8():
    if os.environ.get("SPECULANT_AMX") == "0":
        pytest.skip("SPECULANT_AMX=0")
    if not zmm():
        assert not lib.spk_amx_built() and not lib.spk_amx_available()  # AVX2 builds have no AMX kernel
        return
    flags = open("/proc/cpuinfo").read()
    if "amx_int8" not in flags or "amx_tile" not in flags:
        pytest.skip("this CPU has no AMX-INT8")
    if not lib.spk_amx_built():
        pytest.skip("the compiler does not know AMX")
    assert lib.spk_amx_available() == 1, "the CPU has AMX-INT8 but the library cannot use it"


def test_amx_calls_between_torch_amx_calls_on_the_same_thread():
    """oneDNN's AMX kernels (torch's bf16 matmuls) load their own tile config and release the tiles
    on the calling thread; the next AMX call must load ours again (a tile op without it is SIGILL,
    which would kill the process: hence a subprocess)."""
    if not zmm():
        pytest.skip("no AMX kernel in the AVX2 build")
    code = """if True:
        import numpy as np, torch
        from gguf import GGMLQuantizationType as Q
        from speculant.testing.tiny_gguf import quantize
        from speculant_cpu import native
        lib = native.load()
        raw = quantize(np.random.default_rng(0).standard_normal((32, 512)).astype(np.float32), Q.Q6_K)
        x = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
        y = np.empty((16, 32), np.float32)
        a, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(128, 256, dtype=torch.bfloat16)
        for _ in range(3):
            assert lib.spk_linear(int(Q.Q6_K), raw.ctypes.data, 32, 512, x.ctypes.data, 16, y.ctypes.data) == 0
            torch.nn.functional.linear(a, w)
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


def test_unsupported_shapes_are_refused():
    assert not lib.spk_supports(int(Q.Q4_K), 320)  # not a whole number of 256-blocks
    assert not lib.spk_supports(int(Q.Q2_K), 256)  # no kernel for this type
    assert lib.spk_supports(int(Q.Q8_0), 96)


def test_backend_uses_native_kernels_and_keeps_the_mapping(monkeypatch):
    """With huge pages off the kernels read the file's map (the loader must keep its pages)."""
    from speculant_cpu.backend import CpuBackend, NativeLinear

    monkeypatch.setenv("SPECULANT_HUGEPAGES", "0")
    raw = quantize(np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32), Q.Q4_K)
    info = type("Info", (), {"data": raw, "qtype": Q.Q4_K, "shape": (32, 256)})()
    lin = CpuBackend().linear(info)
    assert isinstance(lin, NativeLinear) and lin.uses_mapping and lin.raw is raw
    assert type(CpuBackend(use_native=False).linear(info)).__name__ == "Int4Linear"


EXACT_EVERYWHERE = 1 << 62  # exact_below past every position: llama.cpp's arithmetic for all rows


def attention(q, k, v, positions, window, grouped, exact_below=EXACT_EVERYWHERE):
    rows, n_head, dk = q.shape
    out = torch.empty(rows, n_head, v.shape[-1])
    assert lib.spk_attention_f16(q.data_ptr(), rows, n_head, k.shape[0], dk, v.shape[-1], k.data_ptr(), v.data_ptr(),
                                 k.stride(0), v.stride(0), positions.data_ptr(), window, dk**-0.5, out.data_ptr(), grouped,
                                 exact_below) == 0
    return out


def test_attention_over_no_rows_does_nothing():
    """An empty batch is a no-op (it once divided the pairs into zero chunks)."""
    q, k, v, positions = attention_case(1, 4, 2, 64)
    assert attention(q[:0].contiguous(), k, v, positions[:0].contiguous(), 0, 1).shape == (0, 4, 64)


@pytest.mark.parametrize("rows,n_head,n_kv,dk,window", [(1, 12, 2, 128, 0), (16, 12, 2, 128, 0), (5, 4, 1, 256, 40),
                                                        (3, 14, 2, 64, 0), (7, 8, 8, 80, 9), (2, 6, 3, 72, 0), (40, 2, 1, 16, 0)])
def test_grouped_attention_is_the_one_pair_kernel_bit_for_bit(rows, n_head, n_kv, dk, window):
    """The fast kernel (pairs sharing a kv head walked together, 16 keys at a time, vector exp)
    must give exactly the bits of the plain one (one (row, head) at a time, libm's expf), for
    every row alone or in any batch: the engine's exactness and llama.cpp's numerics rest on it."""
    gen = torch.Generator().manual_seed(rows * 100 + dk)
    ctx = 150
    q = torch.randn(rows, n_head, dk, generator=gen) * 3  # sharp softmaxes: many new maxima
    k = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    v = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    positions = torch.tensor(sorted(torch.randint(0, ctx + rows, (rows,), generator=gen).tolist()), dtype=torch.int64)
    reference = attention(q, k, v, positions, window, grouped=0)
    fast = attention(q, k, v, positions, window, grouped=1)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, reference)
    for r in (0, rows - 1):
        alone = attention(q[r : r + 1].contiguous(), k, v, positions[r : r + 1].contiguous(), window, grouped=1)
        assert torch.equal(alone[0], fast[r])


GRID = [(1, 12, 2, 128, 0), (16, 12, 2, 128, 0), (5, 4, 1, 256, 40), (3, 14, 2, 64, 0), (7, 8, 8, 80, 9),
        (2, 6, 3, 72, 0), (40, 2, 1, 16, 0)]


def attention_case(rows, n_head, n_kv, dk, ctx=150, exact_below=None):
    """Queries, an fp16 cache and sorted positions; with exact_below, the first row below it."""
    gen = torch.Generator().manual_seed(rows * 100 + dk)
    q = torch.randn(rows, n_head, dk, generator=gen) * 3  # sharp softmaxes: many new maxima
    k = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    v = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    positions = sorted(torch.randint(0, ctx + rows, (rows,), generator=gen).tolist())
    if exact_below is not None and rows > 1:
        positions[0] = min(positions[0], exact_below - 3)  # a mixed batch: rows on both paths
    return q, k, v, torch.tensor(positions, dtype=torch.int64)


@pytest.mark.parametrize("rows,n_head,n_kv,dk,window", GRID)
def test_fp32_attention_rows_are_their_reference_bit_for_bit(rows, n_head, n_kv, dk, window):
    """Rows from exact_below on (past llama.cpp's split-KV point) take fp32 flash attention in
    16-key blocks at fixed offsets: the grouped kernel gives its scalar reference's bits, a row's
    bits do not depend on the rows beside it, the thread count, or what the cache holds outside
    its key range; rows below exact_below in the same call keep the llama.cpp arithmetic."""
    exact_below = 20
    q, k, v, positions = attention_case(rows, n_head, n_kv, dk, exact_below=exact_below)
    reference = attention(q, k, v, positions, window, 0, exact_below)
    fast = attention(q, k, v, positions, window, 1, exact_below)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, reference)
    slow = positions < exact_below
    assert torch.equal(fast[slow], attention(q, k, v, positions, window, 1)[slow])
    assert not torch.equal(fast[~slow], attention(q, k, v, positions, window, 1)[~slow])
    threads = lib.spk_threads()
    try:
        for n in (1, 2, 3):
            lib.spk_set_threads(n)
            assert torch.equal(attention(q, k, v, positions, window, 1, exact_below), fast), f"{n} threads"
    finally:
        lib.spk_set_threads(threads)
    for r in range(rows):
        p = int(positions[r])
        lo = max(0, p + 1 - window) if window else 0
        kr, vr = k.clone(), v.clone()  # cells outside the row's keys hold anything, even NaN
        kr[:, :lo], kr[:, p + 1 :], vr[:, :lo], vr[:, p + 1 :] = float("nan"), float("inf"), float("nan"), float("inf")
        alone = attention(q[r : r + 1].contiguous(), kr, vr, positions[r : r + 1].contiguous(), window, 1, exact_below)
        assert torch.equal(alone[0], fast[r]), f"row {r} at {p}"


@pytest.mark.parametrize("rows,n_head,n_kv,dk,window", GRID + [(9, 4, 2, 64, 23), (6, 2, 1, 128, 300)])
def test_fp32_attention_is_softmax_attention_to_float32_accuracy(rows, n_head, n_kv, dk, window):
    """The fp32 path against softmax attention in float64 (sliding windows whose first key falls
    inside a 16-key block included)."""
    q, k, v, positions = attention_case(rows, n_head, n_kv, dk, ctx=400)
    positions = positions.clamp(min=1)
    got = attention(q, k, v, positions, window, 1, 0)
    group = n_head // n_kv
    for r, p in enumerate(positions.tolist()):
        lo = max(0, p + 1 - window) if window else 0
        for h in range(n_head):
            kh, vh = k[h // group, lo : p + 1].double(), v[h // group, lo : p + 1].double()
            w = torch.softmax(kh @ q[r, h].double() * dk**-0.5, 0)
            expected = w @ vh
            assert (got[r, h].double() - expected).abs().max() <= 1e-5 * vh.abs().max(), (r, h, p, lo)


def test_vector_exp_has_the_bits_of_libm_expf():
    """The attention's vector exp reproduces glibc's expf; checked here on a sample of all
    negative floats down to -inf (every float in [-104, 0] was checked when it was written)."""
    assert lib.spk_exp_check(0x80000000, 0xC2D00000, 101) == 0  # [-104, -0], every 101st float
    assert lib.spk_exp_check(0xC2D00000, 0xFF800000, 100003) == 0  # below -104, to -inf: 0
    assert lib.spk_exp_check(0x00000000, 0x42B17217, 1009) == 0  # [0, 88.72]


@pytest.mark.parametrize("n,k", [(45, 1536), (19, 8960)])
def test_q6k_canonical_rows_are_row_invariant_on_both_paths(n, k, amx_min_rows, tiled_min_rows):
    """Kind bit 2 (rows past llama.cpp's split-attention point): Q6_K through the canonical
    epilogue, which the AMX kernel and the tiled VNNI kernel share; a row's bits do not depend on
    the rows beside it or on the path, and the value is the float64 product to float32 accuracy."""
    raw, x = k_quant_case(Q.Q6_K, n, k)
    amx_min_rows(0)
    tiled_min_rows(0)
    alone = torch.cat([run_mode(raw, Q.Q6_K, n, k, x[i : i + 1], 2) for i in range(len(x))])
    weights = dequantize(raw, Q.Q6_K, (n, k)).double().numpy()
    expected = np.stack([q8k_reference(r) for r in x]) @ weights.T
    assert np.abs(alone.numpy() - expected).max() <= 4e-6 * np.abs(expected).max()
    for amx, tiled in ((0, 0), (0, 1), (0, 8), (1, 0), (4, 0)):
        amx_min_rows(amx)
        tiled_min_rows(tiled)
        for m in (1, 3, 4, 8, 9, 16, 17, 70):
            assert torch.equal(run_mode(raw, Q.Q6_K, n, k, x[:m], 2), alone[:m]), f"{m} rows, AMX from {amx}, tiled from {tiled}"
    amx_min_rows(0)
    tiled_min_rows(1)
    for m in (2, 17, 32):  # from 2 rows where k <= 4096, else from 1 (tiled_min_rows(1))
        run_mode(raw, Q.Q6_K, n, k, x[:m], 2)
        assert lib.spk_last_path() == tiled_path(m)  # the tiled kernels did run
    kinds = np.where(np.arange(len(x)) % 3 == 0, 4, 0).astype(np.uint8)  # mixed with llama.cpp-decode rows
    mixed = run_prompt(raw, Q.Q6_K, n, k, x, kinds)
    canon = torch.from_numpy(kinds == 4)
    assert torch.equal(mixed[canon], alone[canon])
    assert torch.equal(mixed[~canon], run(raw, Q.Q6_K, n, k, x)[~canon])


def test_native_norm_rope_swiglu_are_the_torch_arithmetic():
    """The element-wise natives against the torch forms the architectures fall back to (which do
    llama.cpp's arithmetic too), bit for bit."""
    from speculant_cpu.backend import CpuBackend
    from speculant_transformer.layers import apply_rope, rms_norm

    be = CpuBackend()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 3, 128, generator=gen) * 40
    w = torch.randn(128, generator=gen)
    assert torch.equal(be.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    positions = torch.tensor([0, 1, 5, 300, 301, 4000, 70000])
    cos, sin = be.rope_tables(positions, 128, 1e6)
    for neox in (True, False):
        assert torch.equal(be.apply_rope(x.clone(), cos, sin, neox), apply_rope(x, cos, sin, neox))
    # the tables: float angles chained as llama.cpp chains them, then cosf/sinf (close to float64's)
    from speculant_transformer.layers import rope_tables
    c64, s64 = rope_tables(positions[:3], 128, 1e6)
    assert torch.allclose(cos[:3], c64, atol=1e-6) and torch.allclose(sin[:3], s64, atol=1e-6)
    gate, up = torch.randn(3, 8960 + 5, generator=gen) * 6, torch.randn(3, 8960 + 5, generator=gen)
    together = be.swiglu(gate, up)
    assert torch.allclose(together, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
    # both run on the pool's threads (pieces of a row; RMSNorm's rows eight side by side): a row's
    # bits do not depend on the rows beside it
    for i in range(3):
        assert torch.equal(be.swiglu(gate[i : i + 1], up[i : i + 1])[0], together[i])
    rows = x.reshape(21, 128)
    normed = be.rms_norm(rows, w, 1e-6)
    for i in (0, 7, 8, 20):
        assert torch.equal(be.rms_norm(rows[i : i + 1], w, 1e-6)[0], normed[i])


def test_logit_rows_take_the_kind_of_their_own_positions():
    """The output head computes only the rows that want logits: its scope is theirs, so a row past
    LLAMA_SPLIT_KV takes the canonical Q6_K kernels there too (not the two-pass decode kernel)."""
    from speculant import Batch
    from speculant_cpu.backend import LLAMA_SPLIT_KV, CpuBackend

    be = CpuBackend()
    batch = Batch.for_sequence(0, LLAMA_SPLIT_KV - 2, [5, 6, 7, 8], logits="all", prompt_len=3)
    logit_rows = batch.select([1, 3])
    assert logit_rows.positions == (LLAMA_SPLIT_KV - 1, LLAMA_SPLIT_KV + 1) and logit_rows.prompt_lens == (3, 3)
    with be.batch(logit_rows, prompt=False):
        assert list(be.row_kinds) == [0, 4] and be.row_mode(int(Q.Q6_K), 2) is None
    with be.batch(batch.select([2, 3]), prompt=False):
        assert be.row_mode(int(Q.Q6_K), 2) == 2 and be.row_mode(int(Q.Q4_K), 2) == 0


def test_the_ctypes_bindings_come_from_the_header_the_library_is_built_with():
    """spk.h is the native API's one list: every function the sources define is declared there
    (the compiler checks the signatures, the sources include it), and every declared function is
    bound with the header's types and found in the library."""
    import re

    header = native.HEADER.read_text()
    declared = set(re.findall(r"^\w+\s+(spk_\w+)\(", header, re.M))
    defined = {m[1] for src in native.SOURCES for line in src.read_text().splitlines()
               if (m := re.match(r"\w+\s+(spk_\w+)\(", line)) and not re.search(r"\);\s*(//.*)?$", line)}  # not a declaration
    assert defined == declared, f"defined but not in spk.h: {defined - declared}; declared, not defined: {declared - defined}"
    assert all(INCLUDES_API.search(src.read_text()) for src in native.SOURCES)
    api = native.api()
    assert len(api) == len(declared) - 1  # all but spk_parallel_for (a function pointer: C++ callers only)
    for name, (restype, argtypes) in api.items():
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype == restype, name
    assert api["spk_linear_mode"][1][-1] is ctypes.c_int and api["spk_exp_check"][0] is ctypes.c_int64


# spk.h itself, or kernels.h, the internal header (which includes spk.h)
INCLUDES_API = re.compile(r'^#include "(spk|kernels)\.h"', re.M)


def test_every_source_file_is_built_checked_and_hashed():
    """A .cpp added to native/ is compiled into the library (SOURCES is every .cpp there, not a
    list to keep up to date) and sees the C API (it includes spk.h or kernels.h, so the compiler
    checks any spk_ function it defines against spk.h); the build's cache key hashes every .cpp and
    .h, so an edit to any of them rebuilds."""
    here = native.HEADER.parent
    cpp, h = set(here.glob("*.cpp")), set(here.glob("*.h"))
    assert set(native.SOURCES) == cpp and len(native.SOURCES) == len(cpp)
    assert set(native._source_files()) == cpp | h and native.HEADER in h
    assert '#include "spk.h"' in (here / "kernels.h").read_text()
    assert not [src.name for src in sorted(cpp) if not INCLUDES_API.search(src.read_text())]
