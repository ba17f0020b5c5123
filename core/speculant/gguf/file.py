"""Open a GGUF file: memory-mapped tensors plus metadata as plain Python values.

The header is parsed here (`open_gguf`, and `read_gguf_metadata` for the metadata alone).
`open_gguf` leaves long arrays (a tokenizer's 150k tokens and merges) undecoded until first read
(`LazyArray`): a drafter head carries its target's tokenizer for llama.cpp but never reads it,
and decoding it cost ~20 MB of Python objects.

Everything that can go wrong with a file on disk becomes one ModelFileError naming the file.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from speculant.errors import ModelFileError

GGUF_MAGIC = b"GGUF"


@attrs.frozen
class TensorInfo:
    """One tensor of the file. `shape` is in PyTorch order (rows, cols); `data` is the raw mmap'd bytes."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False, repr=False)
    offset: int = 0  # byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


# Arrays of at least this many items stay undecoded until first read (`LazyArray`).
LAZY_ARRAY_ITEMS = 4096


class LazyArray(Sequence):
    """A metadata array of the mapped file, decoded (to the list `read_gguf_metadata` gives) on
    first access to its items; its length is known without decoding. Reading it needs the
    mapping open, as the tensors do."""

    def __init__(self, decode, count: int):
        self._decode, self._count, self._items = decode, count, None

    def items(self) -> list:
        if self._items is None:
            self._items = self._decode()
            self._decode = None
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self.items()[i]

    def __iter__(self):
        return iter(self.items())

    def __eq__(self, other) -> bool:
        return self.items() == (other.items() if isinstance(other, LazyArray) else other)

    def __repr__(self) -> str:
        return f"LazyArray({self._count} items)" if self._items is None else repr(self._items)


def plain_array(value):
    """`value` as a list where it is a LazyArray, else unchanged."""
    return value.items() if isinstance(value, LazyArray) else value


@attrs.frozen
class GGUFFile:
    path: str
    metadata: dict[str, Any] = attrs.field(repr=False)
    tensors: dict[str, TensorInfo] = attrs.field(repr=False)
    mapping: mmap.mmap | None = attrs.field(default=None, repr=False, eq=False)

    def release(self, info: TensorInfo) -> None:
        """Tell the OS we are done with a tensor's pages (the backend made its own copy), so
        loading a model does not hold the whole file resident on top of the converted weights."""
        if self.mapping is None:
            return
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page  # whole pages inside the tensor only
        end = (info.offset + info.data.nbytes) // page * page
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read_rows(self, info: TensorInfo, ids) -> np.ndarray:
        """Rows `ids` of tensor `info` (as ``info.data[ids]``), read from the file rather than
        through the map: a few thousand rows spread over a 150k-row lm_head fault in most of its
        pages (fault-around maps 16 at a time), 134 MB of RSS for a 21 MB copy."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= info.data.shape[0]):
            raise IndexError(f"rows {int(ids.min())}..{int(ids.max())} of tensor '{info.name}' with {info.data.shape[0]} rows")
        row_bytes = info.data[0].nbytes if len(info.data) else 0
        out = np.empty(len(ids) * row_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            for j, i in enumerate(ids.tolist()):
                chunk = os.pread(f.fileno(), row_bytes, info.offset + i * row_bytes)
                if len(chunk) != row_bytes:
                    raise ModelFileError(f"{self.path}: tensor '{info.name}' is cut short (row {i})")
                out[j * row_bytes : (j + 1) * row_bytes] = np.frombuffer(chunk, dtype=np.uint8)
        return out.view(info.data.dtype).reshape((len(ids),) + info.data.shape[1:])

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """Metadata key under the architecture's prefix, e.g. arch_key('block_count')."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {shown(name)} is missing") from None

    def joined(self, names: list[str]) -> TensorInfo | None:
        """The rows of the named tensors as one tensor, without a copy, where the file holds them
        back to back in one type and row length (llama.cpp's converters write a layer's FFN gate
        and up matrices so); None where it does not. One matrix product over the joined rows
        computes what the products over each compute."""
        if self.mapping is None or len(names) < 2 or any(n not in self.tensors for n in names):
            return None
        parts = [self.tensors[n] for n in names]
        first = parts[0]
        for a, b in zip(parts, parts[1:]):
            if (b.qtype != first.qtype or b.shape[1:] != first.shape[1:] or len(b.shape) != 2
                    or b.data.dtype != first.data.dtype or a.offset + a.data.nbytes != b.offset):
                return None
        rows = sum(p.shape[0] for p in parts)
        count = sum(p.data.size for p in parts)
        data = np.frombuffer(self.mapping, dtype=first.data.dtype, count=count, offset=first.offset)
        data = data.reshape((sum(p.data.shape[0] for p in parts),) + first.data.shape[1:])
        return TensorInfo("+".join(names), first.qtype, (rows,) + tuple(first.shape[1:]), data, first.offset)


# ---------------------------------------------------------------------------------------------------
# GGUF header parsing (our own: gguf-py's GGUFReader builds a numpy view per vocabulary string and
# needs 6-10 s on a real model; this reads the same header in ~0.1 s).
#
#   magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
#   n_kv x      key (string) | value type u32 | value
#   n_tensors x name (string) | n_dims u32 | dims u64 x n_dims (fastest first) | type u32 | offset u64
#   padding up to general.alignment (default 32), then the data section; offsets are relative to it.
#
# A string is a u64 length and that many UTF-8 bytes; an array is an item type u32, a count u64
# and the items.  Everything is little-endian (big-endian files are refused).
# ---------------------------------------------------------------------------------------------------
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4  # llama.cpp refuses tensors with more dimensions
# Arrays of arrays are read (flattened, as gguf-py does) to this depth; no model needs more than
# one level, and a deeper file is a crafted one (it would exhaust the parser's recursion).
GGUF_MAX_ARRAY_DEPTH = 8

_T_STRING, _T_ARRAY, _T_UINT32, _T_BOOL = 8, 9, 4, 7
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
_NP_ITEMS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
# Tensor types gguf-py hands out as typed arrays shaped like the tensor; all others are uint8
# [rows..., bytes per row].  (BF16 is among the others: gguf-py gives its raw bytes.)
_TYPED = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def shown(name: str, limit: int = 80) -> str:
    """A name read from a file, quoted for a one-line message: escapes for newlines and other
    control characters (repr's), cut to `limit` characters."""
    return repr(name if len(name) <= limit else name[:limit] + "...")


class _Truncated(Exception):
    """A read ran past the end of the file (raised inside the parser, turned into ModelFileError)."""


class _Malformed(Exception):
    """A value the format does not allow (raised inside the parser, turned into ModelFileError)."""


@attrs.frozen
class _RawTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest dimension first
    type_id: int
    offset: int  # relative to the data section


@attrs.frozen
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[_RawTensor]
    data_start: int  # absolute file offset of the data section (may lie past the end of a cut file)


def _map_file(path: str) -> mmap.mmap:
    """Read-only mapping of the whole file, after the checks that need no GGUF parsing."""
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if head != GGUF_MAGIC[:len(head)] or not head:
                raise ModelFileError(f"{path}: not a GGUF file (bad magic bytes)")
            if len(head) < 4:
                raise ModelFileError(f"{path}: truncated GGUF header (the file is only {len(head)} bytes long)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from None


def _parse_header(path: str, buf, prefixes: tuple[str, ...] = (), with_tensors: bool = True, lazy: bool = False) -> _Header:
    """Parse magic, version, metadata (keys starting with one of `prefixes`, all if empty) and,
    with `with_tensors`, the tensor infos.  `buf` is the mapped file.  Raises ModelFileError."""
    size = len(buf)
    where = "the file header"
    try:
        if buf[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (bad magic bytes)")
        if size < 8:
            raise _Truncated
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0 and version != 0:
            raise ModelFileError(f"{path}: big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ModelFileError(f"{path}: unsupported GGUF version {version} (versions 2 and 3 are supported)")
        if size < 24:
            raise _Truncated
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        unpack_from = struct.unpack_from

        def read_str(p: int) -> tuple[str, int]:
            (ln,) = unpack_from("<Q", buf, p)
            p += 8
            if p + ln > size:
                raise _Truncated
            return buf[p:p + ln].decode("utf-8", errors="replace"), p + ln

        def read_array(p: int, want: bool, out: list, depth: int = 1) -> int:
            """Append the items of the array at `p` to `out` (nested arrays flattened, as gguf-py
            does); returns the position after it."""
            if depth > GGUF_MAX_ARRAY_DEPTH:
                raise _Malformed(f"{where} has arrays nested more than {GGUF_MAX_ARRAY_DEPTH} deep")
            itype, count = unpack_from("<IQ", buf, p)
            p += 12
            if itype == _T_STRING:
                append = out.append
                for _ in range(count):
                    (ln,) = unpack_from("<Q", buf, p)
                    p += 8
                    if want:
                        append(buf[p:p + ln].decode("utf-8", errors="replace"))
                    p += ln
                if p > size:
                    raise _Truncated
            elif itype in _NP_ITEMS:
                nbytes = _SCALAR_SIZES[itype] * count
                if p + nbytes > size:
                    raise _Truncated
                if want:
                    arr = np.frombuffer(buf[p:p + nbytes], dtype=_NP_ITEMS[itype], count=count)
                    out.extend(arr.astype(bool).tolist() if itype == _T_BOOL else arr.tolist())
                p += nbytes
            elif itype == _T_ARRAY:
                for _ in range(count):
                    p = read_array(p, want, out, depth + 1)
            else:
                raise _Malformed(f"{where} is an array of unknown value type {itype}")
            return p

        metadata: dict[str, Any] = {}
        alignment_entry = None  # (value type, value) of general.alignment
        for i in range(n_kv):
            where = f"metadata entry {i}"
            key, pos = read_str(pos)
            where = f"metadata key {shown(key)}"
            (vtype,) = unpack_from("<I", buf, pos)
            pos += 4
            want = not prefixes or key.startswith(prefixes)
            if vtype == _T_STRING:
                val, pos = read_str(pos)
            elif vtype == _T_ARRAY:
                val = []
                itype, count = unpack_from("<IQ", buf, pos) if pos + 12 <= size else (None, 0)
                if lazy and want and count >= LAZY_ARRAY_ITEMS and (itype == _T_STRING or itype in _NP_ITEMS):
                    start = pos
                    pos = read_array(pos, False, val)  # walks the array (bounds checked), decodes nothing
                    val = LazyArray(lambda start=start: _decode_array(buf, start, read_array), count)
                else:
                    pos = read_array(pos, want, val)
            elif vtype in _SCALARS:
                (val,) = unpack_from(_SCALARS[vtype], buf, pos)
                pos += _SCALAR_SIZES[vtype]
            else:
                raise _Malformed(f"{where} has an unknown value type {vtype}")
            if key == "general.alignment":
                alignment_entry = (vtype, val)
            if want:
                if key in metadata:
                    raise _Malformed(f"metadata key {shown(key)} appears twice")
                metadata[key] = val
        if not with_tensors:
            return _Header(version, metadata, [], 0)

        alignment = GGUF_DEFAULT_ALIGNMENT
        if alignment_entry is not None:
            vtype, alignment = alignment_entry
            if vtype != _T_UINT32 or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise _Malformed(f"general.alignment must be a power of two stored as uint32, got {alignment!r}")

        tensors: list[_RawTensor] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            where = f"tensor info {i}"
            (ln,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + ln > size:
                raise _Truncated
            try:
                name = buf[pos:pos + ln].decode("utf-8")
            except UnicodeDecodeError:
                raise _Malformed(f"{where} has a name that is not UTF-8") from None
            pos += ln
            where = f"tensor info {shown(name)}"
            if name in seen:
                raise _Malformed(f"tensor {shown(name)} appears twice")
            seen.add(name)
            (n_dims,) = unpack_from("<I", buf, pos)
            pos += 4
            if n_dims > GGML_MAX_DIMS:
                raise _Malformed(f"tensor {shown(name)} has {n_dims} dimensions (at most {GGML_MAX_DIMS} are allowed)")
            dims = unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            type_id, offset = unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append(_RawTensor(name, dims, type_id, offset))
        data_start = -(-pos // alignment) * alignment
        return _Header(version, metadata, tensors, data_start)
    except (_Truncated, struct.error):
        raise ModelFileError(
            f"{path}: truncated GGUF header (the file is {size} bytes long and ends inside {where})") from None
    except _Malformed as e:
        raise ModelFileError(f"{path}: malformed GGUF header: {e}") from None


def _decode_array(buf, start: int, read_array) -> list:
    out: list = []
    read_array(start, True, out)
    return out


def read_gguf_metadata(path: str | os.PathLike, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """Metadata key -> plain Python value for keys starting with one of `prefixes` (all keys if empty),
    reading only the key/value section (no tensors), e.g. for a tokenizer.

    Values have the same form as `open_gguf(path).metadata`: lists for arrays, str, int, float, bool."""
    path = os.fspath(path)
    buf = _map_file(path)
    try:
        return _parse_header(path, buf, tuple(prefixes), with_tensors=False).metadata
    finally:
        buf.close()


@attrs.frozen
class _Layout:
    """Where one tensor's data lies and how it is viewed: `count` items of `dtype` shaped `view_shape`."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    dtype: Any
    count: int
    view_shape: tuple[int, ...]
    offset: int


def _layout(path: str, file_size: int, start: int, raw: _RawTensor) -> _Layout:
    try:
        qtype = GGMLQuantizationType(raw.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(f"{path}: tensor {shown(raw.name)} has unknown tensor type {raw.type_id}") from None
    shape = tuple(reversed(raw.dims))  # PyTorch order: slowest dimension first
    offset = start + raw.offset
    dtype = _TYPED.get(qtype)
    if dtype is not None:
        view_shape = shape
    else:
        dtype = np.uint8
        if not shape or shape[-1] % block:
            raise ModelFileError(f"{path}: malformed GGUF header: tensor {shown(raw.name)} of type {qtype.name} has "
                                 f"shape {list(shape)}, whose rows are not a whole number of {block}-element blocks")
        view_shape = (*shape[:-1], shape[-1] // block * type_size)
    count = math.prod(view_shape)
    end = offset + count * np.dtype(dtype).itemsize
    if end > file_size:
        raise ModelFileError(f"{path}: truncated tensor data (tensor {shown(raw.name)} ends at byte {end} "
                             f"but the file is {file_size} bytes long)")
    return _Layout(raw.name, qtype, shape, dtype, count, view_shape, offset)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (read-only views, nothing is copied)."""
    path = os.fspath(path)
    mapping = _map_file(path)
    try:
        header = _parse_header(path, mapping, lazy=True)
        layouts = [_layout(path, len(mapping), header.data_start, raw) for raw in header.tensors]
    except BaseException:
        mapping.close()  # no views exist yet, so this cannot fail
        raise
    tensors = {}
    for t in layouts:
        # Same dtype and shape as gguf-py gives (typed arrays for float/int types, rows of bytes otherwise).
        data = np.frombuffer(mapping, dtype=t.dtype, count=t.count, offset=t.offset).reshape(t.view_shape)
        tensors[t.name] = TensorInfo(t.name, t.qtype, t.shape, data, t.offset)
    # The header's pages were read once to parse it; the OS may drop them (a LazyArray read
    # faults its pages in again), so a head's copy of the tokenizer holds no memory.
    header_pages = min(header.data_start, len(mapping)) // mmap.PAGESIZE * mmap.PAGESIZE
    if header_pages:
        mapping.madvise(mmap.MADV_DONTNEED, 0, header_pages)
    return GGUFFile(path, header.metadata, tensors, mapping)
