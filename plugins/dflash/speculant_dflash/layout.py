"""llama.cpp's `dflash` GGUF layout: the drafter's hyperparameters, tensor names, and writing a file.

Mirrors llama.cpp (`src/models/dflash.cpp`, `conversion/qwen.py` DFlashModel): architecture
`dflash`, Qwen3-style keys under that prefix (`dflash.embedding_length`, `.block_count`,
`.feed_forward_length`, `.attention.head_count[_kv]`, `.attention.key_length`,
`.attention.layer_norm_rms_epsilon`, `.rope.freq_base`, `.rope.dimension_count`, ...), plus

    dflash.target_layers          the target layers whose *input* is tapped: HF `target_layer_ids`
                                  + 1 (llama.cpp captures layer inputs); required
    dflash.block_size             B, the block [last token, MASK x (B-1)] (default 16)
    tokenizer.ggml.mask_token_id  the MASK token (required here: llama.cpp drafts garbage without it)
    dflash.attention.causal       bool, optional (default false: the block attends both ways)

and what llama.cpp reads optionally: `embedding_scale`, `attention.scale`,
`attention.value_scale`, `hidden_activation` (silu, gelu), `logit_scale`,
`final_logit_softcapping`, `attention.sliding_window` (+ `_pattern`), `rope.dimension_sections`
(the degenerate M-RoPE sections [n_rot/2, 0, 0, 0] of drafts for M-RoPE targets: on text the same
rotation as NeoX).

Tensors: `fc` [K*n_embd -> n_embd] (optional scalar `fc.scale`), `enc.output_norm` (the hidden
norm applied after fc), per layer `blk.N.attn_norm`, `attn_q`, `attn_k`, `attn_v` (optional: K
shared as V), `attn_output`, `attn_q_norm`, `attn_k_norm` (per head), `ffn_norm`, `ffn_gate`,
`ffn_up`, `ffn_down`; optional per layer `post_attention_norm`, `post_ffw_norm`,
`layer_output_scale`, `attn_sinks`, scalar `*.scale` beside every matrix; `rope_freqs`,
`output_norm`; optional `token_embd`, `output` (else the target's are borrowed, as llama.cpp does)
and `d2t` (int64: the target id of every row of the head's own reduced `output`).
The rotary embedding is NeoX-style. DFlash2 (selector lattice), DSpark (Markov head) and the
DeepSeek-V4 DSpark backbone are other drafters in the same architecture; this module refuses them
by name.
"""
from __future__ import annotations

import attrs
import numpy as np

from speculant import ModelFileError

ARCH = "dflash"
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL_LAYER_TENSORS = ("attn_v", "post_attention_norm", "post_ffw_norm", "layer_output_scale", "attn_sinks")
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@attrs.frozen
class DFlashConfig:
    n_embd: int
    n_layers: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_draft_vocab: int  # rows of the head's own output (the target's vocabulary without d2t)
    n_target_vocab: int
    target_layers: tuple[int, ...]  # llama.cpp's ids: the *input* of these target layers
    block_size: int = 16
    mask_token_id: int = 0
    eps: float = 1e-6
    rope_base: float = 10000.0
    n_rot: int = 0  # rotary dimensions (0: head_dim)
    rope_scale: float = 1.0  # linear scaling factor: positions / rope_scale
    n_ctx: int = 32768
    causal: bool = False
    embedding_scale: float = 0.0  # 0: none
    attention_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    value_scale: float = 0.0  # 0: none
    activation: str = "silu"  # or "gelu" (tanh approximation, as ggml)
    logit_scale: float = 0.0
    softcap: float = 0.0
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()

    @property
    def n_taps(self) -> int:
        return len(self.target_layers)

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim

    def is_swa(self, layer: int) -> bool:
        return self.n_swa > 0 and layer < len(self.swa_layers) and bool(self.swa_layers[layer])


def default_target_layers(n_layers: int, n_taps: int = 3) -> tuple[int, ...]:
    """DFlash's choice (z-lab `build_target_layer_ids`): n_taps HF layers spread evenly over
    [1, N-3], one tap at N//2 alone; returned as llama.cpp's ids (HF + 1). Shallow test models get
    distinct layers spread over HF [0, N-2]: llama.cpp exports the inputs of layers 0..N-1 only
    (most of its graphs have no input of a layer N)."""
    if n_taps == 1:
        hf = [n_layers // 2]
    else:
        start, end = (1, n_layers - 3) if n_layers >= 6 else (0, max(0, n_layers - 2))
        hf = [int(round(start + i * (end - start) / (n_taps - 1))) for i in range(n_taps)]
    return tuple(sorted(set(h + 1 for h in hf)))


def _scalar_or_uniform(gguf, key, default=None):
    value = gguf.arch_key(key, default)
    if value is None:
        raise ModelFileError(f"{gguf.path}: metadata '{ARCH}.{key}' is missing")
    if isinstance(value, (list, tuple)):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise ModelFileError(f"{gguf.path}: per-layer '{ARCH}.{key}' {list(value)} is not supported for a DFlash drafter")
        return values.pop()
    return value


def read_config(gguf) -> DFlashConfig:
    """The drafter's hyperparameters from an opened GGUF (speculant.gguf.open_gguf), checked."""
    def need(key):
        value = gguf.arch_key(key)
        if value is None:
            raise ModelFileError(f"{gguf.path}: metadata '{ARCH}.{key}' is missing")
        return value

    for tensor, what in (("markov_w1.weight", "a DSpark drafter (--spec-type draft-dspark in llama.cpp)"),
                         ("selector_hidden.weight", "a DFlash2 drafter (selector lattice)")):
        if tensor in gguf.tensors:
            raise ModelFileError(f"{gguf.path}: {what}; speculant runs DFlash drafters only")
    if gguf.arch_key("hyper_connection.count"):
        raise ModelFileError(f"{gguf.path}: a DeepSeek-V4 DSpark drafter; speculant runs DFlash drafters only")
    layers = gguf.arch_key("target_layers")
    if layers is None:
        raise ModelFileError(f"{gguf.path}: DFlash model requires '{ARCH}.target_layers' in GGUF metadata")
    try:
        layers = tuple(int(x) for x in (layers if isinstance(layers, (list, tuple)) else [layers]))
    except (TypeError, ValueError):
        raise ModelFileError(f"{gguf.path}: '{ARCH}.target_layers' must be a list of integers") from None
    if not layers:
        raise ModelFileError(f"{gguf.path}: '{ARCH}.target_layers' is empty")
    mask = gguf.metadata.get("tokenizer.ggml.mask_token_id")
    if mask is None:
        raise ModelFileError(f"{gguf.path}: 'tokenizer.ggml.mask_token_id' is missing (the DFlash MASK token)")
    n_embd, n_head = int(need("embedding_length")), int(_scalar_or_uniform(gguf, "attention.head_count"))
    n_kv = int(_scalar_or_uniform(gguf, "attention.head_count_kv", n_head))
    n_layers = int(need("block_count"))
    if n_embd <= 0 or n_head <= 0 or n_kv <= 0 or n_head % n_kv or n_layers <= 0:
        raise ModelFileError(f"{gguf.path}: bad shape (n_embd {n_embd}, heads {n_head}, kv heads {n_kv}, layers {n_layers})")
    head_dim = int(gguf.arch_key("attention.key_length", n_embd // n_head))
    if int(gguf.arch_key("attention.value_length", head_dim)) != head_dim:
        raise ModelFileError(f"{gguf.path}: DFlash needs equal key and value head sizes")
    n_rot = int(gguf.arch_key("rope.dimension_count", head_dim))
    if n_rot > head_dim or n_rot % 2:
        raise ModelFileError(f"{gguf.path}: rope.dimension_count {n_rot} does not fit head size {head_dim}")
    sections = gguf.arch_key("rope.dimension_sections")
    if sections is not None and any(int(s) for s in list(sections)[1:]):
        raise ModelFileError(f"{gguf.path}: M-RoPE sections {list(sections)}: a DFlash drafter rotates the temporal dimension only")
    act = gguf.arch_key("hidden_activation", "silu")
    if act in ("gelu", "gelu_pytorch_tanh"):
        act = "gelu"
    elif act != "silu":
        raise ModelFileError(f"{gguf.path}: unsupported DFlash hidden activation: {act}")
    scale_type = gguf.arch_key("rope.scaling.type", "none")
    if scale_type not in ("none", "linear"):
        raise ModelFileError(f"{gguf.path}: rope scaling '{scale_type}' is not supported for a DFlash drafter")
    factor = float(gguf.arch_key("rope.scaling.factor", 1.0) or 1.0) if scale_type == "linear" else 1.0
    out = gguf.tensors.get("output.weight")
    d2t = gguf.tensors.get("d2t")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    n_target_vocab = int(gguf.arch_key("vocab_size", len(tokens) if tokens is not None else 0))
    n_draft = d2t.shape[0] if d2t is not None else (out.shape[0] if out is not None else n_target_vocab)
    n_swa = int(gguf.arch_key("attention.sliding_window", 0) or 0)
    pattern = gguf.arch_key("attention.sliding_window_pattern")
    if n_swa and pattern is None:
        swa_layers = (True,) * n_layers
    elif isinstance(pattern, (list, tuple)):
        swa_layers = tuple(bool(p) for p in pattern)
    else:
        swa_layers = ()
    block = int(gguf.arch_key("block_size", 16))
    if block < 2:
        raise ModelFileError(f"{gguf.path}: '{ARCH}.block_size' {block}: a block needs the last token and a MASK at least")
    return DFlashConfig(
        n_embd=n_embd, n_layers=n_layers, n_head=n_head, n_kv_head=n_kv, head_dim=head_dim,
        n_ff=int(_scalar_or_uniform(gguf, "feed_forward_length")), n_draft_vocab=int(n_draft), n_target_vocab=n_target_vocab,
        target_layers=layers, block_size=block, mask_token_id=int(mask),
        eps=float(need("attention.layer_norm_rms_epsilon")), rope_base=float(gguf.arch_key("rope.freq_base", 10000.0)),
        n_rot=n_rot if n_rot != head_dim else 0, rope_scale=factor or 1.0,
        n_ctx=int(gguf.arch_key("context_length", 32768)), causal=bool(gguf.arch_key("attention.causal", False)),
        embedding_scale=float(gguf.arch_key("embedding_scale", 0.0) or 0.0),
        attention_scale=float(gguf.arch_key("attention.scale", 0.0) or 0.0),
        value_scale=float(gguf.arch_key("attention.value_scale", 0.0) or 0.0), activation=act,
        logit_scale=float(gguf.arch_key("logit_scale", 0.0) or 0.0),
        softcap=float(gguf.arch_key("final_logit_softcapping", 0.0) or 0.0), n_swa=n_swa, swa_layers=swa_layers,
    )


def expected_shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the layout and its shape in PyTorch order (rows, columns), from the
    hyperparameters (layer tensors under `blk.{i}.`)."""
    d, q, kv = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
             "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,), "post_attention_norm": (d,),
             "post_ffw_norm": (d,), "layer_output_scale": (1,), "attn_sinks": (c.n_head,), "ffn_norm": (d,),
             "ffn_gate": (c.n_ff, d), "ffn_up": (c.n_ff, d), "ffn_down": (d, c.n_ff)}
    shapes = {"fc.weight": (d, c.n_taps * d), "fc.scale": (1,), "enc.output_norm.weight": (d,), "output_norm.weight": (d,),
              "output.weight": (c.n_draft_vocab, d), "output.scale": (1,), "token_embd.weight": (c.n_target_vocab, d),
              "d2t": (c.n_draft_vocab,), "rope_freqs.weight": (c.rot // 2,)}
    for i in range(c.n_layers):
        for t, shape in layer.items():
            shapes[f"blk.{i}.{t}.weight"] = shape
        for t in MATRICES:
            shapes[f"blk.{i}.{t}.scale"] = (1,)
    return shapes


def _copy_tokenizer(writer, target_path: str) -> None:
    """Copy the target's tokenizer.* keys (llama.cpp reads the draft's own vocabulary and checks
    it against the target's), except a mask token id of its own."""
    from gguf import GGUFReader

    from speculant.gguf import copy_fields

    copy_fields(GGUFReader(target_path), writer,
                keep=lambda name: name.startswith("tokenizer.") and name != "tokenizer.ggml.mask_token_id")


def write_head(path: str, cfg: DFlashConfig, weights: dict[str, np.ndarray], *, target_path: str | None = None,
               d2t: np.ndarray | None = None, qtype: str = "F16", name: str = "speculant dflash drafter",
               extra: dict[str, str] | None = None) -> None:
    """Write a drafter in llama.cpp's layout. `weights` maps GGUF tensor names to float arrays in
    PyTorch order ([out, in] for matrices); matrices are stored as `qtype` (F32, F16, Q8_0, ...),
    norms as F32. `target_path`: the target GGUF whose tokenizer is copied."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rot)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(cfg.n_target_vocab)
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    w.add_array(f"{ARCH}.target_layers", [int(x) for x in cfg.target_layers])
    w.add_bool(f"{ARCH}.attention.causal", cfg.causal)
    if cfg.embedding_scale:
        w.add_float32(f"{ARCH}.embedding_scale", cfg.embedding_scale)
    if cfg.attention_scale:
        w.add_float32(f"{ARCH}.attention.scale", cfg.attention_scale)
    if cfg.value_scale:
        w.add_float32(f"{ARCH}.attention.value_scale", cfg.value_scale)
    if cfg.logit_scale:
        w.add_float32(f"{ARCH}.logit_scale", cfg.logit_scale)
    if cfg.softcap:
        w.add_float32(f"{ARCH}.final_logit_softcapping", cfg.softcap)
    if cfg.n_swa:
        w.add_uint32(f"{ARCH}.attention.sliding_window", cfg.n_swa)
        w.add_array(f"{ARCH}.attention.sliding_window_pattern", [bool(cfg.is_swa(i)) for i in range(cfg.n_layers)])
    if cfg.activation != "silu":
        w.add_string(f"{ARCH}.hidden_activation", cfg.activation)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    if target_path is not None:
        _copy_tokenizer(w, target_path)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
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
