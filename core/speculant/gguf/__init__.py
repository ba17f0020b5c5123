"""The GGUF layer that plugins build on (public API): the file reader, the tokenizer and chat
template, and the block formats' dequantization.

    from speculant.gguf import open_gguf, GGUFFile, TensorInfo, read_gguf_metadata
    from speculant.gguf import Tokenizer, StreamDecoder, CHATML_TEMPLATE, render_chat
    from speculant.gguf import SUPPORTED_TYPES, dequantize, dequantize_rows, unpack_q4_groups
    from speculant.gguf import quantize_k   # round-to-nearest K-quants, which gguf-py cannot write
    from speculant.gguf import field_value, copy_fields   # metadata of gguf-py's reader, for its writer

Names load on first use, so importing one does not pull in the others' dependencies (jinja2,
tokenizers). The submodules behind them are internal and may move.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "open_gguf": "file", "GGUFFile": "file", "TensorInfo": "file", "read_gguf_metadata": "file",
    "Tokenizer": "tokenizer", "StreamDecoder": "tokenizer",
    "CHATML_TEMPLATE": "chat_template", "render_chat": "chat_template", "ChatTemplateError": "chat_template",
    "SUPPORTED_TYPES": "quants", "dequantize": "quants", "dequantize_rows": "quants", "unpack_q4_groups": "quants",
    "quantize_k": "kquants",
    "field_value": "fields", "copy_fields": "fields",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'speculant.gguf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"speculant.gguf.{where}"), name)
