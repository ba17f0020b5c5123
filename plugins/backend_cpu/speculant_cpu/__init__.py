"""CPU backend plugin: torch on the CPU, the default backend.

Weights stay close to their GGUF size: 4-bit types (Q4_0, Q4_1, Q4_K) are repacked losslessly
into torch's int4 weight-only format (group 32, bf16 scales) and multiplied by its fused
dequantize-matmul kernel; every other type is dequantized once to bf16. Activations enter the
matmuls as bf16. Both kernels are batch-invariant (a row's result does not depend on how many
rows share the call), which the engine's bit-exactness needs; tests check it.
"""
from speculant import hookimpl

from speculant_cpu.backend import CpuBackend


@hookimpl
def speculant_register_backends(register):
    register("cpu", CpuBackend)
