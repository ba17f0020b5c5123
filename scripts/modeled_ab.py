#!/usr/bin/env python3
"""Speculation settings compared where the box's speed does not move the result: in process, each
configuration runs every workload with the adaptive controller *observing* a fixed cost profile
(ms per forward by row count) instead of the forwards' measured seconds, and its decode time is
the profile's price of the forwards it ran plus the drafters' measured seconds. So what the
controller decides, and the time it is charged, depend on the text and the profile, not on what
else the two cores were doing (on a shared box one forward in a few runs twice as long, and
served medians of one configuration moved 10-30% between sittings). The output hash tells that
every configuration wrote the same tokens.

    .venv/bin/python scripts/dev_workloads.py > /tmp/dev.json
    SPECULANT_AMX=0 .venv/bin/python scripts/modeled_ab.py --workloads /tmp/dev.json \\
        "plain:" "n47:--spec-type suffix,ngram-simple --spec-draft-n-max 47 --spec-suffix-max-depth 64"

Tune on the development workloads (scripts/dev_workloads.py), never on the public ones. The
profile is a decode-time stand-in (rows past 1000-1400 cached tokens): prompts are not priced,
and the attention's growth with the context is not modeled. Scripts/modeled_bench.py prices runs
the same way but lets the controller see the measured seconds. Each workload runs on a fresh
engine unless `--one-engine`: then one engine takes them in order, as a server with one slot
does, so what the controller learned on one request (a copy's length classes) weighs on the next.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import draft_calibration  # noqa: E402
import speculant.adaptive as adaptive  # noqa: E402
from speculant import cli  # noqa: E402
from speculant.bench import load_workloads, prompt_tokens  # noqa: E402
from speculant.engine import Engine  # noqa: E402
from speculant.flags import engine_setup, load  # noqa: E402

MODEL = Path.home() / ".cache" / "speculant-models" / "qwen2.5-coder-1.5b-instruct.gguf"
# The 1.5B's verification forwards in the engine on a Zen 4 core's AVX-512 path (no AMX), 1000-1400
# cached tokens, code-edit-bisect steps (scripts/step_log.py, docs/benchmarks.md thirty-fifth run).
ZEN4_AVX512_MS = {1: 36, 2: 40, 3: 49, 4: 59, 5: 78, 6: 89, 8: 105, 10: 120, 12: 130, 16: 142, 17: 162,
                  20: 200, 24: 229, 32: 254, 34: 267, 40: 347, 48: 355}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="LABEL:FLAGS, FLAGS being `speculant bench` flags")
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--costs", help="JSON {rows: ms} of verification forwards (default: the Zen 4's AVX-512 path)")
    ap.add_argument("--one-engine", action="store_true",
                    help="run the workloads in order on one engine per configuration, as a server serves them "
                         "(the controller's record and the speculators' shared state carried from one to the next)")
    a = ap.parse_args()
    costs = draft_calibration.row_costs({int(k): float(v) for k, v in json.loads(a.costs).items()} if a.costs else ZEN4_AVX512_MS)
    charged = {"forward": 0.0, "draft": 0.0, "steps": 0}
    c = adaptive.DraftLengthController
    observe_forward, observe_cost = c.observe_forward, c.observe_cost

    def priced_forward(self, rows, seconds):
        modeled = costs.cost(rows)
        charged["forward"] += modeled
        charged["steps"] += 1
        return observe_forward(self, rows, modeled)

    def measured_cost(self, spec_type, seconds, n_tokens, seq_id=0):
        charged["draft"] += seconds
        return observe_cost(self, spec_type, seconds, n_tokens, seq_id)

    c.observe_forward, c.observe_cost = priced_forward, measured_cost
    model = None
    for config in a.configs:
        label, _, flags = config.partition(":")
        args = cli.build_parser().parse_args(["bench", "-m", a.model, "--workloads", a.workloads, *flags.split()])
        if model is None:
            model = load(args)
            model.warm_up()
        parts = []
        engine = None
        for w in load_workloads(a.workloads):
            if engine is None or not a.one_engine:
                engine_config, specs = engine_setup(args, model)  # a fresh engine: no speculator state carried
                engine = Engine(model, engine_config, specs)
            tokens = []
            for t in engine.generate(prompt_tokens(model, w), int(w.get("max_tokens", 256))):
                if not tokens:  # decode time runs from the first token, as `speculant bench` counts it
                    charged.update(forward=0.0, draft=0.0, steps=0)
                tokens.append(t)
            seconds = charged["forward"] + charged["draft"]
            digest = hashlib.sha1(str(tokens).encode()).hexdigest()[:8]
            parts.append(f"{w['name']} {(len(tokens) - 1) / seconds:7.2f} tok/s ({charged['steps']} steps, "
                         f"drafting {charged['draft']:.2f} s, {digest})")
        print(f"{label:20s} " + " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
