#!/usr/bin/env python3
"""Time the native linear kernels over every weight matrix of a model, grouped by type and shape.

Each group's matrices are called in turn with the same activation rows, so the weights come from
memory as in a decode step (a 1.5B model's matrices are far larger than the caches together);
medians of --repeats passes, and the bandwidth that implies. The token embedding is left out (a
forward reads one row of it). What one forward's linear layers cost on the kernel path in use
(SPECULANT_ISA, SPECULANT_AMX), without the model's Python around them:

    .venv/bin/python scripts/bench_linear.py --rows 1 -t 2
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from speculant_cpu import native

MODELS = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call (1: decode)")
    ap.add_argument("-r", "--repeats", type=int, default=7)
    args = ap.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit(f"no native kernels here: {native.why_unavailable()}")
    lib.spk_set_threads(args.threads)
    groups: dict[tuple[str, int, int], list] = {}
    for t in GGUFReader(args.model).tensors:
        if len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if lib.spk_supports(int(t.tensor_type), k):
            groups.setdefault((t.tensor_type.name, n, k), []).append(t)
    rng = np.random.default_rng(0)
    f32 = ctypes.POINTER(ctypes.c_float)
    print(f"{Path(args.model).name}  ISA {native.isa_of(lib)}  AMX {'on' if lib.spk_amx_available() else 'off'}  "
          f"threads {args.threads}  rows {args.rows}")
    total = 0.0
    for (name, n, k), tensors in sorted(groups.items()):
        x = rng.standard_normal((args.rows, k)).astype(np.float32)
        y = np.empty((args.rows, n), np.float32)
        calls = [(int(t.tensor_type), t.data.ctypes.data_as(ctypes.c_void_p)) for t in tensors]
        samples = []
        for _ in range(args.repeats + 1):  # the first pass warms up (page faults, thread start)
            t0 = time.perf_counter()
            for qtype, w in calls:
                lib.spk_linear(qtype, w, n, k, x.ctypes.data_as(f32), args.rows, y.ctypes.data_as(f32))
            samples.append(time.perf_counter() - t0)
        med = statistics.median(samples[1:])
        total += med
        nbytes = sum(t.data.nbytes for t in tensors)
        print(f"{name:>5} {n:>6} x {k:<5} x{len(tensors):<3} {1000 * med:8.2f} ms  {nbytes / med / 1e9:6.1f} GB/s")
    print(f"total {1000 * total:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
