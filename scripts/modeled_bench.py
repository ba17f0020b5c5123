#!/usr/bin/env python3
"""`speculant bench` with each run's decode time modeled: every verification forward priced from
a row-cost profile (default the Zen 3's, scripts/draft_calibration.py's ZEN3_MS, read as the
controller reads its measurements) instead of timed,
plus the drafter's measured seconds. On a box whose speed moves more than the difference being
measured, this keeps what the controller decided and drops the box's speed.

    python scripts/modeled_bench.py told  bench -m TARGET.gguf --workloads W.json --spec-type eagle3 -md HEAD.gguf
    python scripts/modeled_bench.py blind bench ...   # the controller not told drafts' confidences

Prints, per workload, plain decoding's modeled seconds over the speculator's (bench runs plain
first, then the spec type, for each workload; use --repeats 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import draft_calibration  # noqa: E402
import speculant.adaptive as adaptive  # noqa: E402
import speculant.engine as engine  # noqa: E402
from speculant.cli import main  # noqa: E402


def run(mode: str, cli_args: list[str], ms: dict[int, float] = draft_calibration.ZEN3_MS) -> int:
    costs = draft_calibration.row_costs(ms)
    records: dict[int, dict] = {}
    order: list[dict] = []
    init = engine.Engine.__init__

    def recording_init(self, *a, **k):
        init(self, *a, **k)
        records[id(self.controller)] = rec = {"forward": 0.0, "draft": 0.0, "steps": 0}
        order.append(rec)

    c = adaptive.DraftLengthController
    observe_forward, observe_cost = c.observe_forward, c.observe_cost

    def forward(self, rows, seconds):
        if (rec := records.get(id(self))) is not None:
            rec["forward"] += costs.cost(rows)
            rec["steps"] += 1
        return observe_forward(self, rows, seconds)

    def cost(self, spec_type, seconds, n_tokens, seq_id=0):
        if (rec := records.get(id(self))) is not None:
            rec["draft"] += seconds
        return observe_cost(self, spec_type, seconds, n_tokens, seq_id)

    engine.Engine.__init__, c.observe_forward, c.observe_cost = recording_init, forward, cost
    rc = draft_calibration.blind(cli_args) if mode == "blind" else main(cli_args)
    for i in range(0, len(order) - 1, 2):
        plain, spec = order[i], order[i + 1]
        t_plain, t_spec = plain["forward"] + plain["draft"], spec["forward"] + spec["draft"]
        print(f"modeled run {i // 2}: plain {t_plain:.2f} s ({plain['steps']} steps), speculative {t_spec:.2f} s "
              f"(forwards {spec['forward']:.2f} + drafting {spec['draft']:.2f}, {spec['steps']} steps): {t_plain / t_spec:.3f}x")
    return rc


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("told", "blind"):
        sys.exit(__doc__)
    sys.exit(run(sys.argv[1], sys.argv[2:]))
