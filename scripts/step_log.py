#!/usr/bin/env python3
"""Per-step anatomy of one speculative configuration on one workload, in process: for every
engine step, the rows verified, the draft length and its spec type, the tokens it emitted and its
seconds; then totals by kind (no draft, short drafts, long drafts). Where a configuration's time
goes (docs/benchmarks.md, "Twelfth run").

    .venv/bin/python scripts/step_log.py --spec suffix,ngram-simple \\
        --extra "--spec-draft-n-max 47 --spec-suffix-max-depth 64 --no-spec-adaptive"
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from speculant import cli
from speculant.bench import load_workloads, prompt_tokens
from speculant.engine import Engine
from speculant.flags import engine_setup, load

MODEL = Path.home() / ".cache" / "speculant-models" / "qwen2.5-coder-1.5b-instruct.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("--spec", default="suffix,ngram-simple")
    ap.add_argument("--workloads", default="tests/data/workloads-public.json")
    ap.add_argument("--workload", default="code-edit-bisect")
    ap.add_argument("--extra", default="", help="more `speculant bench` flags, one string")
    ap.add_argument("--long", type=int, default=8, help="drafts of this many tokens or more count as long")
    ap.add_argument("--json", help="write the steps here")
    a = ap.parse_args()
    args = cli.build_parser().parse_args(["bench", "-m", a.model, "--workloads", a.workloads, "--spec-type", a.spec, *a.extra.split()])
    model = load(args)
    warm_up = getattr(model, "warm_up", None)
    if warm_up is not None:  # as `speculant serve` and `speculant bench`: no background work in the timed steps
        warm_up()
    workload = next(w for w in load_workloads(a.workloads) if w["name"] == a.workload)
    prompt = prompt_tokens(model, workload)
    config, specs = engine_setup(args, model)
    engine = Engine(model, config, specs)
    steps = []
    commit = engine._commit

    def logged(plan, out, seconds):
        draft = plan.decode[0].draft if plan.decode else None
        rows = sum(len(d.draft) + 1 if d.draft else 1 for d in plan.decode)
        proposed = engine._proposed.get(plan.decode[0].seq.seq_id) if plan.decode and draft else None  # before the controller's cut
        emitted = commit(plan, out, seconds)
        # a prompt's last chunk rides with the first decode step: such steps are counted apart
        steps.append({"rows": rows, "prompt_rows": len(plan.batch) - rows, "draft": len(draft) if draft else 0,
                      "spec_type": draft.spec_type if draft else "", "proposed": len(proposed) if proposed else 0,
                      "emitted": sum(len(v) for v in emitted.values()),
                      "tokens": [t for v in emitted.values() for t in v],
                      "seconds": seconds})
        return emitted

    engine._commit = logged
    t0 = time.perf_counter()
    tokens = list(engine.generate(prompt, int(workload.get("max_tokens", 256))))
    wall = time.perf_counter() - t0
    decode = [s for s in steps if s["emitted"] and not s["prompt_rows"]]
    print(f"{a.spec} on {a.workload}: {len(tokens)} tokens in {wall:.2f} s; {len(decode)} decode steps, "
          f"{len(steps) - len(decode)} with prompt rows ({sum(s['seconds'] for s in steps if s not in decode):.2f} s)")
    for name, keep in (("no draft", lambda s: s["draft"] == 0), (f"drafts < {a.long}", lambda s: 0 < s["draft"] < a.long),
                       (f"drafts >= {a.long}", lambda s: s["draft"] >= a.long)):
        part = [s for s in decode if keep(s)]
        print(f"  {name:12s} {len(part):4d} steps {sum(s['rows'] for s in part):5d} rows "
              f"{sum(s['emitted'] for s in part):4d} tokens {sum(s['seconds'] for s in part):6.2f} s")
    print("  drafts (length:accepted, /proposed where the controller cut it):",
          " ".join(f"{s['draft']}:{s['emitted'] - 1}" + (f"/{s['proposed']}" if s["proposed"] > s["draft"] else "")
                   for s in decode if s["draft"]))
    if a.json:
        Path(a.json).write_text(json.dumps(steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
