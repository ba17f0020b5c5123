#!/usr/bin/env python3
"""Several servers measured request by request, interleaved: every request of a round goes to
each server in turn before the next request is sent.

`serve_bench.py` measures one server at a time, so on a shared box two configurations compared
in a round were measured minutes apart, and a slow spell of the host landed on one of them only
(docs/benchmarks.md, "Thirty-eighth run": one round slow for every server of ours and none of
llama.cpp's). Here all servers of a round are up at once, idle but one, and each workload's
request is sent to all of them back to back, so a spell lasting a minute or more lands on all
of them; the order of the servers rotates from round to round. Each server is started fresh
every round and sees the workloads in the same order as under serve_bench.py (a speculator's
state carried from one request to the next, as a user's session carries it).

    python scripts/bench_interleaved.py --specbench ../shared/bench/specbench.py \\
        --workloads tests/data/workloads-public.json --rounds 3 --out paths.jsonl \\
        --server "ours-plain 8090 speculant serve -m M.gguf --port 8090 -t 2" \\
        --server "llama-plain 8091 llama-server -m M.gguf --port 8091 -t 2"

Writes one line per server and round in serve_bench.py's shape (label, server, single, peak_rss_mb)
plus "round"; specbench.py prints each request's line as it goes.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import peak_rss_mb, read, summarize, wait_healthy  # noqa: E402

SETTLE_S = 1.0  # between two requests: the last server's threads stop spinning (our pool, llama.cpp's --poll) first


def parse_server(spec: str) -> tuple[str, int, list[str]]:
    label, port, *cmd = shlex.split(spec)
    if not cmd:
        raise SystemExit(f"--server wants 'LABEL PORT COMMAND...', got {spec!r}")
    return label, int(port), cmd


def workload_names(path: str, only: str | None) -> list[str]:
    with open(path) as f:
        names = [w["name"] for w in json.load(f)]
    if only:
        keep = set(only.split(","))
        names = [n for n in names if n in keep]
    return names


def run_round(args, servers, names: list[str], round_no: int, out_dir: str) -> list[dict]:
    log_stem = os.path.splitext(args.out)[0]
    procs, logs = {}, []
    try:
        for label, port, cmd in servers:
            logs.append(open(f"{log_stem}.{label}.r{round_no}.server.log", "w"))
            procs[label] = subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT)
        for label, port, _ in servers:
            wait_healthy(f"http://127.0.0.1:{port}", procs[label])
        shift = round_no % len(servers)
        order = servers[shift:] + servers[:shift]
        for name in names:
            for label, port, _ in order:
                time.sleep(SETTLE_S)
                cmd = [sys.executable, args.specbench, "--url", f"http://127.0.0.1:{port}", "--workloads", args.workloads,
                       "--label", label, "--only", name, "--out", os.path.join(out_dir, f"{label}.jsonl")]
                if args.extra:
                    cmd += ["--extra", args.extra]
                subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        rss = {label: peak_rss_mb(procs[label].pid) for label, _, _ in servers}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
    return [{"label": label, "server": " ".join(cmd), "round": round_no,
             "single": summarize(read(os.path.join(out_dir, f"{label}.jsonl"))), "peak_rss_mb": rss[label]}
            for label, _, cmd in servers]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specbench", required=True)
    p.add_argument("--workloads", required=True)
    p.add_argument("--only", default=None, help="comma-separated workload names (in the file's order)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--extra", default=None, help="JSON merged into every request body")
    p.add_argument("--server", action="append", required=True, help="'LABEL PORT COMMAND...', once per server")
    p.add_argument("--out", required=True, help="append a JSON line per server and round here")
    args = p.parse_args()
    if os.path.isdir(args.out):  # found at the first round's end, a whole round of servers in (a sitting's first start)
        raise SystemExit(f"--out {args.out}: a directory; name the JSON lines file")
    servers = [parse_server(s) for s in args.server]
    if len({label for label, _, _ in servers}) < len(servers) or len({port for _, port, _ in servers}) < len(servers):
        raise SystemExit("each --server needs its own label and port")
    names = workload_names(args.workloads, args.only)
    for round_no in range(1, args.rounds + 1):
        print(f"== round {round_no}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            lines = run_round(args, servers, names, round_no, tmp)
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
