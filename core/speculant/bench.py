"""`speculant bench`: load time, peak memory and decode speed on workload files.

Workloads are JSON lists of {name, messages (chat-templated) or prompt (raw text), max_tokens}.
Each runs greedily in this process; decode speed is (tokens - 1) / (time from first to last token),
the same definition specbench.py uses from the client side.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

from tqdm import tqdm

from speculant.engine import Engine, EngineConfig
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
        return tok.encode(tok.apply_chat_template(workload["messages"], add_generation_prompt=True))
    return tok.encode(workload["prompt"], parse_special=False)


def run_workload(model, workload: dict, n_ctx: int, max_tokens: int | None, repeats: int) -> dict:
    prompt = prompt_tokens(model, workload)
    n_max = max_tokens or int(workload.get("max_tokens", 256))
    rates, prompt_rates, outputs = [], [], []
    for _ in range(repeats):
        engine = Engine(model, EngineConfig(n_ctx=n_ctx))
        t0 = time.perf_counter()
        stamps = []
        tokens = []
        for t in engine.generate(prompt, n_max):
            stamps.append(time.perf_counter())
            tokens.append(t)
        prompt_rates.append(len(prompt) / (stamps[0] - t0))
        if len(stamps) > 1:
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        outputs.append(tokens)
    return {
        "name": workload.get("name", "?"), "prompt_tokens": len(prompt), "completion_tokens": len(outputs[0]),
        "prompt_tok_s": statistics.median(prompt_rates), "decode_tok_s": statistics.median(rates) if rates else 0.0,
        "deterministic": all(o == outputs[0] for o in outputs),
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_bench(args, load) -> int:
    """`load(args)` loads the model (the CLI's loader, with its error handling)."""
    workloads = [w for path in args.workloads for w in load_workloads(path)]
    t0 = time.perf_counter()
    model = load(args)
    load_s = time.perf_counter() - t0
    rss_after_load = peak_rss_bytes()
    results = []
    for w in tqdm(workloads, desc="workloads", file=sys.stderr, leave=False):
        results.append(run_workload(model, w, args.ctx_size, args.n_predict, args.repeats))
    file_bytes = os.path.getsize(args.model)
    summary = {
        "model": os.path.basename(args.model), "load_s": load_s, "file_bytes": file_bytes,
        "peak_rss_after_load_bytes": rss_after_load, "peak_rss_bytes": peak_rss_bytes(),
        "threads": __import__("torch").get_num_threads(), "repeats": args.repeats, "workloads": results,
    }
    print(f"model {summary['model']}  load {load_s:.2f} s  peak RSS {summary['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"({summary['peak_rss_bytes'] / file_bytes:.2f}x file)")
    print(f"{'workload':<20} {'prompt':>6} {'gen':>5} {'prompt tok/s':>12} {'decode tok/s':>12}")
    for r in results:
        print(f"{r['name']:<20} {r['prompt_tokens']:>6} {r['completion_tokens']:>5} {r['prompt_tok_s']:>12.1f} {r['decode_tok_s']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
