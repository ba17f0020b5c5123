#!/usr/bin/env python3
"""Time the native linear kernels over every weight matrix of a model, grouped by type and shape.

Each group's matrices are called in turn with the same activation rows, so the weights come from
memory as in a decode step (a 1.5B model's matrices are far larger than the caches together);
medians of --repeats passes, and the bandwidth that implies. The token embedding is left out (a
forward reads one row of it). What one forward's linear layers cost on the kernel path in use
(SPECULANT_ISA, SPECULANT_AMX), without the model's Python around them:

    .venv/bin/python scripts/bench_linear.py --rows 1 -t 2

Several configurations are compared in one process, their passes alternated, so that a noisy box
moves them alike: `--isa avx2,avx512` loads each ISA's library side by side, and `--knob
NAME=V1,V2,...` sets one of the library's spk_set_NAME knobs to each value in turn (`default` the
library's own): `w4_prefetch` the four-row decode kernels' prefetch (0 the per-row order, else the
linear order that many bytes ahead), `tiled_min_rows`, `tiled_tail_rows`, `amx_min_rows`,
`b32_tiled_min_rows` (0: never):

    .venv/bin/python scripts/bench_linear.py --rows 1 --isa avx2,avx512 --knob w4_prefetch=default,16384
    .venv/bin/python scripts/bench_linear.py --rows 4 --knob tiled_min_rows=default,4
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
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
    ap.add_argument("--isa", default="", help="comma list of ISAs to alternate (default: the selected one)")
    ap.add_argument("--knob", default="w4_prefetch=default", help="NAME=V1,V2,...: spk_set_NAME values to alternate")
    ap.add_argument("--w4-prefetch", help="comma list of prefetch settings to alternate (--knob w4_prefetch=...)")
    args = ap.parse_args()
    libs = {}
    for isa in args.isa.split(",") if args.isa else [None]:
        lib = native.load(isa)
        if lib is None:
            raise SystemExit(f"no native kernels for {isa or 'this CPU'}: {native.why_unavailable(isa)}")
        lib.spk_set_threads(args.threads)
        libs[native.isa_of(lib)] = lib
    knob, _, values = (f"w4_prefetch={args.w4_prefetch}" if args.w4_prefetch else args.knob).partition("=")
    if not all(hasattr(lib, f"spk_set_{knob}") for lib in libs.values()):
        ap.error(f"--knob {knob}: the library has no spk_set_{knob}")
    setters = {name: getattr(lib, f"spk_set_{knob}") for name, lib in libs.items()}
    defaults = {name: setters[name](0) for name in libs}
    for name in libs:
        setters[name](defaults[name])
    settings = values.split(",")
    configs = list(itertools.product(libs, settings))

    groups: dict[tuple[str, int, int], list] = {}
    any_lib = next(iter(libs.values()))
    for t in GGUFReader(args.model).tensors:
        if len(t.shape) != 2 or t.name == "token_embd.weight":
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if any_lib.spk_supports(int(t.tensor_type), k):
            groups.setdefault((t.tensor_type.name, n, k), []).append(t)
    rng = np.random.default_rng(0)
    f32 = ctypes.POINTER(ctypes.c_float)
    print(f"{Path(args.model).name}  AMX {'on' if any_lib.spk_amx_available() else 'off'}  threads {args.threads}  "
          f"rows {args.rows}  configurations alternated: {', '.join(f'{i}/{s}' for i, s in configs)}")
    inputs = {}
    for key in groups:
        _, n, k = key
        inputs[key] = (rng.standard_normal((args.rows, k)).astype(np.float32), np.empty((args.rows, n), np.float32))
    samples = {(c, key): [] for c in configs for key in groups}
    for rep in range(args.repeats + 1):  # the first pass warms up (page faults, thread start)
        for isa, setting in configs:
            lib = libs[isa]
            setters[isa](defaults[isa] if setting == "default" else int(setting))
            for key, tensors in sorted(groups.items()):
                _, n, k = key
                x, y = inputs[key]
                t0 = time.perf_counter()
                for t in tensors:
                    lib.spk_linear(int(t.tensor_type), t.data.ctypes.data_as(ctypes.c_void_p), n, k,
                                   x.ctypes.data_as(f32), args.rows, y.ctypes.data_as(f32))
                if rep:
                    samples[((isa, setting), key)].append(time.perf_counter() - t0)
            setters[isa](defaults[isa])
    for isa, setting in configs:
        print(f"== {isa}, {knob} {setting}" + (f" ({defaults[isa]})" if setting == "default" else ""))
        total = 0.0
        for key, tensors in sorted(groups.items()):
            name, n, k = key
            med = statistics.median(samples[((isa, setting), key)])
            total += med
            nbytes = sum(t.data.nbytes for t in tensors)
            print(f"{name:>5} {n:>6} x {k:<5} x{len(tensors):<3} {1000 * med:8.2f} ms  {nbytes / med / 1e9:6.1f} GB/s")
        print(f"total {1000 * total:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
