"""What every exported drafter checkpoint shares: dtypes, vLLM's draft-vocabulary tensors,
config floats, writing the directory (config.json + model.safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from speculant import ModelFileError, SpeculantError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SpeculantError(f"dtype must be one of {', '.join(DTYPES)}, got '{name}'")
    return DTYPES[name]


def f32(x: float) -> float:
    """A float32 read from the GGUF, written as its shortest decimal (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def llama_like_config(architecture: str, model_type: str, cfg, n_layers: int, target_hidden: int, dtype: str) -> dict:
    """The config.json keys a one-stack drafter shares with a Llama/Qwen3 decoder config."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.n_ff,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": n_layers,
        "hidden_act": "silu",
        "rms_norm_eps": f32(cfg.eps),
        # both spellings: transformers 4.x reads rope_theta, 5.x rope_parameters (vLLM's get_rope)
        "rope_theta": f32(cfg.rope_base),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": f32(cfg.rope_base)},
        "max_position_embeddings": cfg.n_ctx,
        "vocab_size": cfg.n_target_vocab,
        "draft_vocab_size": cfg.n_draft_vocab,
        "target_hidden_size": target_hidden,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def dequantized(info) -> torch.Tensor:
    from speculant.gguf import dequantize

    return dequantize(info.data, info.qtype, tuple(info.shape))


def vocab_tensors(gguf, n_draft: int, n_target: int, has_lm_head: bool) -> dict[str, torch.Tensor]:
    """`d2t` as vLLM's offset (target id = draft id + d2t[draft id], its compute_logits; ours holds
    the absolute id) and `t2d` (a bool mask over the target vocabulary, EAGLE3's own format,
    skipped by vLLM) for a reduced draft vocabulary; nothing for the full one."""
    d2t = gguf.tensors.get("d2t")
    if n_draft == n_target:
        return {}
    if not has_lm_head:
        raise ModelFileError(f"{gguf.path}: 'd2t' without the drafter's own lm_head: vLLM would share the target's "
                             f"full one, {n_target} rows, not {n_draft}")
    if d2t is None:
        raise ModelFileError(f"{gguf.path}: a reduced lm_head ({n_draft} rows) without 'd2t'")
    absolute = torch.from_numpy(np.asarray(d2t.data, dtype=np.int64).reshape(-1).copy())
    t2d = torch.zeros(n_target, dtype=torch.bool)
    t2d[absolute] = True
    return {"d2t": absolute - torch.arange(len(absolute), dtype=torch.int64), "t2d": t2d}


def write(out_dir: str, config: dict, tensors: dict[str, torch.Tensor], source: str) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": Path(source).name})
    return out
