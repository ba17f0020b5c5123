"""Test helper (no tests here): rewrite a GGUF file's metadata at the byte level, to make the broken
files GGUFWriter refuses to write (a head count of 0, a string where a number belongs, ...)."""
from __future__ import annotations

import struct
from pathlib import Path

SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
T_STRING, T_ARRAY = 8, 9


def string(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v) -> bytes:
    """The bytes of a value of GGUF type `vtype` (arrays: (item type, list of items))."""
    if vtype == T_STRING:
        return string(v)
    if vtype == T_ARRAY:
        itype, items = v
        return struct.pack("<IQ", itype, len(items)) + b"".join(value(itype, x) for x in items)
    return struct.pack(SCALAR_FORMATS[vtype], v)


def _skip(buf: bytes, p: int, vtype: int) -> int:
    if vtype == T_STRING:
        (n,) = struct.unpack_from("<Q", buf, p)
        return p + 8 + n
    if vtype == T_ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, p)
        p += 12
        if itype in SCALAR_FORMATS:
            return p + struct.calcsize(SCALAR_FORMATS[itype]) * count
        for _ in range(count):
            p = _skip(buf, p, itype)
        return p
    return p + struct.calcsize(SCALAR_FORMATS[vtype])


def rewrite(src, dst, changes: dict[str, tuple[int, bytes] | None]) -> str:
    """Copy `src` to `dst` with metadata entries replaced: key -> (value type, value bytes), or
    None to delete it; keys not in the file are appended. Tensor data is kept (re-aligned)."""
    buf = Path(src).read_bytes()
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    p, kvs, align = 24, [], 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, p)
        key = buf[p + 8 : p + 8 + n].decode()
        (vtype,) = struct.unpack_from("<I", buf, p + 8 + n)
        end = _skip(buf, p + 12 + n, vtype)
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", buf, p + 12 + n)
        kvs.append((key, buf[p:end]))
        p = end
    infos_start = p
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, p)
        p += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, p)
        p += 4 + 8 * n_dims + 12
    infos = buf[infos_start:p]
    data = buf[-(-p // align) * align :]
    out, done = [], set()
    for key, raw in kvs:
        if key in changes:
            done.add(key)
            if changes[key] is None:
                continue
            vtype, payload = changes[key]
            raw = string(key) + struct.pack("<I", vtype) + payload
        out.append(raw)
    for key, change in changes.items():
        if key not in done and change is not None:
            out.append(string(key) + struct.pack("<I", change[0]) + change[1])
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(out)) + b"".join(out) + infos
    Path(dst).write_bytes(head + bytes(-len(head) % align) + data)
    return str(dst)


def u32(v: int) -> tuple[int, bytes]:
    return 4, struct.pack("<I", v)
