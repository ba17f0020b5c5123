"""Decoder-only architectures read from GGUF: the transformers llama, qwen2, qwen3 and gemma3, and
the hybrids lfm2 (short convolutions and attention) and qwen35 (Gated DeltaNet and gated attention)."""
from speculant import hookimpl

from speculant_transformer.gemma3 import Gemma3Model
from speculant_transformer.lfm2 import Lfm2Model
from speculant_transformer.llama import LlamaModel
from speculant_transformer.qwen35 import Qwen35Model


@hookimpl
def speculant_register_architectures(register):
    for arch in ("llama", "qwen2", "qwen3"):
        register(arch, LlamaModel.load)
    register("gemma3", Gemma3Model.load)
    register("qwen35", Qwen35Model.load)
    register("lfm2", Lfm2Model.load)
