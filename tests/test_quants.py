"""speculant.gguf.quants must equal gguf-py's reference dequantization bit for bit."""
from __future__ import annotations

import glob
import os
import warnings

import gguf.quants
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from speculant.errors import ModelFileError
from speculant.gguf.quants import SUPPORTED_TYPES, dequantize, dequantize_rows, unpack_q4_groups

QUANTS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOATS = [Q.F32, Q.F16, Q.BF16]
# Types gguf-py can quantize; the K-quants it can only dequantize, so those get random bytes.
GGUF_PY_QUANTIZES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Byte offsets of the f16 scale fields inside one block, per type.
F16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
SHAPES = [(1, 1), (3, 2), (17, 5)]  # (rows, blocks per row)


def shape_for(qtype, rows, blocks):
    return (rows, blocks * GGML_QUANT_SIZES[qtype][0])


def random_blocks(qtype, rows, blocks, seed=0) -> np.ndarray:
    """Random bytes [rows, bytes_per_row] whose f16 scale fields are finite (zeros, subnormals, negatives included)."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, blocks, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, blocks)) * 10.0 ** rng.integers(-6, 2, (rows, blocks))).astype(np.float16)
        scales.flat[::7] = 0.0
        scales.flat[3::11] = np.float16(2.0**-20)  # f16 subnormal
        raw[..., at:at + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * type_size)


def assert_bitwise(got: torch.Tensor, ref: np.ndarray, shape):
    assert got.dtype == torch.float32
    assert tuple(got.shape) == tuple(shape)
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).reshape(shape)
    # Compare bit patterns: torch.equal would call -0.0 == 0.0 equal.
    assert torch.equal(got.view(torch.int32), ref_t.view(torch.int32))


@pytest.mark.parametrize("rows,blocks", SHAPES)
@pytest.mark.parametrize("qtype", GGUF_PY_QUANTIZES, ids=lambda q: q.name)
def test_matches_reference_on_quantized_floats(qtype, rows, blocks):
    shape = (rows, blocks * 32)  # a whole number of blocks for every type here (block size 1 or 32)
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    data[0, :5] = 0.0
    raw = gguf.quants.quantize(data, qtype)
    assert_bitwise(dequantize(raw, qtype, shape), gguf.quants.dequantize(raw, qtype), shape)


@pytest.mark.parametrize("rows,blocks", SHAPES)
@pytest.mark.parametrize("qtype", QUANTS, ids=lambda q: q.name)
def test_matches_reference_on_random_blocks(qtype, rows, blocks):
    raw = random_blocks(qtype, rows, blocks, seed=rows * 100 + blocks)
    shape = shape_for(qtype, rows, blocks)
    assert_bitwise(dequantize(raw, qtype, shape), gguf.quants.dequantize(raw, qtype), shape)


def test_half_types_every_bit_pattern():
    patterns = np.arange(1 << 16, dtype=np.uint16)
    # BF16 (as gguf-py stores it: raw bytes) is exact for every pattern, NaN payloads included.
    raw = patterns.view(np.uint8)
    assert_bitwise(dequantize(raw, Q.BF16, (1 << 16,)), gguf.quants.dequantize(raw, Q.BF16), (1 << 16,))
    # F16: every non-NaN pattern is exact. torch quiets signalling NaNs (numpy keeps them), which
    # is documented in the module and irrelevant for weights; NaN must stay NaN.
    halves = patterns.view(np.float16)
    got = dequantize(halves, Q.F16, halves.shape)
    ref = gguf.quants.dequantize(halves, Q.F16)
    finite = ~np.isnan(ref)
    assert_bitwise(got[torch.from_numpy(finite)], ref[finite], (int(finite.sum()),))
    assert torch.isnan(got[torch.from_numpy(~finite)]).all()


@pytest.mark.parametrize("qtype", FLOATS + QUANTS, ids=lambda q: q.name)
def test_input_forms(qtype):
    """Read-only numpy (like a memmap), a torch tensor and a flat array all work, without warnings."""
    shape = shape_for(qtype, 4, 64 if qtype in FLOATS else 2)
    if qtype in FLOATS:
        raw = gguf.quants.quantize(np.random.default_rng(2).standard_normal(shape).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, 4, 2)
    ref = gguf.quants.dequantize(raw, qtype)
    read_only = raw.copy()
    read_only.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise(dequantize(read_only, qtype, shape), ref, shape)
    assert_bitwise(dequantize(torch.from_numpy(raw.copy()), qtype, shape), ref, shape)
    assert_bitwise(dequantize(raw.reshape(-1), qtype, shape), ref, shape)


def test_one_dimensional_and_three_dimensional_shapes():
    vec = np.arange(64, dtype=np.float32)
    assert torch.equal(dequantize(vec, Q.F32, (64,)), torch.arange(64, dtype=torch.float32))
    raw = random_blocks(Q.Q4_K, 6, 1)
    assert_bitwise(dequantize(raw, Q.Q4_K, (2, 3, 256)), gguf.quants.dequantize(raw, Q.Q4_K), (2, 3, 256))


def test_result_is_a_copy_of_read_only_data():
    vec = np.ones(32, dtype=np.float32)
    vec.flags.writeable = False
    dequantize(vec, Q.F32, (32,)).add_(1)  # must not write through to (possibly mmap'd) input
    assert (vec == 1).all()


@pytest.mark.parametrize("qtype", FLOATS + QUANTS, ids=lambda q: q.name)
def test_dequantize_rows_equals_slicing(qtype):
    rows_total, blocks = 9, (64 if qtype in FLOATS else 3)
    shape = shape_for(qtype, rows_total, blocks)
    if qtype in FLOATS:
        raw = gguf.quants.quantize(np.random.default_rng(3).standard_normal(shape).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, rows_total, blocks, seed=3)
    full = dequantize(raw, qtype, shape)
    rows = torch.tensor([8, 0, 3, 3, 5])
    assert torch.equal(dequantize_rows(raw, qtype, shape, rows).view(torch.int32), full[rows].view(torch.int32))
    # Any index shape works, e.g. [batch, seq] token ids.
    ids = torch.tensor([[1, 2], [7, 1]])
    assert dequantize_rows(raw, qtype, shape, ids).shape == (2, 2, shape[1])
    assert torch.equal(dequantize_rows(raw, qtype, shape, ids), full[ids])
    assert dequantize_rows(raw, qtype, shape, torch.tensor([], dtype=torch.long)).shape == (0, shape[1])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_unpack_q4_groups_reconstructs_exactly(qtype):
    rows, blocks = 5, 3
    shape = shape_for(qtype, rows, blocks)
    if qtype == Q.Q4_K:
        raw = random_blocks(qtype, rows, blocks, seed=4)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(4).standard_normal(shape).astype(np.float32), qtype)
    q, scale, offset = unpack_q4_groups(raw, qtype, shape)
    assert q.dtype == torch.uint8 and tuple(q.shape) == shape and int(q.max()) <= 15
    assert scale.dtype == offset.dtype == torch.float32
    assert tuple(scale.shape) == tuple(offset.shape) == (rows, shape[1] // 32)
    s, o = scale.repeat_interleave(32, dim=1), offset.repeat_interleave(32, dim=1)
    ref = gguf.quants.dequantize(raw, qtype)
    if qtype == Q.Q4_0:
        # Equal in value; the reference's d*(q-8) gives -0.0 for q == 8 and d < 0, we give +0.0.
        ref = ref + np.float32(0.0)  # -0.0 + 0.0 == +0.0: normalise the zeros, nothing else
        assert (q == 8).any()
    assert_bitwise(q.float() * s + o, ref, shape)
    # q*scale is exact, so a fused multiply-add gives the same bits.
    assert_bitwise(torch.addcmul(o, q.float(), s), ref, shape)


def test_unsupported_type_is_a_clear_error():
    raw = np.zeros(66, dtype=np.uint8)
    with pytest.raises(ModelFileError, match=r"tensor type IQ2_XXS is not supported \(supported: F32, F16, Q4_0.*Q6_K"):
        dequantize(raw, Q.IQ2_XXS, (256,))
    with pytest.raises(ModelFileError, match="IQ2_XXS"):
        dequantize_rows(raw, Q.IQ2_XXS, (1, 256), torch.tensor([0]))
    with pytest.raises(ModelFileError, match="Q6_K"):
        unpack_q4_groups(np.zeros(210, dtype=np.uint8), Q.Q6_K, (1, 256))
    assert SUPPORTED_TYPES == frozenset(FLOATS + QUANTS)


def test_wrong_sizes_are_errors():
    with pytest.raises(ModelFileError, match="needs 144 bytes, got 143"):
        dequantize(np.zeros(143, dtype=np.uint8), Q.Q4_K, (1, 256))
    with pytest.raises(ModelFileError, match="not a multiple"):
        dequantize(np.zeros(144, dtype=np.uint8), Q.Q4_K, (2, 128))


# ---------------------------------------------------------------- real model files

MODEL_DIR = os.environ.get("SPECULANT_MODELS", "/root/.cache/speculant-models")
MODEL_FILES = sorted(glob.glob(os.path.join(MODEL_DIR, "*.gguf")))
REAL_ROWS = 48           # rows of a large tensor compared against the (slow) reference
WHOLE_LIMIT = 1_000_000  # tensors up to this many elements are compared whole


@pytest.mark.realmodel
@pytest.mark.parametrize("path", MODEL_FILES or [None], ids=lambda p: os.path.basename(p) if p else "no-files")
def test_real_tensors_match_reference(path):
    if path is None:
        pytest.skip(f"no *.gguf files in {MODEL_DIR} (set SPECULANT_MODELS to a directory with GGUF models)")
    from speculant.gguf.file import open_gguf

    by_type: dict[Q, list] = {}
    for t in open_gguf(path).tensors.values():
        by_type.setdefault(t.qtype, []).append(t)
    assert set(by_type) <= SUPPORTED_TYPES, f"{path} uses unsupported types"
    for qtype, tensors in by_type.items():
        tensors.sort(key=lambda t: t.n_elements)
        # The smallest, a middle-sized and the largest tensor of each type.
        for t in {id(x): x for x in (tensors[0], tensors[len(tensors) // 2], tensors[-1])}.values():
            if t.n_elements <= WHOLE_LIMIT:
                assert_bitwise(dequantize(t.data, t.qtype, t.shape), gguf.quants.dequantize(t.data, t.qtype), t.shape)
                continue
            rows, cols = t.shape[0], t.shape[-1]
            head = (REAL_ROWS, cols)
            ref = gguf.quants.dequantize(t.data[:REAL_ROWS], t.qtype)
            assert_bitwise(dequantize(t.data[:REAL_ROWS], t.qtype, head), ref, head)
            picked = torch.arange(REAL_ROWS)
            assert_bitwise(dequantize_rows(t.data, t.qtype, t.shape, picked), ref, head)
            last = torch.tensor([rows - 1])
            assert_bitwise(dequantize_rows(t.data, t.qtype, t.shape, last),
                           gguf.quants.dequantize(t.data[rows - 1:], t.qtype), (1, cols))
