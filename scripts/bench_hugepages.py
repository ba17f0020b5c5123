#!/usr/bin/env python3
"""Forward cost with the weights in the file's map against on 2 MiB pages (SPECULANT_HUGEPAGES).

Loads the model twice in one process, once each way, and alternates their forwards (the order
flipping every repeat), so a noisy box moves both alike; medians in ms. Each forward is
`--rows` decode rows after `--context` cached tokens, logits for every row (the full head), from
the same cache state every repeat (docs/benchmarks.md, fortieth run):

    SPECULANT_AMX=0 .venv/bin/python scripts/bench_hugepages.py --context 1200 --rows 1,4,48 -r 15
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from speculant import Batch
from speculant.loader import load_model

MODEL = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models")) / "qwen2.5-coder-1.5b-instruct.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--rows", default="1")
    ap.add_argument("-r", "--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    models, contexts = {}, {}
    for setting in ("0", "1"):  # read when each NativeLinear is made
        os.environ["SPECULANT_HUGEPAGES"] = setting
        t0 = time.perf_counter()
        models[setting] = load_model(args.model, threads=args.threads, progress=False)
        print(f"SPECULANT_HUGEPAGES={setting}: loaded in {time.perf_counter() - t0:.2f} s", flush=True)
        contexts[setting] = models[setting].new_context(args.context + max(rows) + 8)
    n_vocab = models["0"].info.n_vocab
    tokens = [(17 * i + 101) % n_vocab for i in range(args.context + max(rows))]
    for setting, model in models.items():
        model.forward(Batch.for_sequence(0, 0, tokens[: args.context], logits="none", prompt_len=args.context), contexts[setting])
    times = {(s, n): [] for s in models for n in rows}
    for rep in range(args.repeats):
        order = list(models) if rep % 2 == 0 else list(models)[::-1]
        for n in rows:
            for setting in order:
                batch = Batch.for_sequence(0, args.context, tokens[args.context : args.context + n], logits="all",
                                           prompt_len=args.context)
                t0 = time.perf_counter()
                models[setting].forward(batch, contexts[setting])
                times[(setting, n)].append(time.perf_counter() - t0)
                contexts[setting].truncate(0, args.context)
    print(f"medians of {args.repeats}, {args.context} cached tokens")
    for n in rows:
        off, on = (sorted(times[(s, n)])[len(times[(s, n)]) // 2] * 1e3 for s in ("0", "1"))
        print(f"rows {n:3d}: file map {off:8.2f} ms   2 MiB pages {on:8.2f} ms   ratio {on / off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
