"""A DFlash drafter in llama.cpp's GGUF layout (what `speculant train dflash` writes) as the HF
checkpoint directory vLLM's built-in `dflash` method loads:

    speculative_config={"method": "dflash", "model": DIR, "num_speculative_tokens": BLOCK - 1}

The target layout, from vLLM 0.33.0's source (model_executor/models/qwen3_dflash.py):

* config.json: `architectures: ["DFlashDraftModel"]` (registry.py:664 ->
  DFlashQwen3ForCausalLM), a Qwen3 config of the drafter's layers, `target_hidden_size`,
  `draft_vocab_size`, and `dflash_config` {`target_layer_ids`: HF layer ids, which vLLM turns into
  aux-state ids by adding 1 (gpu_model_runner.py:5210-5214) -- ours are those ids already, so
  ours - 1; `mask_token_id` (:454); `block_size`; `causal` (:61-73);
  `attention_value_scale` (:352)}. No `layer_types`: every layer full attention, as ours.
* weights (load_weights, :851-893; "model." prefixed but lm_head): `fc`, `hidden_norm` (the norm
  after fc), `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, optional `lm_head` and
  `embed_tokens` (else shared with the target), `d2t` as an offset, `t2d`.
* the computation: the context states fc(taps) through hidden_norm, projected by each layer's
  k/v, k_norm, NeoX RoPE at their positions, into the cache (precompute_and_store_context_kv,
  :586-700); the block [next token, MASK...] at the following positions through Qwen3 layers
  (q/k norms, NeoX RoPE, :283-300), attending over the context and the whole block; the same as
  llama.cpp's graph, in the same rotation (no permutation: qwen-style files are NeoX already).

llama.cpp's layout also carries what only other DFlash variants use (a Gemma-style drafter:
post-attention/FFN norms, GELU, embedding and logit soft-capping, attention sinks, sliding
windows, per-matrix scales, partial or scaled RoPE). vLLM's Qwen3 DFlash has no place for most
of them, so a file using any is refused with its name rather than exported into a checkpoint
that computes something else. `speculant train dflash` writes none of them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from speculant import SpeculantError
from speculant.logs import get_logger

from vllm_speculant.checkpoint import dequantized, dtype_of, f32, llama_like_config, vocab_tensors, write

log = get_logger(__name__)

ARCHITECTURE = "DFlashDraftModel"

TOP = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
       "output.weight": "lm_head.weight", "token_embd.weight": "embed_tokens.weight"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def unsupported(gguf, cfg) -> list[str]:
    """What of the file vLLM's Qwen3 DFlash cannot compute."""
    bad = []
    for name in gguf.tensors:
        if name.endswith(".scale") or name == "rope_freqs.weight" or any(
                name.endswith(f".{t}.weight") for t in ("post_attention_norm", "post_ffw_norm", "layer_output_scale", "attn_sinks")):
            bad.append(f"tensor '{name}'")
    for i in range(cfg.n_layers):
        if f"blk.{i}.attn_v.weight" not in gguf.tensors:
            bad.append(f"layer {i} without attn_v (keys shared as values)")
    for what, value, plain in (("hidden_activation", cfg.activation, "silu"), ("embedding_scale", cfg.embedding_scale, 0.0),
                               ("attention.scale", cfg.attention_scale, 0.0), ("final_logit_softcapping", cfg.softcap, 0.0),
                               ("attention.sliding_window", cfg.n_swa, 0), ("rope.dimension_count", cfg.n_rot, 0),
                               ("rope scaling factor", cfg.rope_scale, 1.0)):
        if value != plain:
            bad.append(f"{what} = {value}")
    return bad


def config_json(cfg, dtype: str) -> dict:
    dflash = {"target_layer_ids": [int(x) - 1 for x in cfg.target_layers], "mask_token_id": int(cfg.mask_token_id),
              "block_size": int(cfg.block_size), "causal": bool(cfg.causal), "use_aux_hidden_state": True}
    if cfg.value_scale:
        dflash["attention_value_scale"] = f32(cfg.value_scale)
    # target_hidden_size: our layout reads n_taps x n_embd, so the target's width is the drafter's
    out = {
        **llama_like_config(ARCHITECTURE, "qwen3", cfg, cfg.n_layers, cfg.n_embd, dtype),
        "block_size": int(cfg.block_size),
        "dflash_config": dflash,
    }
    if cfg.logit_scale:
        out["logit_scale"] = f32(cfg.logit_scale)
    return out


def state_dict(gguf, cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = dict(TOP)
    for i in range(cfg.n_layers):
        names.update({f"blk.{i}.{src}.weight": f"layers.{i}.{dst}.weight" for src, dst in LAYER.items()})
    out = {dst: dequantized(gguf.tensors[src]).to(dtype).contiguous() for src, dst in names.items() if src in gguf.tensors}
    out.update(vocab_tensors(gguf, cfg.n_draft_vocab, cfg.n_target_vocab, "lm_head.weight" in out))
    return out


def export(gguf, out_dir: str, dtype: str = "bfloat16") -> Path:
    """Write `out_dir`/config.json and model.safetensors for the drafter in `gguf` (opened,
    architecture dflash); returns the directory."""
    from speculant_dflash.layout import read_config  # the layout's one reader (speculant's dflash plugin)

    cfg = read_config(gguf)
    bad = unsupported(gguf, cfg)
    if bad:
        raise SpeculantError(f"{gguf.path}: vLLM's DFlash (Qwen3) drafter cannot compute this file's {', '.join(bad)}")
    tensors = state_dict(gguf, cfg, dtype_of(dtype))
    out = write(out_dir, config_json(cfg, dtype), tensors, gguf.path)
    log.info("exported DFlash drafter for vLLM", drafter=str(gguf.path), out=str(out), dtype=dtype, tensors=len(tensors),
             block_size=cfg.block_size, target_layer_ids=[x - 1 for x in cfg.target_layers])
    return out
