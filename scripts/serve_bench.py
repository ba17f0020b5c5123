#!/usr/bin/env python3
"""Measure a server from the client side with specbench.py: one client, then N concurrent ones.

Starts the server command given after `--`, waits for /health, runs
  1. specbench.py once over the workloads (decode tok/s and time to first token per workload),
  2. --clients concurrent specbench.py processes over the same workloads (total tokens/s),
then stops the server. Works for `speculant serve` and llama-server alike:

  python scripts/serve_bench.py --specbench ../shared/bench/specbench.py \\
      --workloads tests/data/workloads-public.json --label spec --clients 8 --out results.jsonl -- \\
      speculant serve -m MODEL.gguf --port 8090 -np 4 --spec-type ngram-simple
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit("server not healthy in time")


def run_specbench(args, out: str, label: str) -> subprocess.Popen:
    cmd = [sys.executable, args.specbench, "--url", args.url, "--workloads", args.workloads, "--label", label, "--out", out]
    if args.only:
        cmd += ["--only", args.only]
    if args.extra:
        cmd += ["--extra", args.extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def peak_rss_mb(pid: int) -> float | None:
    """The server's peak resident memory (VmHWM), while it still runs."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(rows: list[dict]) -> list[dict]:
    """specbench.py's lines as a sitting keeps them: the request's figures and text, and the
    drafted and accepted tokens where the server reports them (draft rounds and ms: ours only)."""
    out = []
    for r in rows:
        s = {k: r.get(k) for k in ("workload", "completion_tokens", "ttft_s", "decode_tok_s", "text")}
        t = r.get("timings") or {}
        s.update(draft_n=t.get("draft_n"), draft_n_accepted=t.get("draft_n_accepted"),
                 draft_rounds=t.get("draft_rounds"), draft_ms=t.get("draft_ms"))
        out.append(s)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specbench", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--url", default="http://127.0.0.1:8090")
    p.add_argument("--label", required=True)
    p.add_argument("--clients", type=int, default=0, help="also run this many concurrent clients")
    p.add_argument("--only", default=None)
    p.add_argument("--extra", default=None, help="JSON merged into every request body")
    p.add_argument("--out", required=True, help="append a JSON summary line here")
    p.add_argument("server", nargs=argparse.REMAINDER, help="-- then the server command")
    args = p.parse_args()
    cmd = args.server[1:] if args.server[:1] == ["--"] else args.server
    log = open(os.path.splitext(args.out)[0] + f".{args.label}.server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    summary = {"label": args.label, "server": " ".join(cmd)}
    try:
        wait_healthy(args.url, server)
        with tempfile.TemporaryDirectory() as tmp:
            single = os.path.join(tmp, "single.jsonl")
            run_specbench(args, single, args.label).wait()
            summary["single"] = summarize(read(single))
            if args.clients:
                t0 = time.perf_counter()
                procs = [run_specbench(args, os.path.join(tmp, f"c{i}.jsonl"), f"{args.label}-c{i}") for i in range(args.clients)]
                for proc in procs:
                    proc.wait()
                wall = time.perf_counter() - t0
                tokens = sum(r["completion_tokens"] or 0 for i in range(args.clients) for r in read(os.path.join(tmp, f"c{i}.jsonl")))
                summary["concurrent"] = {"clients": args.clients, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}
    finally:
        summary["peak_rss_mb"] = peak_rss_mb(server.pid)
        server.terminate()
        server.wait(timeout=30)
    with open(args.out, "a") as f:
        f.write(json.dumps(summary) + "\n")
    for r in summary["single"]:
        ttft = r["ttft_s"] or 0.0
        drafted = f"  drafted {r['draft_n']} accepted {r['draft_n_accepted']}" if r.get("draft_n") is not None else ""
        print(f"{args.label:<24} {r['workload']:<18} tokens {r['completion_tokens']:>4}  ttft {ttft:6.2f} s  decode {r['decode_tok_s'] or 0:6.2f} tok/s{drafted}")
    print(f"{args.label:<24} peak RSS {summary['peak_rss_mb']} MB")
    if "concurrent" in summary:
        c = summary["concurrent"]
        print(f"{args.label:<24} {c['clients']} concurrent clients: {c['tokens']} tokens in {c['wall_s']:.1f} s = {c['tok_s']:.2f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
