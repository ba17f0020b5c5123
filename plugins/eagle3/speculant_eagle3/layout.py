"""llama.cpp's `eagle3` GGUF layout: the head's hyperparameters, tensor names, and writing a file.

Mirrors llama.cpp (`src/models/eagle3.cpp`, `conversion/llama.py`): architecture `eagle3`, the
llama-style keys under that prefix (`eagle3.embedding_length`, `.block_count` = 1, ...), plus

    eagle3.target_layers         the 3 target layers whose *input* residual stream is tapped
                                 (HF ids; an id equal to the target's layer count means its final
                                 hidden state)
    eagle3.target_hidden_size    the target's n_embd
    eagle3.norm_before_residual  bool, optional (default false)
    eagle3.norm_before_fc        bool, optional (default false; then enc.output_norm exists)

Tensors: `fc` [3*n_embd_tgt -> n_embd], `blk.0.attn_norm` (token-embedding side),
`blk.0.attn_norm_2` (the fused-feature side), `blk.0.attn_{q,k,v}` taking 2*n_embd inputs,
`blk.0.attn_output`, `blk.0.ffn_{norm,gate,up,down}`, `output_norm`; optional `output` (an lm_head
over the draft vocabulary), `token_embd` (else both borrowed from the target) and `d2t` (int64,
the absolute target id of every draft-vocabulary row). The tokenizer is the target's, copied.
llama.cpp computes the head's rotary embedding in the original (non-NeoX) pairing.
"""
from __future__ import annotations

import attrs
import numpy as np

from speculant import ModelFileError

ARCH = "eagle3"
LAYER_TENSORS = ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@attrs.frozen
class HeadConfig:
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_draft_vocab: int  # rows of the head's lm_head (the target's vocabulary without d2t)
    n_target_vocab: int
    target_layers: tuple[int, int, int]
    target_hidden: int
    eps: float = 1e-6
    rope_base: float = 10000.0
    n_ctx: int = 32768
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    @property
    def n_taps(self) -> int:
        return len(self.target_layers)


def default_target_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE3's choice, [2, L//2, L-3] (llama.cpp's converter default); shallow test models get
    three distinct layers that exist."""
    if n_layers >= 6:
        return (2, n_layers // 2, n_layers - 3)
    return (1, max(1, n_layers // 2), max(1, n_layers - 1))


def read_config(gguf) -> HeadConfig:
    """The head's hyperparameters from an opened GGUF (speculant.gguf.open_gguf), checked."""
    def need(key):
        value = gguf.arch_key(key)
        if value is None:
            raise ModelFileError(f"{gguf.path}: metadata '{ARCH}.{key}' is missing")
        return value

    layers = need("target_layers")
    try:
        layers = tuple(int(x) for x in layers)
    except (TypeError, ValueError):
        raise ModelFileError(f"{gguf.path}: '{ARCH}.target_layers' must be a list of 3 integers") from None
    if len(layers) != 3:
        raise ModelFileError(f"{gguf.path}: EAGLE3 requires exactly 3 entries in '{ARCH}.target_layers', got {len(layers)}")
    if int(need("block_count")) != 1:
        raise ModelFileError(f"{gguf.path}: an EAGLE3 head has one decoder layer, this file has {need('block_count')}")
    n_embd, n_head = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(gguf.arch_key("attention.head_count_kv", n_head))
    if n_embd <= 0 or n_head <= 0 or n_kv <= 0 or n_head % n_kv:
        raise ModelFileError(f"{gguf.path}: bad attention shape (n_embd {n_embd}, heads {n_head}, kv heads {n_kv})")
    head_dim = int(gguf.arch_key("attention.key_length", gguf.arch_key("rope.dimension_count", n_embd // n_head)))
    out = gguf.tensors.get("output.weight")
    d2t = gguf.tensors.get("d2t")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    n_target_vocab = int(gguf.arch_key("vocab_size", len(tokens) if tokens is not None else 0))
    n_draft = d2t.shape[0] if d2t is not None else (out.shape[0] if out is not None else n_target_vocab)
    return HeadConfig(
        n_embd=n_embd, n_head=n_head, n_kv_head=n_kv, head_dim=head_dim, n_ff=int(need("feed_forward_length")),
        n_draft_vocab=int(n_draft), n_target_vocab=n_target_vocab, target_layers=layers,
        target_hidden=int(need("target_hidden_size")), eps=float(gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(gguf.arch_key("rope.freq_base", 10000.0)), n_ctx=int(gguf.arch_key("context_length", 32768)),
        norm_before_residual=bool(gguf.arch_key("norm_before_residual", False)),
        norm_before_fc=bool(gguf.arch_key("norm_before_fc", False)),
    )


def expected_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the layout and its shape in PyTorch order (rows, columns), from the
    hyperparameters: q/k/v read [embedding; g], 2 * n_embd wide; fc reads the three taps."""
    d, q, kv = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    layer = {"attn_norm": (d,), "attn_norm_2": (d,), "attn_q": (q, 2 * d), "attn_k": (kv, 2 * d),
             "attn_v": (kv, 2 * d), "attn_output": (d, q), "ffn_norm": (d,), "ffn_gate": (c.n_ff, d),
             "ffn_up": (c.n_ff, d), "ffn_down": (d, c.n_ff)}
    return {"fc.weight": (d, 3 * c.target_hidden), "enc.output_norm.weight": (3 * c.target_hidden,),
            **{f"blk.0.{t}.weight": shape for t, shape in layer.items()},
            "output_norm.weight": (d,), "output.weight": (c.n_draft_vocab, d),
            "token_embd.weight": (c.n_target_vocab, d), "d2t": (c.n_draft_vocab,)}


def _copy_tokenizer(writer, target_path: str) -> None:
    """Copy the target's tokenizer.* keys (llama.cpp reads the draft's own vocabulary and checks it)."""
    from gguf import GGUFReader

    from speculant.gguf import copy_fields

    copy_fields(GGUFReader(target_path), writer, keep=lambda name: name.startswith("tokenizer."))


def write_head(path: str, cfg: HeadConfig, weights: dict[str, np.ndarray], *, target_path: str | None = None,
               d2t: np.ndarray | None = None, qtype: str = "F16", name: str = "speculant eagle3 head",
               extra: dict[str, str] | None = None) -> None:
    """Write a head in llama.cpp's layout. `weights` maps GGUF tensor names to float arrays in
    PyTorch order ([out, in] for matrices); matrices are stored as `qtype` (F32, F16, Q8_0, ...),
    norms as F32. `target_path`: the target GGUF whose tokenizer is copied."""
    from gguf import GGUFWriter, GGMLQuantizationType
    from gguf.quants import quantize

    w = GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(cfg.n_target_vocab)
    w.add_array(f"{ARCH}.target_layers", [int(x) for x in cfg.target_layers])
    w.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden)
    w.add_bool(f"{ARCH}.norm_before_residual", cfg.norm_before_residual)
    w.add_bool(f"{ARCH}.norm_before_fc", cfg.norm_before_fc)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    if target_path is not None:
        _copy_tokenizer(w, target_path)
    q = GGMLQuantizationType[qtype]
    for tname, arr in weights.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or q == GGMLQuantizationType.F32:
            w.add_tensor(tname, arr)
        elif q == GGMLQuantizationType.F16:
            w.add_tensor(tname, arr.astype(np.float16))
        else:
            w.add_tensor(tname, quantize(arr, q), raw_dtype=q)
    if d2t is not None:
        w.add_tensor("d2t", np.ascontiguousarray(d2t, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
