#!/usr/bin/env python3
"""Forward cost by row count, timed the way llama-bench times it, and where the time goes.

Two kinds of forward, each from a fresh cache state every repeat (the rows are truncated away):

- `pp N`: a prompt of N tokens prefilled from an empty cache, logits for the last row only,
  the rows marked as prompt rows of an N-token prompt (their kinds follow from that, as in
  the engine): what llama-bench's ppN times (it too starts from an empty cache and computes the
  output head for the last row only).
- `verify N`: N decode rows after `--context` cached tokens, logits for every row: a
  verification step of a draft of N-1 tokens.

Row counts are alternated within each repeat (interleaved), medians reported in ms and ms/row.
`--split` times the native calls by kind (linear by GGML type and shape, attention, element-wise,
fused layers) for one more run at each count, so the rest (Python, torch glue) shows as the
difference; with `--pieces` every layer runs piece by piece, its kernels timed one by one.

    SPECULANT_AMX=0 .venv/bin/python scripts/bench_rows.py -m MODEL --pp 8,16,32,64,512 --verify 1,2,4,8,16,32,48 -r 5
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

from speculant import Batch
from speculant.loader import load_model

MODELS = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))


def tokens(model, n: int, salt: int = 0) -> list[int]:
    return [(17 * i + 101 + salt) % model.info.n_vocab for i in range(n)]


def pp_forward(model, context, n: int) -> float:
    t0 = time.perf_counter()
    model.forward(Batch.for_sequence(0, 0, tokens(model, n), logits="last", prompt_len=n), context)
    dt = time.perf_counter() - t0
    context.truncate(0, 0)
    return dt


def verify_forward(model, context, n: int, position: int, prompt_len: int) -> float:
    t0 = time.perf_counter()
    model.forward(Batch.for_sequence(0, position, tokens(model, n, 7), logits="all", prompt_len=prompt_len), context)
    dt = time.perf_counter() - t0
    context.truncate(0, position)
    return dt


class Split:
    """Wall time of the native calls by kind, by wrapping the backend's entry points."""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self._undo = []

    def wrap(self, owner, name, key):
        orig = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                k = key(*a) if callable(key) else key
                self.t[k] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def install(self):
        """Before the model loads: the backend binds some of these methods at construction."""
        from speculant_cpu import backend as b

        names = {12: "Q4_K", 14: "Q6_K", 8: "Q8_0", 6: "Q5_0", 2: "Q4_0"}
        self.wrap(b.NativeLinear, "__call__",
                  lambda self_, x: f"linear {names.get(self_.qtype, self_.qtype)} {self_.out_features}x{self_.in_features}")
        for name in ("attention", "swiglu", "_native_rms_norm", "_native_apply_rope", "rope_tables"):
            self.wrap(b.CpuBackend, name, name.removeprefix("_native_"))
        from speculant_cpu import fused

        self.wrap(fused.FusedLlamaLayer, "__call__", "fused layers (every kernel of a layer in one call)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--pp", default="8,16,32,64,512", help="prompt sizes (empty cache, logits last); '' for none")
    ap.add_argument("--verify", default="", help="verification row counts after --context cached tokens (logits all)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--split", action="store_true", help="instead: time the native calls by kind, one run per count")
    ap.add_argument("--pieces", action="store_true", help="run every layer piece by piece (no fused_layer), e.g. to split "
                    "a layer's time by kernel")
    args = ap.parse_args()
    pp = [int(s) for s in args.pp.split(",") if s.strip()]
    ver = [int(s) for s in args.verify.split(",") if s.strip()]
    split = Split()
    if args.split:
        split.install()
    model = load_model(args.model, threads=args.threads, progress=False)
    if args.pieces and hasattr(model, "fused"):
        model.fused = [None] * len(model.fused)
    pp_context = model.new_context(max(pp, default=1) + 8)
    verify_context = model.new_context(args.context + max(ver, default=1) + 8) if ver else None
    if ver:
        model.forward(Batch.for_sequence(0, 0, tokens(model, args.context, 3), logits="none", prompt_len=args.context),
                      verify_context)
    jobs = [("pp", n) for n in pp] + [("verify", n) for n in ver]

    def run(kind, n):
        if kind == "pp":
            return pp_forward(model, pp_context, n)
        return verify_forward(model, verify_context, n, args.context, args.context)

    for kind, n in jobs:  # warm up
        run(kind, n)
    print(f"model {os.path.basename(args.model)}  SPECULANT_AMX={os.environ.get('SPECULANT_AMX', '')} "
          f"SPECULANT_ISA={os.environ.get('SPECULANT_ISA', '')}  threads={args.threads}  load {os.getloadavg()[0]:.2f}")
    if args.split:
        for kind, n in jobs:
            split.t.clear()
            total = run(kind, n)
            print(f"{kind} {n}: {1000 * total:.1f} ms")
            rest = total
            for k, v in sorted(split.t.items(), key=lambda kv: -kv[1]):
                print(f"    {1000 * v:8.2f} ms  {100 * v / total:5.1f}%  {k}")
                rest -= v
            print(f"    {1000 * rest:8.2f} ms  {100 * rest / total:5.1f}%  other (Python, torch glue)")
        return 0
    times = collections.defaultdict(list)
    for _ in range(args.repeats):
        for kind, n in jobs:
            times[kind, n].append(run(kind, n))
    print(f"median of {args.repeats}, row counts interleaved")
    print(f"{'kind':>6} {'rows':>5} {'ms':>9} {'ms/row':>8}   all (ms)")
    for kind, n in jobs:
        med = statistics.median(times[kind, n])
        print(f"{kind:>6} {n:>5} {1000 * med:>9.1f} {1000 * med / n:>8.2f}   " + " ".join(f"{1000 * t:.1f}" for t in times[kind, n]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
