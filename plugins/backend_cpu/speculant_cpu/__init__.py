"""CPU backend plugin: torch on the CPU plus native kernels, the default backend.

On x86-64 with AVX-512 VNNI, or AVX2 with FMA and F16C, the linear layers run in native fused
kernels (native/, compiled at first use for the best of the two, SPECULANT_ISA to choose) straight
on the GGUF weights in the file's memory map, with llama.cpp's activation quantization; attention
runs natively over an fp16 KV cache. Elsewhere torch's kernels take over (about 5x slower decode;
the backend says so at start-up): 4-bit types repacked into torch's int4 weight-only format, the
rest dequantized once to bf16.
Every kernel is batch-invariant (a row's result does not depend on how many rows share the call),
which the engine's bit-exactness needs; tests check it.
"""
from speculant import hookimpl

from speculant_cpu.backend import CpuBackend


@hookimpl
def speculant_register_backends(register):
    register("cpu", CpuBackend)
