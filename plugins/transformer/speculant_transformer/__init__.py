"""Decoder-only transformer architectures read from GGUF: llama, qwen2, qwen3 and gemma3."""
from speculant import hookimpl

from speculant_transformer.gemma3 import Gemma3Model
from speculant_transformer.llama import LlamaModel


@hookimpl
def speculant_register_architectures(register):
    for arch in ("llama", "qwen2", "qwen3"):
        register(arch, LlamaModel.load)
    register("gemma3", Gemma3Model.load)
