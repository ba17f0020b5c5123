"""An EAGLE3 head in llama.cpp's GGUF layout (what `speculant train eagle3` writes) as the HF
checkpoint directory vLLM's built-in `eagle3` method loads:

    speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}

The target layout, from vLLM 0.33.0's source:

* config.json: `architectures: ["LlamaForCausalLMEagle3"]` (model_executor/models/registry.py:702
  -> llama_eagle3.Eagle3LlamaForCausalLM), a llama config of one layer (num_hidden_layers 1),
  `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`, `norm_before_fc`, and
  `eagle_config.eagle_aux_hidden_state_layer_ids`: the target layers tapped, read by
  worker/gpu_model_runner.py:5207-5219. vLLM's id L is the residual stream entering layer L
  (interfaces.py:1640-1650, qwen2.py:424-434), which is what our `eagle3.target_layers` holds.
* weights (llama_eagle3.py:402-470, load_weights): `midlayer.*` (mapped to layers.0), `fc`,
  `norm`, `lm_head`, optional `embed_tokens` (else the target's are shared,
  v1/spec_decode/llm_base_proposer.py:1418-1558, as speculant borrows them), `input_norm` when
  norm_before_fc, and `d2t` as an *offset*: target id = draft id + d2t[draft id]
  (compute_logits, llama_eagle3.py:369-384). Our d2t holds the absolute target id.
  `t2d` (a bool mask over the target vocabulary, EAGLE3's own format) is written too; vLLM
  skips it.
* the decoder layer (llama_eagle3.py:73-153): q/k/v read cat(input_layernorm(embed),
  hidden_norm(g)), the residual is g (or the normed g with norm_before_residual), then the llama
  MLP; the same as llama.cpp's graph.
* RoPE: vLLM's LlamaAttention is NeoX-style (rotate-half, llama.py:241); llama.cpp's eagle3 uses
  the original pairing on q/k rows that its converter permuted from HF's order. So q and k rows
  go back to HF order here (the inverse of that permutation).

Weights are dequantized from any GGUF type and written as `dtype` (bfloat16 by default, as EAGLE3
checkpoints are; vLLM casts to the target's dtype on load).
"""
from __future__ import annotations

from pathlib import Path

import torch

from speculant.logs import get_logger

from vllm_speculant.checkpoint import dequantized, dtype_of, llama_like_config, vocab_tensors, write

log = get_logger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"

# llama.cpp eagle3 tensor -> vLLM/HF EAGLE3 checkpoint name
NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "input_norm.weight",
    "blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
    "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
    "blk.0.attn_q.weight": "midlayer.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "midlayer.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
    "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "token_embd.weight": "embed_tokens.weight",
}


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter orders each head's q/k rows as pairs (2i, 2i+1) = HF rows
    (i, i + head_dim/2); this puts them back in HF order, for rotate-half RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_json(cfg, dtype: str) -> dict:
    """The checkpoint's config.json from the head's hyperparameters (speculant_eagle3.layout.HeadConfig)."""
    eagle = {"eagle_aux_hidden_state_layer_ids": [int(x) for x in cfg.target_layers], "use_aux_hidden_state": True,
             "norm_before_fc": bool(cfg.norm_before_fc)}
    return {
        **llama_like_config(ARCHITECTURE, "llama", cfg, 1, cfg.target_hidden, dtype),
        "mlp_bias": False,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "norm_before_fc": bool(cfg.norm_before_fc),
        "eagle_config": eagle,
    }


def state_dict(gguf, cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, dequantized from the head's GGUF."""
    out: dict[str, torch.Tensor] = {}
    for src, dst in NAMES.items():
        info = gguf.tensors.get(src)
        if info is None:
            continue  # the optional ones (checked by the loader below); vLLM shares the target's
        w = dequantized(info)
        if src == "blk.0.attn_q.weight":
            w = unpermute_rope_rows(w, cfg.n_head)
        elif src == "blk.0.attn_k.weight":
            w = unpermute_rope_rows(w, cfg.n_kv_head)
        out[dst] = w.to(dtype).contiguous()
    if not cfg.norm_before_fc:
        out.pop("input_norm.weight", None)  # unused by the head: vLLM drops it too
    out.update(vocab_tensors(gguf, cfg.n_draft_vocab, cfg.n_target_vocab, "lm_head.weight" in out))
    return out


def export(gguf, out_dir: str, dtype: str = "bfloat16") -> Path:
    """Write `out_dir`/config.json and model.safetensors for the head in `gguf` (opened,
    architecture eagle3); returns the directory."""
    from speculant_eagle3.layout import read_config  # the layout's one reader (speculant's eagle3 plugin)

    cfg = read_config(gguf)
    tensors = state_dict(gguf, cfg, dtype_of(dtype))
    out = write(out_dir, config_json(cfg, dtype), tensors, gguf.path)
    log.info("exported EAGLE3 head for vLLM", head=str(gguf.path), out=str(out), dtype=dtype,
             tensors=len(tensors), draft_vocab=cfg.n_draft_vocab, target_layers=list(cfg.target_layers))
    return out
