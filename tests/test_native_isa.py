"""The native library's instruction sets (SPECULANT_ISA): the choice of ISA, and that every ISA
this CPU can run computes the same bits as every other, kernel by kernel.

tests/test_native_kernels.py runs its exactness and batch-invariance tests on each ISA; here the
ISAs' libraries are loaded side by side and their outputs compared bit for bit on the same inputs
(on an AVX-512 box: the AVX-512 kernels, AMX included, against the AVX2 ones with and without
AVX-VNNI)."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import structlog
import torch
from gguf import GGMLQuantizationType as Q

from speculant.testing.tiny_gguf import quantize
from speculant_cpu import native

ISAS = native.available_isas()
LIBS = {isa: native.load(isa) for isa in ISAS}
LIBS = {isa: lib for isa, lib in LIBS.items() if lib is not None}
several = pytest.mark.skipif(len(LIBS) < 2, reason=f"fewer than two native ISAs here: {list(LIBS)}")

AVX512_CPU = "flags : fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_vnni avx_vnni"
AVX2_VNNI_CPU = "flags : fpu sse2 avx avx2 fma f16c bmi2 avx_vnni"
AVX2_CPU = "flags : fpu sse2 avx avx2 fma f16c bmi2"
AVX_CPU = "flags : fpu sse2 avx f16c"


def test_each_isa_builds_for_its_target():
    assert native.isa_flags("avx512", AVX512_CPU) == ["-march=native"]
    assert native.isa_flags("avx2", AVX512_CPU) == ["-march=haswell", "-mavxvnni"]
    assert native.isa_flags("avx2-novnni", AVX2_VNNI_CPU) == ["-march=haswell"]
    assert native.isa_flags("avx2", AVX2_CPU) == ["-march=haswell"]  # no AVX-VNNI: the maddubs kernels
    assert native.isa_flags("avx512", AVX2_VNNI_CPU) is None
    assert native.isa_flags("avx2", AVX_CPU) is None
    with pytest.raises(ValueError):
        native.isa_flags("sse2", AVX512_CPU)


def test_the_default_is_the_best_isa_and_speculant_isa_overrides_it(monkeypatch):
    monkeypatch.delenv("SPECULANT_ISA", raising=False)
    assert native.selected_isa() == (ISAS[0] if ISAS else None)
    monkeypatch.setenv("SPECULANT_ISA", "AVX2")
    assert native.selected_isa() == "avx2"
    monkeypatch.setenv("SPECULANT_ISA", "neon")
    assert native.load() is None and "not one of" in native.why_unavailable()


def test_each_library_says_which_isa_it_was_built_for():
    flags = native._cpu_flags().split()
    for isa, lib in LIBS.items():
        built = native.isa_of(lib)
        assert built == (isa if isa != "avx2" or "avx_vnni" in flags else "avx2-novnni")
        assert bool(lib.spk_amx_built()) <= (isa == "avx512")  # no AMX kernel outside AVX-512 builds


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_avx2_builds_hold_no_avx512_instruction():
    """An AVX2 build must run on a CPU without AVX-512: no zmm, no mask register, no EVEX
    encoding (GCC picks EVEX forms by itself when -march allows them; -march=haswell does not)."""
    avx2 = {isa: lib for isa, lib in LIBS.items() if isa != "avx512"}
    if not avx2:
        pytest.skip("no AVX2 build here")
    for isa, lib in avx2.items():
        code = subprocess.run(["objdump", "-d", lib._name], capture_output=True, text=True, check=True).stdout
        bad = re.findall(r"zmm|%k[0-7]|[xy]mm(?:1[6-9]|2\d|3[01])\b|\{evex\}", code)
        assert not bad, f"{isa}: {sorted(set(bad))}"
        assert ("vpdpbusd" in code) == (native.isa_of(lib) == "avx2")  # AVX-VNNI exactly where asked for


def same_on_every_isa(call) -> None:
    """call(lib) -> tensor or array: equal bit for bit on every ISA."""
    outs = {isa: np.asarray(call(lib)) for isa, lib in LIBS.items()}
    first = next(iter(outs))
    for isa, out in outs.items():
        assert out.tobytes() == outs[first].tobytes(), f"{isa} differs from {first}"


def random_k_quant_blocks(qtype, n: int, k: int, rng) -> np.ndarray:
    """Random bytes in GGUF block format with finite fp16 block scales of any magnitude: every
    value, scale and min pattern (see test_native_kernels)."""
    size, scale_at, n_scales = (144, 0, 2) if qtype == Q.Q4_K else (210, 208, 1)
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = rng.integers(0, 1 << 16, (n, k // 256, n_scales), dtype=np.uint16)
    scales[(scales & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf or NaN
    raw[..., scale_at : scale_at + 2 * n_scales] = scales.view(np.uint8)
    return raw.reshape(n, -1)


def linear(lib, qtype, raw, n, k, x, mode=None, kinds=None):
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty((x.shape[0], n), np.float32)
    args = (int(qtype), raw.ctypes.data, n, k, x.ctypes.data, x.shape[0], y.ctypes.data)
    if kinds is not None:
        assert lib.spk_linear_prompt(*args, kinds.ctypes.data) == 0
    elif mode is not None:
        assert lib.spk_linear_mode(*args, mode) == 0
    else:
        assert lib.spk_linear(*args) == 0
    return y


@several
@pytest.mark.parametrize("qtype,n,k", [(Q.Q4_K, 37, 1536), (Q.Q6_K, 45, 1536), (Q.Q4_K, 21, 8960), (Q.Q6_K, 19, 8960),
                                       (Q.Q8_0, 33, 96), (Q.Q5_0, 20, 160), (Q.Q4_0, 17, 64)])
def test_linear_layers_are_the_same_bits_on_every_isa(qtype, n, k):
    """Every mode (llama.cpp's decode and prompt arithmetic, Q6_K's canonical form, rows of mixed
    kinds) and row count (decode's four-weight-row kernels, 2-8 row tiles, AMX and the tiled VNNI
    kernels from 5 and 8 rows on AVX-512, tiled ymm kernels from 8 on AVX2 with AVX-VNNI, per-row
    kernels without it), on quantized random weights and on random blocks with extreme scales."""
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal((70, k)) * 3).astype(np.float32)
    x[5] = 0.0
    x[9, ::7] = 40.0
    x[12] = -2.0  # every value quantizes to -127: the largest sums
    weights = [quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)]
    if qtype in (Q.Q4_K, Q.Q6_K):
        weights.append(random_k_quant_blocks(qtype, n, k, rng))
    kinds = rng.integers(0, 8, len(x)).astype(np.uint8)
    for raw in weights:
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 70):
            for mode in (None, 1, 2):
                same_on_every_isa(lambda lib: linear(lib, qtype, raw, n, k, x[:m], mode))
        same_on_every_isa(lambda lib: linear(lib, qtype, raw, n, k, x, kinds=kinds))


def attention(lib, q, k, v, positions, window, grouped, exact_below):
    rows, n_head, dk = q.shape
    out = torch.empty(rows, n_head, v.shape[-1])
    assert lib.spk_attention_f16(q.data_ptr(), rows, n_head, k.shape[0], dk, v.shape[-1], k.data_ptr(), v.data_ptr(),
                                 k.stride(0), v.stride(0), positions.data_ptr(), window, dk**-0.5, out.data_ptr(), grouped,
                                 exact_below) == 0
    return out


@several
@pytest.mark.parametrize("rows,n_head,n_kv,dk,window", [(1, 12, 2, 128, 0), (16, 12, 2, 128, 0), (5, 4, 1, 256, 40),
                                                        (3, 14, 2, 64, 0), (7, 8, 8, 80, 9), (2, 6, 3, 72, 0),
                                                        (40, 2, 1, 16, 0), (9, 4, 2, 64, 23)])
def test_attention_is_the_same_bits_on_every_isa(rows, n_head, n_kv, dk, window):
    """Both arithmetics (llama.cpp's fp16 one, the fp32 flash attention past exact_below, and
    batches mixing them), the grouped kernel and the one-pair reference, sharp softmaxes."""
    gen = torch.Generator().manual_seed(rows * 100 + dk)
    ctx = 300
    q = torch.randn(rows, n_head, dk, generator=gen) * 3
    k = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    v = torch.randn(n_kv, ctx + rows, dk, generator=gen).half()
    positions = torch.tensor(sorted(torch.randint(0, ctx + rows, (rows,), generator=gen).tolist()), dtype=torch.int64)
    for exact_below in (1 << 62, 20, 0):
        for grouped in (0, 1):
            same_on_every_isa(lambda lib: attention(lib, q, k, v, positions, window, grouped, exact_below))


@several
def test_vector_exps_are_the_same_bits_on_every_isa():
    """The three vector exps (libm's for the attention, the fp32 attention's, ggml's for SwiGLU) on
    a sample of every float, subnormal results and overflow included: AVX2 emulates AVX-512's
    vscalefps and reductions, and must round where they round."""
    bits = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], np.linspace(-110, 100, 20001, dtype=np.float32)])
    for which in (0, 1, 2):
        def run(lib):
            y = np.empty_like(x)
            assert lib.spk_vexp(which, x.ctypes.data, len(x), y.ctypes.data) == 0
            return y
        same_on_every_isa(run)
    lib = next(iter(LIBS.values()))
    assert lib.spk_vexp(3, x.ctypes.data, 0, x.ctypes.data) == -1


@several
@pytest.mark.parametrize("dk", [32, 64, 128, 200])
def test_the_delta_net_recurrence_is_the_same_bits_on_every_isa(dk):
    """The DeltaNet recurrence sums its dot products in llama.cpp's AVX-512 order on every ISA
    (it once took the AVX2 build's on AVX2 libraries, and Qwen3.5's outputs then differed on a
    CPU without AVX-512 from those on every other)."""
    gen = torch.Generator().manual_seed(dk)
    n, hv, dv = 5, 3, 16
    q, k = (torch.nn.functional.normalize(torch.randn(n, hv, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=gen)
    decay, beta = torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    state0 = torch.randn(hv, dv, dk, generator=gen)

    def run(lib):
        state, out = state0.clone(), torch.empty(n, hv, dv)
        lib.spk_gated_delta_net(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
                                n, hv, dv, dk, dk ** -0.5, out.data_ptr(), None)
        return torch.cat([state.flatten(), out.flatten()])

    same_on_every_isa(run)


@several
def test_elementwise_kernels_are_the_same_bits_on_every_isa():
    gen = torch.Generator().manual_seed(7)
    gate = torch.cat([torch.linspace(-120, 120, 20011), torch.randn(8960 * 3 - 20011, generator=gen) * 6]).reshape(3, -1).contiguous()
    up = torch.randn(gate.shape, generator=gen)

    def swiglu(lib, rows):
        out = torch.empty(rows, gate.shape[1])
        lib.spk_swiglu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, gate.shape[1], gate.shape[1])
        return out

    for rows in (1, 3):
        same_on_every_isa(lambda lib: swiglu(lib, rows))
    x = torch.randn(21, 128, generator=gen) * 40
    w = torch.randn(128, generator=gen)

    def rms(lib):
        out = torch.empty_like(x)
        lib.spk_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 21, 128, 1e-6)
        return out

    same_on_every_isa(rms)
    pos = torch.tensor([0, 1, 5, 300, 70000], dtype=torch.int64)

    def rope(lib):
        cos, sin = torch.empty(5, 64), torch.empty(5, 64)
        lib.spk_rope_table(pos.data_ptr(), 5, 128, 1e6, 1.0, cos.data_ptr(), sin.data_ptr())
        y = x[:15].reshape(5, 3, 128).clone()
        lib.spk_rope_apply(y.data_ptr(), cos.data_ptr(), sin.data_ptr(), 5, 3, 128, 1)
        return torch.cat([cos.flatten(), sin.flatten(), y.flatten()])

    same_on_every_isa(rope)

    def gelu(lib):
        table = np.zeros(65536, np.uint16)
        lib.spk_gelu_table(table.ctypes.data)
        return table

    same_on_every_isa(gelu)


def test_torch_kernels_are_announced_once_with_the_slowdown(monkeypatch):
    """Without the native library (SPECULANT_NATIVE=0, or a CPU without AVX2) the backend says, in
    one line at start-up, that torch's kernels run and what that costs."""
    from speculant_cpu import backend

    monkeypatch.setattr(backend, "_warned", set())
    monkeypatch.setenv("SPECULANT_NATIVE", "0")
    with structlog.testing.capture_logs() as logs:
        backend.CpuBackend(threads=1)
        backend.CpuBackend(threads=1)
    lines = [e for e in logs if "torch" in e["event"]]
    assert len(lines) == 1
    assert f"{backend.TORCH_DECODE_SLOWDOWN}x slower" in lines[0]["event"] and lines[0]["reason"] == "SPECULANT_NATIVE=0"
    monkeypatch.setattr(backend, "_warned", set())
    monkeypatch.setenv("SPECULANT_NATIVE", "1")
    monkeypatch.setenv("SPECULANT_ISA", "neon")  # as on a CPU with neither ISA: no library
    with structlog.testing.capture_logs() as logs:
        be = backend.CpuBackend(threads=1)
    assert be.native is None
    (line,) = [e for e in logs if "torch" in e["event"]]
    assert line["log_level"] == "warning" and "SPECULANT_ISA" in line["reason"]
