#!/usr/bin/env python3
"""A multi-turn code-editing session, as a coding assistant drives a server: what a prompt cache is for.

Turn 1 sends a system message and a Python module (scripts/agent_session/module.py.txt, written
for this script) with a first instruction; every later turn sends the whole conversation so far,
the assistant's replies verbatim, plus the next instruction (scripts/agent_session/instructions.json).
Greedy, streamed. Per turn it records the time to the first content token (TTFT), the turn's wall
time, the prompt and completion tokens, the prompt tokens the server says it took from its cache
(`usage.prompt_tokens_details.cached_tokens`, or llama-server's `timings.cache_n`), and writes one
JSON line per turn plus a summary line to --out. Any OpenAI-compatible server:

  python scripts/agent_session.py --label ours --out session.jsonl -- \\
      speculant serve -m qwen2.5-coder-1.5b-instruct.gguf --port 8090 -c 4096 -np 1 --spec-type suffix,ngram-simple
  python scripts/agent_session.py --label llama --url http://127.0.0.1:8091 --out session.jsonl -- \\
      llama-server -m qwen2.5-coder-1.5b-instruct.gguf --port 8091 -t 2 -c 4096 -np 1 --spec-type ngram-simple

With no command after `--` it measures the server already running at --url.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import wait_healthy  # noqa: E402

HERE = Path(__file__).parent / "agent_session"
SYSTEM = "You are a coding assistant. Answer with code first, then at most two sentences."


def stream_chat(url: str, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """One streamed chat completion: its text, TTFT, wall time and the server's usage/timings."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, parts, usage, timings, chunks = None, [], {}, {}, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(text)
                    chunks += 1
    wall = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"text": "".join(parts), "ttft_s": ttft or wall, "wall_s": wall,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens", chunks),
            "cached_tokens": cached if cached is not None else timings.get("cache_n"),
            "timings": {k: timings[k] for k in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_per_second")
                        if k in timings}}


def session(args, run: int, out) -> dict:
    instructions = json.loads((HERE / "instructions.json").read_text())[: args.turns]
    module = (HERE / "module.py.txt").read_text()
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    t0 = time.perf_counter()
    for i, instruction in enumerate(instructions):
        content = f"{instruction}\n\n```python\n{module}```" if i == 0 else instruction
        messages.append({"role": "user", "content": content})
        turn = stream_chat(args.url, messages, args.max_tokens, args.extra)
        messages.append({"role": "assistant", "content": turn["text"]})
        row = {"label": args.label, "run": run, "turn": i + 1, **{k: v for k, v in turn.items() if k != "text"},
               "text_head": turn["text"][:60]}
        out.write(json.dumps(row) + "\n")
        turns.append(turn)
        print(f"{args.label} run {run} turn {i + 1}: prompt {turn['prompt_tokens']} cached {turn['cached_tokens']} "
              f"ttft {turn['ttft_s']:.2f} s, {turn['completion_tokens']} tokens in {turn['wall_s']:.2f} s", flush=True)
    total = time.perf_counter() - t0
    later = [t["ttft_s"] for t in turns[1:]]
    # The first token of a turn arrives at its TTFT, so a turn decodes n - 1 tokens after it.
    decode_s = sum(t["wall_s"] - t["ttft_s"] for t in turns)
    decode_n = sum(max((t["completion_tokens"] or 0) - 1, 0) for t in turns)
    summary = {"label": args.label, "run": run, "summary": True, "turns": len(turns), "session_s": total,
               "ttft_turn1_s": turns[0]["ttft_s"], "ttft_later_mean_s": sum(later) / len(later) if later else None,
               "ttft_later_max_s": max(later, default=None),
               "completion_tokens": sum(t["completion_tokens"] or 0 for t in turns),
               "decode_tok_s": decode_n / decode_s if decode_s else None,
               "texts": [t["text"] for t in turns]}
    out.write(json.dumps(summary) + "\n")
    print(f"{args.label} run {run}: session {total:.1f} s, TTFT turn 1 {turns[0]['ttft_s']:.2f} s, "
          f"turns 2+ mean {summary['ttft_later_mean_s'] or 0:.2f} s (max {summary['ttft_later_max_s'] or 0:.2f}), "
          f"decode {summary['decode_tok_s'] or 0:.2f} tok/s", flush=True)
    return summary


def main() -> int:
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8090")
    p.add_argument("--label", default="server")
    p.add_argument("--out", default="agent_session.jsonl")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeat", type=int, default=1, help="sessions in a row against the same server process")
    p.add_argument("--extra", type=json.loads, default={}, help='JSON merged into every request, e.g. \'{"cache_prompt": false}\'')
    args = p.parse_args(argv)
    # Keep the server's log beside --out, as serve_bench.py does: a crash mid-session is otherwise silent.
    log = open(f"{Path(args.out).with_suffix('')}.{args.label}.server.log", "w") if command else None
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) if command else None
    try:
        if server is not None:
            wait_healthy(args.url, server)
        with open(args.out, "a") as out:
            for run in range(args.repeat):
                session(args, run, out)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
