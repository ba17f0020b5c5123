#!/usr/bin/env python3
"""Whole verification forwards of the target by row count, with the per-row tail limit of the
tiled kernels (spk_set_tiled_tail_rows) alternated in one process: what each limit costs at row
counts just past a group of 16 (docs/benchmarks.md, "Fourteenth run"). Medians in ms.

    SPECULANT_AMX=0 .venv/bin/python scripts/bench_tail.py --rows 16,17,20,24,33,49 --tails 0,8
    SPECULANT_ISA=avx2 .venv/bin/python scripts/bench_tail.py --rows 9,10,12,17,24 --tails 0,4
"""
from __future__ import annotations

import argparse
import statistics

from bench_rows import MODELS, tokens, verify_forward  # scripts/ is on sys.path when run as a script
from speculant import Batch
from speculant.loader import load_model
from speculant_cpu import native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--rows", default="16,17,24,33,48,49")
    ap.add_argument("--tails", default="0,8", help="tail limits to alternate")
    ap.add_argument("--context", type=int, default=1500, help="tokens cached before the timed rows")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    a = ap.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit(f"native kernels unavailable: {native.why_unavailable()}")
    model = load_model(a.model, threads=2, progress=False)
    context = model.new_context(a.context + 100)
    model.forward(Batch.for_sequence(0, 0, tokens(model, a.context), logits="none", prompt_len=a.context), context)
    rows, tails = [int(r) for r in a.rows.split(",")], [int(t) for t in a.tails.split(",")]
    old = lib.spk_set_tiled_tail_rows(0)
    times: dict[tuple[int, int], list[float]] = {(r, t): [] for r in rows for t in tails}
    for repeat in range(a.repeats + 1):  # the first round warms up
        for r in rows:
            for t in tails:
                lib.spk_set_tiled_tail_rows(t)
                seconds = verify_forward(model, context, r, a.context, a.context)
                if repeat:
                    times[(r, t)].append(seconds)
    lib.spk_set_tiled_tail_rows(old)
    print(f"{native.isa_of(lib)}, {a.context} cached tokens, ms (median of {a.repeats})")
    print("rows" + "".join(f"{'tail ' + str(t):>10}" for t in tails))
    for r in rows:
        print(f"{r:4d}" + "".join(f"{statistics.median(times[(r, t)]) * 1e3:10.1f}" for t in tails))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
