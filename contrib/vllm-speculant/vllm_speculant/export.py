"""`export(path, out_dir)`: a drafter trained by speculant, as the checkpoint vLLM's own method
for it loads, chosen by the file's architecture (eagle3 -> vLLM `eagle3`, dflash -> `dflash`)."""
from __future__ import annotations

from pathlib import Path

from speculant import SpeculantError

# What `speculative_config["method"]` loads each export.
METHODS = {"eagle3": "eagle3", "dflash": "dflash"}

MTP_WHY_NOT = ("an MTP sidecar: vLLM's mtp method has drafters only for model families that ship MTP layers "
               "(DeepSeek, Qwen3-Next/3.5, ...), none for the qwen2/llama targets speculant trains sidecars for; "
               "a Qwen3.5 target's own block is in its HF checkpoint, which vLLM's mtp method uses directly")


def export(path: str, out_dir: str, dtype: str = "bfloat16") -> tuple[Path, str]:
    """Write the checkpoint; returns (its directory, the vLLM method that loads it)."""
    from speculant.gguf import open_gguf

    gguf = open_gguf(path)
    arch = gguf.architecture
    if arch == "eagle3":
        from vllm_speculant.eagle3_export import export as run
    elif arch == "dflash":
        from vllm_speculant.dflash_export import export as run
    elif gguf.arch_key("nextn_predict_layers"):
        raise SpeculantError(f"{path}: {MTP_WHY_NOT}")
    else:
        raise SpeculantError(f"{path}: architecture '{arch}' is not a drafter vLLM can load (eagle3 or dflash)")
    return run(gguf, out_dir, dtype=dtype), METHODS[arch]
