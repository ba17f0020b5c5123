"""`speculant bench`: load time, peak memory and decode speed on workload files.

Workloads are JSON lists of {name, messages (chat-templated) or prompt (raw text), max_tokens}.
Each runs greedily in this process, first without speculation, then with every spec-type list
given (``--spec-type "ngram-simple;ngram-mod;ngram-simple,ngram-mod"``: ';' separates the
configurations compared, ',' chains speculators in one). Outputs must equal plain decoding's.
Decode speed is (tokens - 1) / (time from first to last token), as specbench.py measures it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

from speculant.engine import Engine
from speculant.errors import SpeculantError


def load_workloads(path: str) -> list[dict]:
    try:
        with open(path) as f:
            workloads = json.load(f)
    except OSError as e:
        raise SpeculantError(f"{path}: cannot read workloads ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise SpeculantError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(workloads, list) or not all(isinstance(w, dict) and ("messages" in w or "prompt" in w) for w in workloads):
        raise SpeculantError(f"{path}: expected a list of workloads, each with 'messages' or 'prompt'")
    return workloads


def prompt_tokens(model, workload: dict) -> list[int]:
    tok = model.tokenizer
    if "messages" in workload:
        return tok.encode_chat(workload["messages"], add_generation_prompt=True)
    return tok.encode(workload["prompt"], parse_special=False)


def run_once(model, prompt: list[int], n_max: int, config, speculators) -> dict:
    engine = Engine(model, config, speculators)
    t0 = time.perf_counter()
    stamps, tokens = [], []
    for t in engine.generate(prompt, n_max):
        stamps.append(time.perf_counter())
        tokens.append(t)
    decode_s = stamps[-1] - stamps[0]
    stats = engine.spec_stats
    return {
        "tokens": tokens, "prompt_tok_s": len(prompt) / (stamps[0] - t0),
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0,
        "drafts": sum(s.drafts for s in stats.values()), "drafted": sum(s.drafted for s in stats.values()),
        "accepted": sum(s.accepted for s in stats.values()), "declined": sum(s.declined for s in stats.values()),
        "produced": sum(s.produced for s in stats.values()),
        "draft_s": sum(s.draft_seconds for s in stats.values()), "verify_s": sum(s.verify_seconds for s in stats.values()),
        "decode_s": decode_s, "hook_s": engine.chain.hook_seconds,
        "accepted_at": {name: s.accepted_at for name, s in stats.items()},
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode speed (its counters belong together)."""
    return sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_bench(args, load) -> int:
    """`load(args)` loads the model (the CLI's loader, with its error handling)."""
    from speculant.flags import engine_setup

    if not args.workloads and not args.kernels:
        raise SpeculantError("bench needs --workloads FILE... or --kernels")
    workloads = [w for path in args.workloads for w in load_workloads(path)]
    t0 = time.perf_counter()
    model = load(args)
    load_s = time.perf_counter() - t0
    if args.kernels:
        from speculant.kernel_bench import run_kernel_bench

        print(f"model {os.path.basename(args.model)}  load {load_s:.2f} s")
        result = run_kernel_bench(args, model)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": os.path.basename(args.model), "load_s": load_s, **result}, f, indent=2)
        return 0
    warm_up = getattr(model, "warm_up", None)
    if warm_up is not None:  # what it prepares in the background would otherwise share the first run's cores
        warm_up()
    rss_after_load = peak_rss_bytes()
    names = ["none", *(c.strip() for c in (args.spec_type or "").split(";") if c.strip())]

    def setup(name: str):
        return engine_setup(argparse.Namespace(**{**vars(args), "spec_type": None if name == "none" else name}), model)

    for name in names:  # unknown spec types fail here, before any workload runs
        setup(name)

    rows = []
    for w in tqdm(workloads, desc="workloads", file=sys.stderr, leave=False):
        prompt = prompt_tokens(model, w)
        n_max = args.n_predict or int(w.get("max_tokens", 256))
        # Repeats interleave the configurations, so drift in machine speed hits them alike.
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                # Fresh speculators per run (ngram-mod's pool is shared by every sequence of one instance).
                config, speculators = setup(name)
                runs[name].append(run_once(model, prompt, n_max, config, speculators))
        baseline = median_run(runs["none"])
        for name in names:
            r = median_run(runs[name])
            r.update(workload=w.get("name", "?"), spec=name, prompt_tokens=len(prompt), completion_tokens=len(r["tokens"]),
                     identical=all(x["tokens"] == baseline["tokens"] for x in runs[name]),
                     speedup=r["decode_tok_s"] / baseline["decode_tok_s"] if baseline["decode_tok_s"] else 0.0)
            rows.append(r)

    file_bytes = os.path.getsize(args.model)
    threads = getattr(getattr(model, "backend", None), "threads", None) or torch.get_num_threads()
    peak = peak_rss_bytes()
    print(f"model {os.path.basename(args.model)}  load {load_s:.2f} s  peak RSS {peak / 2**30:.2f} GiB "
          f"({peak / file_bytes:.2f}x file)  threads {threads}  repeats {args.repeats}")
    print(f"{'workload':<18} {'spec':<26} {'gen':>4} {'prompt t/s':>10} {'decode t/s':>10} {'speedup':>7} "
          f"{'accept':>6} {'mean len':>8} {'declined':>8} {'draft/verify s':>14} {'draft ms/tok':>12} {'same':>4}")
    for r in rows:
        rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        mean_len = 1 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0
        per_token = 1000 * r["draft_s"] / r["produced"] if r["produced"] else 0.0  # calls without a draft included
        print(f"{r['workload']:<18} {r['spec']:<26} {r['completion_tokens']:>4} {r['prompt_tok_s']:>10.1f} "
              f"{r['decode_tok_s']:>10.2f} {r['speedup']:>6.2f}x {100 * rate:>5.0f}% {mean_len:>8.2f} {r['declined']:>8} "
              f"{r['draft_s']:>6.2f}/{r['verify_s']:<7.2f} {per_token:>12.2f} {'yes' if r['identical'] else 'NO':>4}")
    if args.json:
        summary = {"model": os.path.basename(args.model), "load_s": load_s, "file_bytes": file_bytes,
                   "peak_rss_after_load_bytes": rss_after_load, "peak_rss_bytes": peak,
                   "threads": threads, "repeats": args.repeats,
                   "results": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if not all(r["identical"] for r in rows):
        raise SpeculantError("speculative output differed from plain decoding (see the 'same' column)")
    return 0
