"""Rewrite a qwen2 GGUF as llama architecture, for llama.cpp's hidden-state drafters (bench only).

llama.cpp's EAGLE3 drafter reads the inputs of three target layers, which its graph exports only
for some architectures (llama, qwen3, ...), not for qwen2: llama-server aborts with "layer input
tensor is null". Qwen2 is llama with q/k/v biases and NeoX rotary pairing, and llama.cpp's llama
graph loads q/k/v biases, so the same weights run as llama once the rows of q and k (weights and
biases) are reordered from NeoX pairing (i, i + d/2) to llama's (2i, 2i + 1) within each head.
Rows are whole quantization blocks along the input dimension, so quantized tensors are reordered
byte-exactly. Usage:

    python scripts/qwen2_as_llama.py qwen2.5-coder-1.5b-instruct.gguf /tmp/qwen-as-llama.gguf
"""
from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter

from speculant.gguf import copy_fields, field_value


def neox_to_norm(n_rows: int, head_dim: int) -> np.ndarray:
    """Source row of each destination row: dest 2i <- src i, dest 2i+1 <- src i + d/2, per head."""
    half = head_dim // 2
    within = np.empty(head_dim, dtype=np.int64)
    within[0::2] = np.arange(half)
    within[1::2] = np.arange(half) + half
    heads = n_rows // head_dim
    return (np.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    arch = field_value(r.fields["general.architecture"])[0]
    if arch != "qwen2":
        raise SystemExit(f"{src}: architecture {arch}, expected qwen2")
    n_head = field_value(r.fields["qwen2.attention.head_count"])[0]
    n_embd = field_value(r.fields["qwen2.embedding_length"])[0]
    head_dim = n_embd // n_head
    w = GGUFWriter(dst, "llama")
    copy_fields(r, w, keep=lambda name: name != "general.architecture",
                rename=lambda name: name.replace("qwen2.", "llama.", 1) if name.startswith("qwen2.") else name)
    w.add_uint32("llama.rope.dimension_count", head_dim)
    for t in r.tensors:
        data = np.asarray(t.data)
        if any(t.name.endswith(s) for s in (".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias")):
            data = data[neox_to_norm(data.shape[0], head_dim)]
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
