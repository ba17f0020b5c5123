"""Open a GGUF file: memory-mapped tensors plus metadata as plain Python values.

Everything that can go wrong with a file on disk becomes one ModelFileError naming the file.
"""
from __future__ import annotations

import mmap
import os
from typing import Any

import attrs
import numpy as np
from gguf import GGUFReader, GGUFValueType
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
            raise ModelFileError(f"{self.path}: tensor '{name}' is missing") from None


def _field_value(field) -> Any:
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY:
        item = field.types[-1]
        if item == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"{path}: not a GGUF file (bad magic bytes)")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on short files
        raise ModelFileError(f"{path}: cannot read GGUF header ({type(e).__name__}: {e}); the file may be truncated") from None
    metadata = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    # Our own read-only mapping for tensor data (gguf-py's is dropped with the reader), so pages
    # can be released tensor by tensor while a model loads.
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        try:
            qtype = GGMLQuantizationType(t.tensor_type)
        except ValueError:
            raise ModelFileError(f"{path}: tensor '{t.name}' has unknown tensor type {int(t.tensor_type)}") from None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
        block, type_size = GGML_QUANT_SIZES[qtype]
        expected = int(np.prod(shape)) // block * type_size
        if t.data.nbytes != expected:
            raise ModelFileError(f"{path}: tensor '{t.name}' holds {t.data.nbytes} bytes, expected {expected}; the file is truncated")
        if int(t.data_offset) + expected > len(mapping):
            raise ModelFileError(f"{path}: tensor '{t.name}' ends past the end of the file; the file is truncated")
        # Same dtype and shape as gguf-py gives (typed arrays for float types, rows of bytes otherwise).
        data = np.frombuffer(mapping, dtype=t.data.dtype, count=t.data.size, offset=int(t.data_offset)).reshape(t.data.shape)
        tensors[t.name] = TensorInfo(t.name, qtype, shape, data, int(t.data_offset))
    return GGUFFile(path, metadata, tensors, mapping)
