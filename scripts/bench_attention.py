#!/usr/bin/env python3
"""Time the native decode attention (spk_attention_f16) alone, on a synthetic fp16 KV cache shaped
like the 1.5B's (12 query heads, 2 kv heads, 128 dims), with the cache in L2 (one layer's cache
called again and again) or from memory (--layers 28: 28 layers' caches in turn, as a forward
reads them). Rows at positions from --exact-below on take the fp32 path, the others llama.cpp's
arithmetic (attention.cpp). Medians in us a call:

    .venv/bin/python scripts/bench_attention.py --isa avx512,avx2 --context 1200 --rows 1 --layers 1,28
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from speculant_cpu import native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="", help="comma list of ISAs (default: the selected one)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--context", default="1200", help="comma list: the last row's position + 1")
    ap.add_argument("--rows", default="1", help="comma list of query rows (the last positions)")
    ap.add_argument("--layers", default="1,28", help="comma list: caches called in turn (1: in L2)")
    ap.add_argument("--exact-below", type=int, default=256)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=30)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]
    nh, nkv, d = args.heads, args.kv_heads, args.head_dim
    cap = max(ints(args.context))
    rng = np.random.default_rng(0)
    caches = [(rng.standard_normal((nkv, cap, d)).astype(np.float16), rng.standard_normal((nkv, cap, d)).astype(np.float16))
              for _ in range(max(ints(args.layers)))]
    for isa in args.isa.split(",") if args.isa else [None]:
        lib = native.load(isa)
        if lib is None:
            raise SystemExit(f"no native kernels for {isa or 'this CPU'}: {native.why_unavailable(isa)}")
        lib.spk_set_threads(args.threads)
        for ctx, rows, layers in itertools.product(ints(args.context), ints(args.rows), ints(args.layers)):
            q = rng.standard_normal((rows, nh, d)).astype(np.float32)
            pos = np.arange(ctx - rows, ctx, dtype=np.int64)
            out = np.empty((rows, nh, d), np.float32)
            samples = []
            for _ in range(args.repeats + 3):  # three passes warm up
                t0 = time.perf_counter()
                for k, v in caches[:layers]:
                    if lib.spk_attention_f16(q.ctypes.data, rows, nh, nkv, d, d, k.ctypes.data, v.ctypes.data, cap * d, cap * d,
                                             pos.ctypes.data, 0, d ** -0.5, out.ctypes.data, 1, args.exact_below):
                        raise SystemExit("spk_attention_f16 refused the shapes")
                samples.append((time.perf_counter() - t0) / layers)
            us = 1e6 * statistics.median(samples[3:])
            print(f"{native.isa_of(lib):>11}  context {ctx:>5}  rows {rows:>3}  layers {layers:>2}  {us:8.1f} us a call  "
                  f"{us / ctx * 1e3:7.1f} ns a key")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
