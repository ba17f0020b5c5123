#!/usr/bin/env python3
"""How well a drafter's confidences (`Draft.confidence`) predict acceptance, and what cutting
drafts by them is worth against the best fixed draft length, on a cost profile.

Record: run `speculant bench` with every draft verified whole and keep each draft's confidences
and how many of its tokens the target accepted:

    python scripts/draft_calibration.py record OUT.json -- bench -m TARGET.gguf --workloads W.json \\
        --spec-type eagle3 -md HEAD.gguf --spec-draft-n-max 4 --spec-draft-p-min 0 --no-spec-adaptive

Analyse: acceptance per confidence bin and per position, then the recorded drafts replayed
step by step with forward costs by row count (ms; default: the Zen 3's after 1000 cached tokens,
docs/benchmarks.md's twenty-second run) and the drafter's ms per drafted token:

    python scripts/draft_calibration.py analyse OUT.json --draft-ms 6

"confidence cut" verifies each draft's prefix that maximizes expected tokens per second with
chances read off the bins (fitted on the other half of the drafts) and drafts one token past it;
"fixed k" verifies k tokens of every draft. Steps are taken as independent (a different cut
changes the next step's history; the ratio is per step).

`blind`: the CLI with the controller not told drafts' confidences (the other side of an A/B):
`python scripts/draft_calibration.py blind -- bench ...`.
"""
from __future__ import annotations

import argparse
import json
import sys

ZEN3_MS = {1: 79.2, 2: 93.8, 3: 104.0, 4: 125.8, 5: 162.1, 6: 202.0, 7: 218.0, 8: 261.9}
BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def record(out: str, cli_args: list[str]) -> int:
    from speculant.cli import main
    from speculant.engine import Engine

    drafts = []
    verify = Engine._verify

    def recording(self, seq, draft, *a, **k):
        result = verify(self, seq, draft, *a, **k)
        if draft is not None and draft.confidence is not None:
            drafts.append({"confidence": list(draft.confidence), "n": len(draft), "accepted": result[1]})
        return result

    Engine._verify = recording
    rc = main(cli_args)
    json.dump(drafts, open(out, "w"))
    print(f"{len(drafts)} drafts -> {out}", file=sys.stderr)
    return rc


def blind(cli_args: list[str]) -> int:
    import speculant.adaptive as adaptive
    from speculant.cli import main

    c = adaptive.DraftLengthController
    best_length, observe_draft, observe_shadow = c.best_length, c.observe_draft, c.observe_shadow
    c.best_length = lambda self, spec, n, seq_id=0, confidence=None: best_length(self, spec, n, seq_id)
    c.observe_draft = lambda self, *a, confidence=None, **k: observe_draft(self, *a, **k)
    c.observe_shadow = lambda self, spec, n, matched, confidence=None, seq_id=0: observe_shadow(self, spec, n, matched, None, seq_id)
    return main(cli_args)


def bin_of(c: float) -> int:
    return max(i for i, edge in enumerate(BINS) if c >= edge or i == 0)


POSITIONS = 1  # position classes calibrated apart (1: all together, as the controller does)


def fit(drafts: list[dict], positions: int = POSITIONS) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """(chance, tried, right) per position class and bin; a token counts when all before it
    were accepted."""
    tried = [[0.0] * len(BINS) for _ in range(positions)]
    right = [[0.0] * len(BINS) for _ in range(positions)]
    for d in drafts:
        for i in range(min(d["accepted"] + 1, d["n"])):
            p, b = min(i, positions - 1), bin_of(d["confidence"][i])
            tried[p][b] += 1
            right[p][b] += i < d["accepted"]
    mid = [(BINS[i] + (BINS[i + 1] if i + 1 < len(BINS) else 1.0)) / 2 for i in range(len(BINS))]
    chance = [[(right[p][i] + 2 * mid[i]) / (tried[p][i] + 2) for i in range(len(BINS))] for p in range(positions)]
    return chance, tried, right


def analyse(path: str, ms: dict[int, float], draft_ms: float) -> None:
    drafts = json.load(open(path))
    _, tried, right = fit(drafts, positions=1)
    print("confidence bin: right/tried (all positions)")
    for i, edge in enumerate(BINS):
        if tried[0][i]:
            print(f"  {edge:.2f}+  {int(right[0][i])}/{int(tried[0][i])} = {right[0][i] / tried[0][i]:.2f}")
    n_max = max(d["n"] for d in drafts)
    for i in range(n_max):
        t = sum(1 for d in drafts if d["n"] > i and d["accepted"] >= i)
        a = sum(1 for d in drafts if d["n"] > i and d["accepted"] > i)
        print(f"position {i}: {a}/{t} accepted")
    cost = lambda rows: ms.get(rows, ms[max(ms)] * rows / max(ms))
    for k in range(1, n_max + 1):
        tokens = sum(min(d["accepted"], k) + 1 for d in drafts)
        seconds = sum(draft_ms * min(k, d["n"]) + cost(min(k, d["n"]) + 1) for d in drafts)
        print(f"fixed k={k}: {tokens / seconds * cost(1):.3f}x plain")
    tokens = seconds = 0.0
    for half in (0, 1):
        chance = fit(drafts[1 - half :: 2])[0]
        for d in drafts[half::2]:
            best_k, best_rate, expected, p = 0, 1 / cost(1), 1.0, 1.0
            for k in range(1, d["n"] + 1):
                p *= chance[min(k - 1, POSITIONS - 1)][bin_of(d["confidence"][k - 1])]
                expected += p
                if expected / cost(k + 1) > best_rate:
                    best_k, best_rate = k, expected / cost(k + 1)
            tokens += min(d["accepted"], best_k) + 1
            seconds += draft_ms * min(d["n"], best_k + 1) + cost(best_k + 1)
    print(f"confidence cut: {tokens / seconds * cost(1):.3f}x plain")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("record", "blind"):
        rest = sys.argv[2:]
        if sys.argv[1] == "record":
            out, rest = rest[0], rest[1:]
            return record(out, rest[1:] if rest[:1] == ["--"] else rest)
        return blind(rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["analyse"])
    p.add_argument("drafts")
    p.add_argument("--draft-ms", type=float, default=6.0, help="the drafter's ms per drafted token")
    p.add_argument("--costs", help='JSON {rows: ms} of target forwards (default: the Zen 3 profile)')
    args = p.parse_args()
    ms = {int(k): float(v) for k, v in json.loads(args.costs).items()} if args.costs else ZEN3_MS
    analyse(args.drafts, ms, args.draft_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
