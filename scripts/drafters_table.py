#!/usr/bin/env python3
"""The Markdown table of a served sitting (scripts/bench_drafters.sh's drafters.jsonl): per
configuration and workload the median decode tok/s over rounds, its ratio to our plain decoding,
accepted / drafted tokens, mean acceptance length (1 + accepted / verified drafts: tokens a target
forward yields), draft ms per drafted token, and peak RSS; and whether every configuration wrote
plain decoding's text.

    python scripts/drafters_table.py drafters.jsonl [--baseline ours-plain]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def load(path: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs.setdefault(r["label"], []).append(r)
    return runs


def cell(rows: list[dict], plain: float | None) -> str:
    speeds = [r["decode_tok_s"] or 0.0 for r in rows]
    tok_s = statistics.median(speeds)
    text = f"{tok_s:.2f}"
    if plain:
        text += f" ({tok_s / plain:.2f}x)"
    r = rows[0]  # counters of the first round (greedy: every round drafts the same)
    if r.get("draft_n"):
        text += f", {r['draft_n_accepted']}/{r['draft_n']}"
        if r.get("draft_rounds"):
            text += f", len {1 + r['draft_n_accepted'] / r['draft_rounds']:.2f}, {r['draft_ms'] / r['draft_n']:.1f} ms/tok"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--baseline", default="ours-plain", help="label whose decode speed is 1.00x (default ours-plain)")
    args = ap.parse_args()
    runs = load(args.jsonl)
    workloads = [s["workload"] for s in next(iter(runs.values()))[0]["single"]]

    def rows_of(label: str, w: str) -> list[dict]:
        return [s for run in runs[label] for s in run["single"] if s["workload"] == w]

    plain = {w: statistics.median(r["decode_tok_s"] or 0.0 for r in rows_of(args.baseline, w)) if args.baseline in runs else None
             for w in workloads}
    reference = {w: rows_of(args.baseline, w)[0]["text"] if args.baseline in runs else None for w in workloads}
    print("| configuration | " + " | ".join(workloads) + " | peak RSS MB | same text as plain |")
    print("|---" * (len(workloads) + 3) + "|")
    for label, label_runs in runs.items():
        cells = [cell(rows_of(label, w), plain[w]) for w in workloads]
        rss = max(r.get("peak_rss_mb") or 0 for r in label_runs)
        same = [w for w in workloads if reference[w] is not None and all(s["text"] == reference[w] for s in rows_of(label, w))]
        print(f"| {label} | " + " | ".join(cells) + f" | {rss:.0f} | {len(same)} of {len(workloads)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
