"""speculant.gguf.file: our own GGUF header parser must read exactly what gguf-py's GGUFReader reads,
and every broken file must become one ModelFileError naming the file."""
from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType as Q

from speculant.errors import ModelFileError
from speculant.gguf import file as gguf_file
from speculant.gguf.file import LazyArray, open_gguf, read_gguf_metadata
from speculant.testing.tiny_gguf import quantize, write_tiny_model

from conftest import DRAFT, GEMMA, MODEL_DIR, TARGET


# ------------------------------------------------------------------------------------------------
# The reference: what gguf-py's reader gives, in open_gguf's plain-Python form.
# ------------------------------------------------------------------------------------------------
def _field_value(field):
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def assert_matches_reader(path, compare_bytes=True):
    """open_gguf(path) equals GGUFReader(path): metadata, and per tensor name, type, shape, offset,
    data dtype/shape and (with compare_bytes) the data bytes, else the bytes at both ends."""
    ours = open_gguf(path)
    ref = GGUFReader(path, "r")
    ref_md = {k: _field_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(ref_md)  # same keys in the same (file) order
    for key, want in ref_md.items():
        got = ours.metadata[key]
        if isinstance(got, LazyArray):  # long arrays: decoded on first read, their length known before
            assert isinstance(want, list) and len(want) >= gguf_file.LAZY_ARRAY_ITEMS and len(got) == len(want), key
            got = got.items()
        assert type(got) is type(want), key
        assert got == want, key
        if isinstance(want, list) and want:
            assert [type(x) for x in got] == [type(x) for x in want], key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == Q(t.tensor_type) and type(info.qtype) is Q
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert all(type(d) is int for d in info.shape)
        assert info.offset == int(t.data_offset)
        assert info.data.dtype == t.data.dtype and info.data.shape == t.data.shape, t.name
        assert not info.data.flags.writeable
        if compare_bytes:
            assert info.data.tobytes() == t.data.tobytes(), t.name
        else:
            a, b = info.data.reshape(-1).view(np.uint8), t.data.reshape(-1).view(np.uint8)
            assert a.size == b.size
            assert np.array_equal(a[:4096], b[:4096]) and np.array_equal(a[-4096:], b[-4096:]), t.name
    return ours


# ------------------------------------------------------------------------------------------------
# Equality with GGUFReader on files written by GGUFWriter.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K"])
def test_tiny_models_match_reader(tmp_path, qtype):
    arch = "gemma3" if qtype in ("BF16", "Q6_K") else "qwen2"
    kw = dict(n_embd=256, n_ff=512, n_head=4, n_kv_head=2) if qtype.endswith("_K") else {}
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype=qtype, tokenizer="llama" if arch == "gemma3" else "gpt2", **kw)
    g = assert_matches_reader(path)
    assert Q[qtype] in {t.qtype for t in g.tensors.values()}
    # The metadata-only reader agrees, with and without a prefix filter.
    assert read_gguf_metadata(path, prefixes=()) == g.metadata
    assert read_gguf_metadata(path) == {k: v for k, v in g.metadata.items() if k.startswith(("tokenizer.", "general."))}


def test_every_value_type_and_tensor_kind(tmp_path):
    """All metadata value types (scalars, strings, arrays of each, nested arrays), a custom alignment,
    and tensors of the typed kinds (F64, I8..I64) plus 1-D, 3-D and 4-D shapes."""
    path = str(tmp_path / "all.gguf")
    w = GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -32000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ▁wörld \x00 end")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3.1])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ünï", "<0x0A>"])
    w.add_key_value("t.u8s", [0, 255, 7], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    w.add_key_value("t.i64s", [-(2**40), 2**40], GGUFValueType.ARRAY, GGUFValueType.INT64)
    w.add_key_value("t.f64s", [1.5, -2.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT64)
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    rng = np.random.default_rng(0)
    w.add_tensor("f64", rng.standard_normal((3, 5)))
    w.add_tensor("i8", rng.integers(-128, 127, (4, 6), dtype=np.int8))
    w.add_tensor("i16", rng.integers(-1000, 1000, (7,), dtype=np.int16))
    w.add_tensor("i32", rng.integers(-10**6, 10**6, (2, 3, 4), dtype=np.int32))
    w.add_tensor("i64", rng.integers(-10**12, 10**12, (2, 2), dtype=np.int64))
    w.add_tensor("f32_4d", rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    w.add_tensor("f16_1d", rng.standard_normal(33).astype(np.float16))
    q = quantize(rng.standard_normal((3, 2, 64)).astype(np.float32), "Q8_0")
    w.add_tensor("q8_3d", q, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = assert_matches_reader(path)
    assert g.metadata["general.alignment"] == 64
    assert g.metadata["t.u64"] == 2**64 - 1 and g.metadata["t.true"] is True and g.metadata["t.f32"] == np.float32(0.1)
    assert g.metadata["t.nested"] == [1, 2, 3, 4, 5]  # flattened, as gguf-py does
    assert all(t.offset % 64 == 0 for t in g.tensors.values())
    assert g.tensors["i32"].shape == (2, 3, 4) and g.tensors["i32"].data.dtype == np.int32
    assert g.tensors["q8_3d"].shape == (3, 2, 64) and g.tensors["q8_3d"].data.shape == (3, 2, 68)


def test_long_arrays_are_decoded_on_first_read(tmp_path):
    """Arrays of LAZY_ARRAY_ITEMS items or more (a tokenizer's) stay undecoded until read: their
    length is known, their items are the reader's, read_gguf_metadata's are plain lists."""
    n = gguf_file.LAZY_ARRAY_ITEMS
    path = str(tmp_path / "long.gguf")
    w = GGUFWriter(path, "llama")
    w.add_array("t.strs", [f"tok{i}\u2581" for i in range(n)])
    w.add_array("t.ints", list(range(-3, n - 3)))
    w.add_array("t.floats", [i / 4 for i in range(n + 1)])
    w.add_array("t.short", ["a"] * (n - 1))
    w.add_tensor("w", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(path)
    lazy = [k for k, v in g.metadata.items() if isinstance(v, LazyArray)]
    assert lazy == ["t.strs", "t.ints", "t.floats"]
    assert [len(g.metadata[k]) for k in lazy] == [n, n, n + 1]
    assert all(g.metadata[k]._items is None for k in lazy)  # len() decoded nothing
    assert g.metadata["t.strs"][5] == "tok5\u2581" and g.metadata["t.ints"][-1] == n - 4
    assert g.metadata["t.floats"] == [i / 4 for i in range(n + 1)]
    assert_matches_reader(path)
    eager = read_gguf_metadata(path, prefixes=())
    assert all(type(eager[k]) is list for k in lazy) and eager == g.metadata


def test_a_tokenizer_reads_lazy_arrays(monkeypatch, tmp_path):
    """Every array lazy (the real models' tokenizers are): a tiny model tokenizes as with plain lists."""
    from speculant.loader import load_model

    path = write_tiny_model(str(tmp_path / "tiny.gguf"))
    text = "def f(x):\n    return x + 1  # héllo"
    want = load_model(path, progress=False).tokenizer.encode(text)
    monkeypatch.setattr(gguf_file, "LAZY_ARRAY_ITEMS", 1)
    model = load_model(path, progress=False)
    assert any(isinstance(v, LazyArray) for v in open_gguf(path).metadata.values())
    assert model.tokenizer.encode(text) == want and model.tokenizer.decode(want) == load_model(path, progress=False).tokenizer.decode(want)


def test_read_rows_is_the_mapped_rows(tmp_path):
    """GGUFFile.read_rows (a drafter's lm_head rows, read without the map) gives data[ids]."""
    path = str(tmp_path / "rows.gguf")
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "llama")
    w.add_tensor("f32", rng.standard_normal((40, 8)).astype(np.float32))
    w.add_tensor("q8", quantize(rng.standard_normal((40, 64)).astype(np.float32), "Q8_0"), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(path)
    ids = [39, 0, 7, 8, 21]
    for name in ("f32", "q8"):
        info = g.tensors[name]
        rows = g.read_rows(info, ids)
        assert rows.dtype == info.data.dtype and np.array_equal(rows, info.data[ids]), name
    with pytest.raises(IndexError):
        g.read_rows(g.tensors["f32"], [40])


def test_no_tensors_and_release(tmp_path):
    path = str(tmp_path / "empty.gguf")
    w = GGUFWriter(path, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = assert_matches_reader(path)
    assert g.tensors == {} and g.architecture == "llama"

    big = write_tiny_model(tmp_path / "m.gguf", "qwen2", n_vocab=4096)
    g = open_gguf(big)
    emb = g.tensor("token_embd.weight")
    before = emb.data.copy()
    g.release(emb)  # drops clean pages; reading again refaults them from the file
    assert np.array_equal(emb.data, before)
    with pytest.raises(ModelFileError, match="m.gguf.*'nope' is missing"):
        g.tensor("nope")


# ------------------------------------------------------------------------------------------------
# Broken files.
# ------------------------------------------------------------------------------------------------
def _layout(path):
    """(end of the key/value section, per-tensor info offsets, end of the tensor infos, data start,
    per-tensor (start, end) of the data)."""
    r = GGUFReader(path, "r")
    infos = [int(t.field.offset) for t in r.tensors]
    last = r.tensors[-1]
    info_end = infos[-1] + 8 + len(last.name.encode()) + 4 + 8 * len(last.shape) + 12
    data = [(int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors]
    return infos[0], infos, info_end, int(r.data_offset), data


def _cut(src, dst, n):
    Path(dst).write_bytes(Path(src).read_bytes()[:n])
    return str(dst)


def _raises(path, pattern):
    """open_gguf(path) raises one line of ModelFileError naming the file and matching `pattern`."""
    with pytest.raises(ModelFileError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert re.search(pattern, msg), msg
    return msg


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("good") / "good.gguf", "qwen2", qtype="Q8_0")


def test_missing_directory_and_not_gguf(tmp_path):
    for fn in (open_gguf, read_gguf_metadata):
        with pytest.raises(ModelFileError, match=f"{tmp_path / 'missing.gguf'}: no such file"):
            fn(tmp_path / "missing.gguf")
        with pytest.raises(ModelFileError, match=f"{tmp_path}: is a directory"):
            fn(tmp_path)
    for name, content in [("text.gguf", b"hello, this is not a model\n" * 10), ("empty.gguf", b""),
                          ("ggml.bin", b"lmgg" + bytes(100))]:
        (tmp_path / name).write_bytes(content)
        _raises(tmp_path / name, "not a GGUF file")
        with pytest.raises(ModelFileError, match=f"{name}.*not a GGUF file"):
            read_gguf_metadata(tmp_path / name)


def test_unsupported_versions(tmp_path, good):
    raw = bytearray(Path(good).read_bytes())
    for version, pattern in [(1, "unsupported GGUF version 1"), (4, "unsupported GGUF version 4"),
                             (0x03000000, "big-endian")]:
        raw[4:8] = struct.pack("<I", version)
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(raw)
        _raises(path, pattern)


def test_truncated_header(tmp_path, good):
    kv_end, infos, info_end, _, _ = _layout(good)
    cuts = [2, 4, 7, 12, 23, 24, 30, 100, kv_end // 3, kv_end // 2, kv_end - 1,  # magic .. key/value section
            kv_end, kv_end + 3, (kv_end + infos[-1]) // 2, infos[-1] + 5, info_end - 13, info_end - 1]  # tensor infos
    for n in cuts:
        path = _cut(good, tmp_path / f"cut{n}.gguf", n)
        _raises(path, r"truncated GGUF header")
        if n < kv_end:  # the metadata reader stops before the tensor infos
            with pytest.raises(ModelFileError, match=f"cut{n}.gguf.*truncated GGUF header"):
                read_gguf_metadata(path)
        else:
            read_gguf_metadata(path)


def test_truncated_data(tmp_path, good):
    _, _, info_end, data_start, spans = _layout(good)
    last_start, last_end = max(spans, key=lambda s: s[1])
    first_end = min(spans)[1]
    for n in sorted({info_end, (info_end + data_start) // 2, data_start, data_start + 1, first_end - 1,
                     first_end + 1, (data_start + last_end) // 2, last_start, last_end - 1}):
        path = _cut(good, tmp_path / f"cut{n}.gguf", n)
        _raises(path, r"truncated tensor data \(tensor '[^']+' ends at byte \d+")
        read_gguf_metadata(path)  # the header itself is complete
    # Cut right after the last tensor: complete (GGUFWriter pads the file past it).
    assert_matches_reader(_cut(good, tmp_path / "exact.gguf", last_end))


def test_unknown_tensor_type(tmp_path, good):
    r = GGUFReader(good, "r")
    t = r.tensors[3]
    at = int(t.field.offset) + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    raw = bytearray(Path(good).read_bytes())
    assert struct.unpack_from("<I", raw, at)[0] == int(t.tensor_type)
    struct.pack_into("<I", raw, at, 200)
    path = tmp_path / "type200.gguf"
    path.write_bytes(raw)
    _raises(path, f"tensor '{t.name}' has unknown tensor type 200")


# A minimal GGUF writer for files GGUFWriter refuses to write.
def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", version: int = 3, align: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % align) + data


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _ti(name: str | bytes, dims: list[int], qtype: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", qtype, offset)


def test_handmade_file_is_what_gguf_py_reads(tmp_path):
    """The hand-made writer below is right: a valid file from it matches GGUFReader."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf([_kv("general.architecture", 8, _s("llama")), _kv("a.n", 4, struct.pack("<I", 7))],
                           [_ti("w", [4, 2], 0), _ti("q", [32, 1], 8, 32)], bytes(32) + bytes(34)))
    g = assert_matches_reader(str(path))
    assert g.tensors["w"].shape == (2, 4) and g.tensors["q"].data.shape == (1, 34)


@pytest.mark.parametrize("case,pattern", [
    ("value_type", r"malformed GGUF header: metadata key 'x' has an unknown value type 99"),
    ("array_type", r"malformed GGUF header: metadata key 'x' is an array of unknown value type 42"),
    ("dup_key", r"malformed GGUF header: metadata key 'x' appears twice"),
    ("alignment_3", r"malformed GGUF header: general.alignment must be a power of two"),
    ("alignment_u64", r"malformed GGUF header: general.alignment must be a power of two stored as uint32"),
    ("dup_tensor", r"malformed GGUF header: tensor 'w' appears twice"),
    ("n_dims", r"malformed GGUF header: tensor 'w' has 9 dimensions"),
    ("tensor_name", r"malformed GGUF header: tensor info 0 has a name that is not UTF-8"),
    ("block", r"malformed GGUF header: tensor 'q' of type Q8_0 has shape \[2, 33\]"),
    ("string_len", r"truncated GGUF header"),  # a length far past the end of the file
    ("array_len", r"truncated GGUF header"),
    ("nested_deep", r"malformed GGUF header: metadata key 'x' has arrays nested more than 8 deep"),  # was RecursionError
    ("nested_5000", r"malformed GGUF header: metadata key 'x' has arrays nested more than 8 deep"),
])
def test_malformed_values(tmp_path, case, pattern):
    arch = _kv("general.architecture", 8, _s("llama"))
    w = _ti("w", [4], 0)
    kvs, tis = [arch], [w]
    if case == "value_type":
        kvs.append(_kv("x", 99, b"\0" * 8))
    elif case == "array_type":
        kvs.append(_kv("x", 9, struct.pack("<IQ", 42, 1) + b"\0" * 8))
    elif case == "dup_key":
        kvs += [_kv("x", 4, struct.pack("<I", 1)), _kv("x", 4, struct.pack("<I", 2))]
    elif case == "alignment_3":
        kvs.append(_kv("general.alignment", 4, struct.pack("<I", 3)))
    elif case == "alignment_u64":
        kvs.append(_kv("general.alignment", 10, struct.pack("<Q", 32)))
    elif case == "dup_tensor":
        tis.append(_ti("w", [4], 0, 32))
    elif case == "n_dims":
        tis = [_ti("w", [1] * 9, 0)]
    elif case == "tensor_name":
        tis = [_ti(b"\xff\xfe", [4], 0)]
    elif case == "block":
        tis.append(_ti("q", [33, 2], 8, 32))
    elif case == "string_len":
        kvs.append(_s("x") + struct.pack("<IQ", 8, 2**62) + b"abc")
    elif case == "array_len":
        kvs.append(_kv("x", 9, struct.pack("<IQ", 4, 2**40) + b"\0" * 16))
    elif case.startswith("nested"):
        depth = 9 if case == "nested_deep" else 5000
        kvs.append(_kv("x", 9, struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 1) + b"\0" * 4))
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(_gguf(kvs, tis, bytes(4096)))
    _raises(path, pattern)


def test_nested_arrays_up_to_the_limit_are_flattened(tmp_path):
    nested = struct.pack("<IQ", 9, 2) + (struct.pack("<IQ", 9, 1) * 6 + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)) * 2
    path = tmp_path / "nested8.gguf"
    path.write_bytes(_gguf([_kv("general.architecture", 8, _s("llama")), _kv("x", 9, nested)], [_ti("w", [4], 0)], bytes(64)))
    assert open_gguf(path).metadata["x"] == [7, 7]  # 8 levels: the outer array, 6 between, the u32 one


# ------------------------------------------------------------------------------------------------
# Real models.
# ------------------------------------------------------------------------------------------------
OPEN_SECONDS: dict[str, float] = {}


@pytest.mark.realmodel
@pytest.mark.parametrize("name", [GEMMA, DRAFT, TARGET])
def test_real_model_matches_reader_and_opens_fast(name):
    path = MODEL_DIR / name
    if not path.exists():
        pytest.skip(f"{path} is absent: run `python scripts/fetch_models.py` (or set SPECULANT_MODELS)")
    open_gguf(path)  # warm the page cache
    t0 = time.perf_counter()
    g = open_gguf(path)
    OPEN_SECONDS[name] = elapsed = time.perf_counter() - t0
    print(f"\nopen_gguf({name}): {elapsed:.3f} s, {len(g.tensors)} tensors, {len(g.metadata)} keys")
    assert elapsed < 3.0, f"open_gguf took {elapsed:.2f} s (GGUFReader needs 6-10 s; ours ~0.15 s)"
    assert_matches_reader(str(path), compare_bytes=False)
    assert len(g.metadata["tokenizer.ggml.tokens"]) > 100_000
    assert read_gguf_metadata(path, prefixes=()) == g.metadata


def test_joined_tensors_are_one_view_of_rows_that_lie_back_to_back(tmp_path):
    """GGUFFile.joined gives the rows of tensors the file holds back to back, in one type and row
    length, as one tensor without a copy; anything else (another type or row length, a gap of
    padding, the wrong order, a missing name) gives None."""
    path = str(tmp_path / "joined.gguf")
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
    qa, qb = quantize(rng.standard_normal((2, 256)).astype(np.float32), "Q4_K"), quantize(rng.standard_normal((4, 256)).astype(np.float32), "Q4_K")
    w = GGUFWriter(path, "llama")
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.add_tensor("half", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("short", rng.standard_normal((1, 4)).astype(np.float32))  # 16 bytes, then padding
    w.add_tensor("after_pad", rng.standard_normal((1, 4)).astype(np.float32))
    w.add_tensor("qa", qa, raw_dtype=Q.Q4_K)
    w.add_tensor("qb", qb, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(path)
    ab = g.joined(["a", "b"])
    assert ab.shape == (8, 8) and ab.qtype == g.tensors["a"].qtype and ab.offset == g.tensors["a"].offset
    assert np.array_equal(ab.data, np.concatenate([a, b]))
    assert np.shares_memory(ab.data, g.tensors["b"].data)  # a view of the mapping, no copy
    q = g.joined(["qa", "qb"])
    assert q.shape == (6, 256) and np.array_equal(q.data, np.concatenate([g.tensors["qa"].data, g.tensors["qb"].data]))
    assert g.joined(["b", "a"]) is None  # not in file order
    assert g.joined(["b", "half"]) is None  # another type
    assert g.joined(["short", "after_pad"]) is None  # padding between them
    assert g.joined(["a", "missing"]) is None
    assert g.joined(["a"]) is None
