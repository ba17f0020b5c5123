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

from speculant.adaptive import CONFIDENCE_BINS, Calibration, ForwardCost, confidence_bin

ZEN3_MS = {1: 79.2, 2: 93.8, 3: 104.0, 4: 125.8, 5: 162.1, 6: 202.0, 7: 218.0, 8: 261.9}


def row_costs(ms: dict[int, float]) -> ForwardCost:
    """The profile as the controller reads it: `.cost(rows)` in seconds, measured row counts as
    given, others interpolated the controller's way."""
    costs = ForwardCost()
    for rows, milliseconds in ms.items():
        costs.observe(rows, milliseconds / 1e3)
    return costs


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


def fit(drafts: list[dict]) -> Calibration:
    """The drafts' calibration as the controller counts it, without its forgetting; a token
    counts when all before it were accepted."""
    cal = Calibration()
    for d in drafts:
        for i in range(min(d["accepted"] + 1, d["n"])):
            b = confidence_bin(d["confidence"][i])
            cal.tried[b] += 1
            cal.right[b] += i < d["accepted"]
    return cal


def analyse(path: str, ms: dict[int, float], draft_ms: float) -> None:
    drafts = json.load(open(path))
    cal = fit(drafts)
    tried, right = cal.tried, cal.right
    print("confidence bin: right/tried (all positions)")
    for i, edge in enumerate(CONFIDENCE_BINS):
        if tried[i]:
            print(f"  {edge:.2f}+  {int(right[i])}/{int(tried[i])} = {right[i] / tried[i]:.2f}")
    n_max = max(d["n"] for d in drafts)
    for i in range(n_max):
        t = sum(1 for d in drafts if d["n"] > i and d["accepted"] >= i)
        a = sum(1 for d in drafts if d["n"] > i and d["accepted"] > i)
        print(f"position {i}: {a}/{t} accepted")
    cost = row_costs(ms).cost  # seconds
    draft_s = draft_ms / 1e3
    for k in range(1, n_max + 1):
        tokens = sum(min(d["accepted"], k) + 1 for d in drafts)
        seconds = sum(draft_s * min(k, d["n"]) + cost(min(k, d["n"]) + 1) for d in drafts)
        print(f"fixed k={k}: {tokens / seconds * cost(1):.3f}x plain")
    tokens = seconds = 0.0
    for half in (0, 1):
        chance = fit(drafts[1 - half :: 2]).chance
        for d in drafts[half::2]:
            best_k, best_rate, expected, p = 0, 1 / cost(1), 1.0, 1.0
            for k in range(1, d["n"] + 1):
                p *= chance(d["confidence"][k - 1])
                expected += p
                if expected / cost(k + 1) > best_rate:
                    best_k, best_rate = k, expected / cost(k + 1)
            tokens += min(d["accepted"], best_k) + 1
            seconds += draft_s * min(d["n"], best_k + 1) + cost(best_k + 1)
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
