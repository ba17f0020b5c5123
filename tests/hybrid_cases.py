"""The small random hybrid models checked against llama.cpp (scripts/hybrid_references.py
writes each case's GGUF with `write_tiny_model(path, arch, **writer)`, runs llama-server on it and
stores its greedy tokens and top log-probabilities in tests/data/llamacpp-outputs/hybrid/NAME.json).

A case: {"name", "arch", "writer": write_tiny_model kwargs, "prompts": token-id lists, "n_predict"}.
"""
from __future__ import annotations

# LFM2: conv and attention blocks in several orders, three weight types. llama-server feeds a
# hybrid model's prompt of n > 4 tokens as two batches, n-4 rows and then 4 (a context checkpoint
# 4 tokens before its end); K-quants' prompt arithmetic depends on the batch, which our models
# follow (the *-odd-prompts cases below). Q8_0 and F32 compute prompt rows as decode rows.
_P = [
    [5, 77, 300, 12, 9, 44, 123, 8],
    [100, 101, 102, 103],
    [42, 7, 7, 42, 7, 7, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263],
    [331],
]
LFM2_CASES: list[dict] = [
    {"name": "lfm2-f32", "arch": "lfm2", "n_predict": 24, "prompts": _P,
     "writer": {"qtype": "F32", "seed": 11, "n_layers": 4}},  # conv, attn, conv, attn
    {"name": "lfm2-q8_0", "arch": "lfm2", "n_predict": 24,
     "prompts": _P + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 98, 97, 96, 95]],
     "writer": {"qtype": "Q8_0", "seed": 12, "n_layers": 5, "attn_layers": [2, 4], "n_ff": 192}},
    {"name": "lfm2-q8_0-conv-last", "arch": "lfm2", "n_predict": 24, "prompts": _P + [[1, 2, 3, 4, 5, 6, 7]],
     "writer": {"qtype": "Q8_0", "seed": 13, "n_layers": 4, "attn_layers": [0, 2], "l_cache": 4,
                "tie_embeddings": False}},
    {"name": "lfm2-q4_k", "arch": "lfm2", "n_predict": 24, "prompts": _P,
     "writer": {"qtype": "Q4_K", "seed": 14, "n_layers": 4, "attn_layers": [1, 3], "n_embd": 256, "n_ff": 512,
                "n_head": 4, "n_kv_head": 2}},
    {"name": "lfm2-q8_0-swa", "arch": "lfm2", "n_predict": 32, "prompts": _P[:3],
     "writer": {"qtype": "Q8_0", "seed": 15, "n_layers": 4, "sliding_window": 6}},
]

# Qwen3.5: DeltaNet and attention layers in several orders (full_attention_interval and the
# recurrent_layers array), value heads tiling key heads, an IMROPE section left unrotated, a NextN
# block (loaded, not run), tied embeddings, head sizes below and above ggml's 64-value dot step.
# (Prompt lengths of any kind: see the *-odd-prompts cases.)
_Q = [
    [5, 77, 300, 12, 9, 44, 123, 8],
    [100, 101, 102, 103],
    [42, 7, 7, 42, 7, 7, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263],
    [331],
]
_Q_ODD = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 98, 97, 96, 95], [1, 2, 3, 4, 5, 6, 7]]
QWEN35_CASES: list[dict] = [
    {"name": "qwen35-f32", "arch": "qwen35", "n_predict": 24, "prompts": _Q + _Q_ODD[1:],
     "writer": {"qtype": "F32", "seed": 21, "n_layers": 4}},  # delta, delta, delta, attention
    {"name": "qwen35-q8_0", "arch": "qwen35", "n_predict": 32, "prompts": _Q + _Q_ODD,
     "writer": {"qtype": "Q8_0", "seed": 22, "n_layers": 5, "recurrent_layers": [True, False, True, True, False],
                "head_dim": 32, "n_rot": 8, "rope_sections": [1, 1, 1, 1], "nextn_layers": 1,
                "tie_embeddings": True}},
    {"name": "qwen35-q8_0-wide-state", "arch": "qwen35", "n_predict": 24, "prompts": _Q[:3] + _Q_ODD[1:],
     "writer": {"qtype": "Q8_0", "seed": 23, "n_layers": 4, "full_attention_interval": 2, "n_embd": 128,
                "n_ff": 256, "n_head": 2, "n_kv_head": 1, "head_dim": 64, "ssm_d_state": 128, "ssm_n_group": 1,
                "ssm_dt_rank": 2}},
    {"name": "qwen35-q4_k", "arch": "qwen35", "n_predict": 32, "prompts": _Q,
     "writer": {"qtype": "Q4_K", "seed": 24, "n_layers": 4, "n_embd": 256, "n_ff": 512, "head_dim": 64,
                "ssm_d_state": 32, "ssm_n_group": 4, "ssm_dt_rank": 8, "nextn_layers": 1}},
    {"name": "qwen35-q4_k-m-mix", "arch": "qwen35", "n_predict": 32,
     "prompts": [[5, 77, 300, 12], [100, 101, 102], [42, 7], [331]],
     "writer": {"qtype": "Q4_K", "seed": 25, "n_layers": 4, "full_attention_interval": 2, "n_embd": 256,
                "n_ff": 512, "head_dim": 64, "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4,
                "qtype_overrides": {"output.weight": "Q6_K", "ffn_down": "Q6_K", "attn_v": "Q6_K",
                                    "ssm_alpha": "Q8_0", "ssm_beta": "Q8_0"}}},
]

# Prompts of any length under 64 with K-quants: the models mark their prompt rows as llama-server's
# two batches (speculant_transformer.layers.recurrent_prompt_rows), so Q4_K's and Q6_K's prompt
# arithmetic covers the rows llama.cpp's does.
_ODD = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
        [11 * i % 251 for i in range(1, 31)], [17 * i % 253 for i in range(1, 62)]]
LFM2_CASES.append(
    {"name": "lfm2-q4_k-odd-prompts", "arch": "lfm2", "n_predict": 16, "prompts": _ODD,
     "writer": {"qtype": "Q4_K", "seed": 16, "n_layers": 4, "attn_layers": [1, 3], "n_embd": 256, "n_ff": 512,
                "n_head": 4, "n_kv_head": 2}})
QWEN35_CASES.append(
    {"name": "qwen35-q4_k-m-mix-odd-prompts", "arch": "qwen35", "n_predict": 16, "prompts": _ODD,
     "writer": {"qtype": "Q4_K", "seed": 26, "n_layers": 4, "full_attention_interval": 2, "n_embd": 256,
                "n_ff": 512, "head_dim": 64, "ssm_d_state": 64, "ssm_n_group": 2, "ssm_dt_rank": 4,
                "qtype_overrides": {"output.weight": "Q6_K", "ffn_down": "Q6_K", "attn_v": "Q6_K",
                                    "ssm_alpha": "Q8_0", "ssm_beta": "Q8_0"}}})

CASES = LFM2_CASES + QWEN35_CASES
