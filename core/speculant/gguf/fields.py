"""Metadata fields of gguf-py's GGUFReader as typed values, for writing them back with its
GGUFWriter: what a tool needs to copy a model's keys (a head's tokenizer, a relabelled model)
with their GGUF types kept, so llama.cpp reads the copy as it reads the original."""
from __future__ import annotations

from typing import Any, Callable


def _text(raw: bytes) -> str | bytes:
    """A GGUF string as str, or as its bytes when they are not UTF-8 (vocabularies hold such
    pieces): GGUFWriter writes bytes as they are, so a copy stays byte-exact."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def field_value(field) -> tuple[Any, Any, Any]:
    """(value, GGUFValueType, element type of an array or None) of a ReaderField. Strings are
    str, or bytes where they are not UTF-8."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [_text(bytes(field.parts[i])) for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return _text(bytes(field.parts[field.data[0]])), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def copy_fields(reader, writer, keep: Callable[[str], bool], rename: Callable[[str], str] = lambda name: name) -> int:
    """Add the reader's fields whose name `keep` accepts to the writer, under `rename(name)`,
    with their types. The reader's own GGUF.* header fields are never copied. Returns the count."""
    n = 0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or not keep(name):
            continue
        value, vtype, sub = field_value(field)
        writer.add_key_value(rename(name), value, vtype, sub_type=sub)
        n += 1
    return n
