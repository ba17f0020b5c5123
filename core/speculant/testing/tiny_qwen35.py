"""Tiny random Qwen3.5 (`qwen35`) GGUF models: `write_tiny_model(path, "qwen35", ...)` comes here.

The keys and tensors llama.cpp's converter writes for Qwen3.5 (conversion/qwen.py: TextModel's
keys, then Qwen3NextModel's ssm.* / full_attention_interval / rope.dimension_count, the Qwen3.5
rope.dimension_sections, and nextn_predict_layers with the MTP block) and its loader reads
(src/models/qwen35.cpp):

    qwen35.block_count (trunk + NextN layers), context_length, embedding_length,
    feed_forward_length, attention.head_count, attention.head_count_kv, rope.freq_base,
    attention.layer_norm_rms_epsilon, attention.key_length / value_length, ssm.conv_kernel,
    ssm.state_size, ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.inner_size,
    [attention.recurrent_layers], full_attention_interval, rope.dimension_count (a quarter of the
    head size, as Qwen3.5's partial_rotary_factor), rope.dimension_sections, [nextn_predict_layers]

    token_embd, output_norm, output (unless tied); per trunk layer attn_norm,
    post_attention_norm, ffn_{gate,up,down} and either
      Gated DeltaNet: attn_qkv, attn_gate, ssm_conv1d (F32 [conv_dim, d_conv]), ssm_dt.bias,
                      ssm_a (-exp(A_log), F32), ssm_beta, ssm_alpha, ssm_norm, ssm_out
      gated attention: attn_q (query and gate per head: 2 * n_head * head_dim rows), attn_k,
                      attn_v, attn_q_norm, attn_k_norm, attn_output;
    per NextN layer the attention layer's tensors plus nextn.eh_proj, nextn.enorm, nextn.hnorm
    and nextn.shared_head_norm (what the converter maps Qwen3.5's mtp.* to; no embed_tokens or
    shared_head_head: the trunk's are shared).

Weights are deterministic per (seed, tensor name, shape) as in tiny_gguf. ssm_a is -exp(N(-1, 0.5))
and ssm_dt.bias N(0, 0.5), so the per-token decay exp(g) is ~0.5-0.9: the recurrent state carries
several tokens, and a wrong rollback shows in the next logits.
"""
from __future__ import annotations

import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType, GGUFWriter

DEFAULTS = dict(rope_theta=10_000_000.0, rms_eps=1e-6)  # Qwen3.5's config values


def default_sections(n_rot: int) -> list[int]:
    """The IMROPE sections over n_rot / 2 rotary pairs split as Qwen3.5's [11, 11, 10] split 32."""
    s = n_rot // 2
    t = -(-s // 3)
    h = -(-(s - t) // 2)
    return [t, h, s - t - h, 0]


def recurrent_pattern(n_layers: int, full_attention_interval: int) -> list[bool]:
    return [(i + 1) % full_attention_interval != 0 for i in range(n_layers)]


def _plan(tg, *, n_vocab, n_embd, n_layers, n_nextn, recurrent, n_head, n_kv_head, head_dim, n_ff, d_state, n_k_heads,
          n_v_heads, d_conv, tie):
    """(name, numpy shape (out, in), kind, std, mean) in file order; kinds as tiny_gguf's plus
    'conv' (F32) and 'neg_exp' (F32, -exp(mean + std * N))."""
    inv = 1.0 / np.sqrt(n_embd)
    q_dim, kv_dim = n_head * head_dim, n_kv_head * head_dim
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    embd_std, out_norm = (tg._TIED_GAIN / n_embd, 3.0 * np.sqrt(n_embd) / tg._TIED_GAIN) if tie else (1.0, 1.0)
    plan = [("token_embd.weight", (n_vocab, n_embd), "embd", embd_std, 0.0)]

    def attention(b):
        return [(f"{b}.attn_q.weight", (2 * q_dim, n_embd), "linear", inv, 0.0),
                (f"{b}.attn_k.weight", (kv_dim, n_embd), "linear", inv, 0.0),
                (f"{b}.attn_v.weight", (kv_dim, n_embd), "linear", inv, 0.0),
                (f"{b}.attn_q_norm.weight", (head_dim,), "norm", 0.1, 1.0),
                (f"{b}.attn_k_norm.weight", (head_dim,), "norm", 0.1, 1.0),
                (f"{b}.attn_output.weight", (n_embd, q_dim), "linear", 0.5 / np.sqrt(q_dim), 0.0)]

    def delta_net(b):
        return [(f"{b}.attn_qkv.weight", (conv_dim, n_embd), "linear", inv, 0.0),
                (f"{b}.attn_gate.weight", (value_dim, n_embd), "linear", inv, 0.0),
                (f"{b}.ssm_conv1d.weight", (conv_dim, d_conv), "conv", 1.0 / np.sqrt(d_conv), 0.0),
                (f"{b}.ssm_dt.bias", (n_v_heads,), "bias", 0.5, 0.0),
                (f"{b}.ssm_a", (n_v_heads,), "neg_exp", 0.5, -1.0),
                (f"{b}.ssm_beta.weight", (n_v_heads, n_embd), "linear", inv, 0.0),
                (f"{b}.ssm_alpha.weight", (n_v_heads, n_embd), "linear", inv, 0.0),
                (f"{b}.ssm_norm.weight", (d_state,), "norm", 0.1, 1.0),
                (f"{b}.ssm_out.weight", (n_embd, value_dim), "linear", 0.5 / np.sqrt(value_dim), 0.0)]

    def ffn(b):
        return [(f"{b}.post_attention_norm.weight", (n_embd,), "norm", 0.1, 1.0),
                (f"{b}.ffn_gate.weight", (n_ff, n_embd), "linear", inv, 0.0),
                (f"{b}.ffn_up.weight", (n_ff, n_embd), "linear", inv, 0.0),
                (f"{b}.ffn_down.weight", (n_embd, n_ff), "linear", 0.5 / np.sqrt(n_ff), 0.0)]

    for i in range(n_layers + n_nextn):
        b = f"blk.{i}"
        plan.append((f"{b}.attn_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        plan += delta_net(b) if i < n_layers and recurrent[i] else attention(b)
        plan += ffn(b)
        if i >= n_layers:
            plan += [(f"{b}.nextn.eh_proj.weight", (n_embd, 2 * n_embd), "linear", 1.0 / np.sqrt(2 * n_embd), 0.0),
                     (f"{b}.nextn.enorm.weight", (n_embd,), "norm", 0.1, 1.0),
                     (f"{b}.nextn.hnorm.weight", (n_embd,), "norm", 0.1, 1.0),
                     (f"{b}.nextn.shared_head_norm.weight", (n_embd,), "norm", 0.1 * out_norm, out_norm)]
    plan.append(("output_norm.weight", (n_embd,), "norm", 0.1 * out_norm, out_norm))
    if not tie:
        plan.append(("output.weight", (n_vocab, n_embd), "embd", 3.0 * inv, 0.0))
    return plan


def write_qwen35(path: str | os.PathLike, tg, *, qtype: str | GGMLQuantizationType = "F32", seed: int = 0,
                 n_vocab: int = 512, n_embd: int = 64, n_layers: int = 4, n_head: int = 4, n_kv_head: int = 2,
                 head_dim: int | None = None, n_ff: int = 128, n_ctx: int = 256, tokenizer: str = "gpt2",
                 tie_embeddings: bool | None = None, embd_qtype: str | GGMLQuantizationType | None = None,
                 rope_theta: float | None = None, rms_eps: float | None = None, name: str | None = None,
                 full_attention_interval: int = 4, recurrent_layers: list[bool] | None = None,
                 ssm_d_state: int = 16, ssm_n_group: int = 2, ssm_dt_rank: int = 4, ssm_d_conv: int = 4,
                 n_rot: int | None = None, rope_sections: list[int] | None = None, nextn_layers: int = 0,
                 qtype_overrides: dict[str, str] | None = None) -> str:
    """Write a tiny random Qwen3.5 model; returns the path as str. `tg` is the tiny_gguf module
    (its quantizers, tokenizer metadata and per-tensor random streams; write_tiny_model passes it,
    so that this module imports none of it: no import cycle).

    n_layers counts the trunk (block_count is n_layers + nextn_layers). The recurrent layers are
    every layer but each full_attention_interval-th (written as `full_attention_interval`), or
    `recurrent_layers` (then also written as `attention.recurrent_layers`, as the converter does
    for configs with layer_types). ssm_d_state is the key and value head size of the DeltaNet
    layers, ssm_n_group its key heads, ssm_dt_rank its value heads (a multiple of the key heads).
    n_rot defaults to head_dim / 4 (even), rope_sections to Qwen3.5's proportions of its pairs.
    K-quants need n_embd, n_ff, n_head * head_dim and ssm_d_state * ssm_dt_rank multiples of 256.
    qtype_overrides: {name part: qtype} for the quantized tensors whose name contains the part
    (the first that matches), as llama-quantize's mixes keep some tensors at other types.
    """
    vocab = tg.tiny_vocab(tokenizer, n_vocab)
    wq, eq = tg._as_qtype(qtype), tg._as_qtype(qtype if embd_qtype is None else embd_qtype)
    if head_dim is None:
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}; pass head_dim")
        head_dim = n_embd // n_head
    if n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
    if ssm_dt_rank % ssm_n_group:
        raise ValueError(f"ssm_dt_rank={ssm_dt_rank} (value heads) is not a multiple of ssm_n_group={ssm_n_group}")
    if n_rot is None:
        n_rot = max(2, head_dim // 4 // 2 * 2)
    if n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"n_rot={n_rot} must be even and at most head_dim={head_dim}")
    sections = default_sections(n_rot) if rope_sections is None else list(rope_sections) + [0] * (4 - len(rope_sections))
    if sum(sections) > head_dim:
        raise ValueError(f"rope_sections {sections} add up to more than head_dim={head_dim} (ggml asserts it)")
    if recurrent_layers is None:
        recurrent = recurrent_pattern(n_layers, full_attention_interval)
    else:
        recurrent = [bool(r) for r in recurrent_layers]
        if len(recurrent) != n_layers:
            raise ValueError(f"recurrent_layers has {len(recurrent)} entries for {n_layers} layers")
    tie = False if tie_embeddings is None else bool(tie_embeddings)
    rope_theta = DEFAULTS["rope_theta"] if rope_theta is None else float(rope_theta)
    rms_eps = DEFAULTS["rms_eps"] if rms_eps is None else float(rms_eps)

    plan = _plan(tg, n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, n_nextn=nextn_layers, recurrent=recurrent,
                 n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, n_ff=n_ff, d_state=ssm_d_state,
                 n_k_heads=ssm_n_group, n_v_heads=ssm_dt_rank, d_conv=ssm_d_conv, tie=tie)
    overrides = {part: tg._as_qtype(q) for part, q in (qtype_overrides or {}).items()}

    def qtype_of(tname: str, kind: str):
        if kind not in ("embd", "linear"):
            return None
        return next((q for part, q in overrides.items() if part in tname), eq if kind == "embd" else wq)

    for tname, shape, kind, _, _ in plan:
        qt = qtype_of(tname, kind)
        if qt is not None and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
            raise ValueError(f"{tname}: row length {shape[-1]} is not a multiple of the {qt.name} block size "
                             f"{gguf.GGML_QUANT_SIZES[qt][0]}")

    path = os.fspath(path)
    w = GGUFWriter(path, "qwen35")
    w.add_type("model")
    w.add_name(name or f"Tiny qwen35 test model (seed {seed})")
    w.add_block_count(n_layers + nextn_layers)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(tg._FILE_TYPES[wq.name])
    w.add_ssm_conv_kernel(ssm_d_conv)
    w.add_ssm_state_size(ssm_d_state)
    w.add_ssm_group_count(ssm_n_group)
    w.add_ssm_time_step_rank(ssm_dt_rank)
    w.add_ssm_inner_size(ssm_d_state * ssm_dt_rank)
    if recurrent_layers is not None:
        w.add_array("qwen35.attention.recurrent_layers", recurrent + [False] * nextn_layers)
    w.add_uint32("qwen35.full_attention_interval", full_attention_interval)
    w.add_rope_dimension_count(n_rot)
    w.add_array("qwen35.rope.dimension_sections", sections)
    if nextn_layers:
        w.add_uint32("qwen35.nextn_predict_layers", nextn_layers)
    tg._add_tokenizer(w, vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for tname, shape, kind, std, mean in plan:
        x = tg._rng(seed, tname).standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        if kind == "neg_exp":
            w.add_tensor(tname, -np.exp(x))
        elif kind in ("norm", "bias", "conv"):
            w.add_tensor(tname, x)
        else:
            qt = qtype_of(tname, kind)
            data = tg.quantize(x, qt)
            w.add_tensor(tname, data, raw_dtype=qt) if data.dtype == np.uint8 else w.add_tensor(tname, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
