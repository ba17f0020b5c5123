"""`speculant bench --kernels`: what one target forward costs by the number of rows it verifies.

Speculation pays when the tokens a step yields beat what the step costs relative to plain
decoding: a forward over k rows at r(k) = t(k) / t(1) times the cost of one row pays off only if
a draft of k-1 tokens yields more than r(k) tokens on average. This is the ratio the adaptive
controller measures online and acts on; here it is measured up front, at a given context length,
with the split of the time by function (cProfile) so kernels, attention and glue can be told apart.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

from speculant.types import Batch

ROWS = (1, 2, 4, 8, 16)


def row_tokens(model, rows: int) -> list[int]:
    """Arbitrary but fixed tokens for the timed rows."""
    return [(17 * i + 101) % model.info.n_vocab for i in range(rows)]


def time_forward(model, context, position: int, rows: int, repeats: int) -> float:
    """Median seconds of a forward over `rows` new rows after `position` cached tokens."""
    tokens = row_tokens(model, rows)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.forward(Batch.for_sequence(0, position, tokens, logits="all"), context)
        times.append(time.perf_counter() - t0)
        context.truncate(0, position)
    return statistics.median(times)


def profile_split(model, context, position: int, rows: int, top: int = 6) -> list[tuple[str, float]]:
    """Share of a forward's time by function (own time), the largest first."""
    tokens = row_tokens(model, rows)
    prof = cProfile.Profile()
    for _ in range(3):
        prof.enable()
        model.forward(Batch.for_sequence(0, position, tokens, logits="all"), context)
        prof.disable()
        context.truncate(0, position)
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values()) or 1.0
    by_name: dict[str, float] = {}
    for (path, line, name), v in stats.items():
        where = f"{os.path.basename(path)}:{line}({name})" if path != "~" else name.strip("<>")
        by_name[where] = by_name.get(where, 0.0) + v[2]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return [(name, seconds / total) for name, seconds in ranked]


def run_kernel_bench(args, model) -> dict:
    context_len = args.kernels_context
    repeats = max(5, args.repeats)
    context = model.new_context(context_len + max(ROWS))
    prompt = [(31 * i + 7) % model.info.n_vocab for i in range(context_len)]
    if prompt:
        model.forward(Batch.for_sequence(0, 0, prompt, logits="none"), context)
    time_forward(model, context, context_len, 1, 2)  # warm up
    seconds = {k: time_forward(model, context, context_len, k, repeats) for k in ROWS}
    base = seconds[1]
    print(f"target forward after {context_len} cached tokens, median of {repeats}")
    print(f"{'rows':>4} {'ms':>8} {'ms/row':>8} {'cost ratio':>10}")
    for k in ROWS:
        print(f"{k:>4} {1000 * seconds[k]:>8.1f} {1000 * seconds[k] / k:>8.1f} {seconds[k] / base:>9.2f}x")
    print("cost ratio r(k) = t(k)/t(1): a draft of k-1 tokens pays off when it yields more than r(k) tokens per step")
    splits = {}
    for k in (1, max(ROWS)):
        splits[k] = profile_split(model, context, context_len, k)
        print(f"time split at {k} row(s) (cProfile own time; it inflates Python glue):")
        for name, share in splits[k]:
            print(f"    {100 * share:5.1f}%  {name}")
    return {"context": context_len, "repeats": repeats, "seconds": seconds,
            "ratio": {k: seconds[k] / base for k in ROWS}, "split": splits}
