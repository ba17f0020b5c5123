#!/usr/bin/env python3
"""Concurrent multi-turn chat sessions against any OpenAI-compatible server: throughput, TTFT,
and, behind `speculant serve --ray`, how well the conversations kept to their replicas.

Each of --sessions sessions has its own first question; every later turn sends the whole
conversation so far plus a follow-up (greedy, streamed, as scripts/agent_session.py). It reports
the completion tokens per second over the whole run, TTFT of the first turns and of the later
ones (where a prompt cache pays), the fraction of prompt tokens taken from a cache, and, where
the server names its replica (`x-speculant-replica`), the sessions that stayed on one replica
and the replicas used. Also --probe N: N one-token requests in a row, the median latency (what
routing adds, against the same measure on a single server).

  python scripts/ray_sessions.py --url http://127.0.0.1:8080 --sessions 8 --turns 3 --max-tokens 48
  python scripts/ray_sessions.py --url http://127.0.0.1:8080 --probe 200
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
import urllib.request

SYSTEM = "You are a coding assistant. Answer with code first, then at most two sentences."
TOPICS = ["reverse a string", "parse a CSV line", "binary search", "a linked list", "merge two sorted lists",
          "count words in a file", "a stack with a max", "fizzbuzz", "a ring buffer", "matrix transpose",
          "an LRU cache", "run-length encoding", "balanced parentheses", "a trie", "quicksort", "gcd and lcm"]
FOLLOW = ["Add error handling.", "Now write a short test for it.", "Make it faster.", "Add type hints.", "Explain the complexity."]


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        replica = r.headers.get("x-speculant-replica")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice["delta"]["content"])
    return {"text": "".join(parts), "ttft": ttft if ttft is not None else time.perf_counter() - t0, "replica": replica,
            "prompt": usage.get("prompt_tokens", 0), "completion": usage.get("completion_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def session(url: str, i: int, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {i}: write a Python function for {TOPICS[i % len(TOPICS)]}."}]
    out = []
    for t in range(turns):
        turn = stream_chat(url, messages, max_tokens)
        out.append(turn)
        messages += [{"role": "assistant", "content": turn["text"]}, {"role": "user", "content": FOLLOW[t % len(FOLLOW)]}]
    return out


def probe(url: str, n: int) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 1, "temperature": 0}).encode()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"probe_n": n, "median_ms": round(statistics.median(times) * 1e3, 2),
                      "p90_ms": round(times[int(0.9 * (n - 1))] * 1e3, 2)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--probe", type=int, default=0, help="instead: this many one-token requests in a row")
    p.add_argument("--label", default="server")
    args = p.parse_args()
    if args.probe:
        probe(args.url, args.probe)
        return 0
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
        runs = list(pool.map(lambda i: session(args.url, i, args.turns, args.max_tokens), range(args.sessions)))
    wall = time.perf_counter() - t0
    turns = [t for run in runs for t in run]
    firsts, laters = [run[0]["ttft"] for run in runs], [t["ttft"] for run in runs for t in run[1:]]
    replicas = [{t["replica"] for t in run} for run in runs]
    summary = {
        "label": args.label, "sessions": args.sessions, "turns": args.turns, "wall_s": round(wall, 2),
        "completion_tok_s": round(sum(t["completion"] for t in turns) / wall, 2),
        "ttft_turn1_mean_s": round(statistics.mean(firsts), 3),
        "ttft_later_mean_s": round(statistics.mean(laters), 3) if laters else None,
        "cached_prompt_fraction": round(sum(t["cached"] for t in turns) / max(1, sum(t["prompt"] for t in turns)), 3),
        "later_turns_cached_fraction": round(sum(t["cached"] for run in runs for t in run[1:])
                                             / max(1, sum(t["prompt"] for run in runs for t in run[1:])), 3),
    }
    if all(None not in r for r in replicas):
        summary["sessions_on_one_replica"] = sum(len(r) == 1 for r in replicas)
        summary["replicas_used"] = len(set().union(*replicas))
        first = [run[0]["replica"] for run in runs]
        summary["sessions_per_replica"] = sorted((first.count(r) for r in set(first)), reverse=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
