"""Soak test for `speculant serve`: mixed concurrent traffic for a long time, watching for
wrong output, unexpected errors and memory growth. Not part of CI.

The lead's 30-minute run (starts the server itself, `-np 4`, on the real target):

    .venv/bin/python scripts/soak.py --minutes 30 --report soak-report.json

Against a server that is already running (RSS is sampled only when its PID is given):

    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8080 --pid 12345 --minutes 30

What it does:

1. Starts `speculant serve -m MODEL -np 4 --spec-type ngram-simple,suffix` (unless --url), waits
   for /health.
2. Records a reference once per prompt: each prompt of the pool (chat and raw-completion prompts
   of varied lengths, each with its own max_tokens), temperature 0, sent alone.
3. For --minutes, --clients concurrent clients send a weighted mix of:
   - chat, chat-stream, completions, completions-stream, llama-completion(-stream):
     healthy temperature-0 requests, some asking for a speculation type of their own
     (`speculative.type`: one of the server's types, or "none"). Their text must equal the
     prompt's reference, whatever else is running. Some non-streamed chat requests ask for
     logprobs (one entry per token) or n = 2 (both choices the reference); "tools" offers a
     function and must call it as its reference did;
   - disconnect: a stream the client closes after a few chunks;
   - bad-json, bad-type, over-long (prompt past the context, or max_tokens >= the context),
     lone-surrogate: each must get its 4xx.
4. Samples the server's VmRSS (/proc/PID/status) and /health every 10 s.
5. Writes a JSON report and prints a markdown summary: requests by kind, errors by cause
   (expected 4xx by kind vs unexpected: 5xx, timeouts, connection errors, wrong statuses),
   p50/p99 latency per kind, RSS over time (first, max, last, growth after the warm-up),
   mismatches against the references. Exit code 1 if anything unexpected happened.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))
DEFAULT_MODEL = MODELS / "qwen2.5-coder-1.5b-instruct.gguf"

# (kind, weight). Healthy kinds are checked against the references.
HEALTHY = ["chat", "chat-stream", "completions", "completions-stream", "llama-completion", "llama-completion-stream", "tools"]
BAD = {"bad-json": 400, "bad-type": 400, "over-long": (400, 413), "lone-surrogate": 400}
MIX = [("chat", 6), ("chat-stream", 6), ("completions", 4), ("completions-stream", 3), ("llama-completion", 2),
       ("llama-completion-stream", 2), ("tools", 2), ("disconnect", 2), ("bad-json", 1), ("bad-type", 1),
       ("over-long", 1), ("lone-surrogate", 1)]
# Healthy non-streamed chat requests also ask, at random, for logprobs (top 3) or n = 2 choices:
# the text must still be the reference (every choice's, at temperature 0).
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_QUESTIONS = ["What is the weather in Paris right now?", "Is it raining in Oslo?"]

CODE = '''def merge_sort(values):
    if len(values) <= 1:
        return values
    middle = len(values) // 2
    left = merge_sort(values[:middle])
    right = merge_sort(values[middle:])
    out = []
    while left and right:
        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return out + left + right
'''

CHAT_PROMPTS = [  # (user message, max_tokens)
    ("Say hello in one word.", 8),
    ("Write a C function that returns the larger of two ints.", 48),
    ("Add type hints to this Python function. Output only the code.\n```python\n" + CODE + "```", 64),
    ("List three sorting algorithms, one per line.", 24),
    ("Rename `values` to `items` in this code and output the whole function.\n```python\n" + CODE * 3 + "```", 64),
    ("What does HTTP status 413 mean? One sentence.", 32),
]
TEXT_PROMPTS = [  # (raw prompt, max_tokens)
    ("def fibonacci(n):", 32),
    ("# A table of the first five primes\n| n | prime |\n|---|---|\n| 1 | 2 |\n", 40),
    (CODE + "\n\ndef insertion_sort(values):", 64),
    ("The capital of France is", 8),
    ("import json\n\n\ndef load(path):\n    with open(path) as f:\n", 24),
    ((CODE + "\n") * 4 + "# The same function again, unchanged:\n", 48),
]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, args, url: str, pid: int | None):
        self.args, self.url, self.pid = args, url.rstrip("/"), pid
        self.rng = random.Random(args.seed)
        self.spec_types = [t for t in args.spec_type.split(",") if t] if args.spec_type else []
        self.reference: dict[tuple[str, int], str] = {}
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.served: Counter = Counter()  # kind -> requests that went as they should
        self.expected: Counter = Counter()  # (kind, status) of the 4xx the bad kinds must get
        self.unexpected: list[dict] = []
        self.mismatches: list[dict] = []
        self.rss: list[tuple[float, int]] = []  # (seconds since the load started, KiB)
        self.health_failures: list[dict] = []
        self.t0 = 0.0
        self.timeout = aiohttp.ClientTimeout(total=args.request_timeout)

    # --- requests ---------------------------------------------------------------------------
    def body(self, kind: str, family: str, i: int, spec: str | None) -> tuple[str, dict]:
        """The path and JSON body of a healthy request of `kind` for prompt i of `family`."""
        stream = kind.endswith("-stream")
        if family == "chat":
            text, n = CHAT_PROMPTS[i]
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0}
            path = "/v1/chat/completions"
        else:
            text, n = TEXT_PROMPTS[i]
            if kind.startswith("llama"):
                path, body = "/completion", {"prompt": text, "n_predict": n, "temperature": 0}
            else:
                path, body = "/v1/completions", {"prompt": text, "max_tokens": n, "temperature": 0}
        if stream:
            body["stream"] = True
        if spec is not None:
            if path == "/completion":
                body["speculative.type"] = spec
            else:
                body["speculative"] = {"type": spec}
        return path, body

    async def generate(self, session, path: str, body: dict) -> tuple[int, str, dict | None]:
        """(status, generated text, error body or None)."""
        async with session.post(self.url + path, json=body, timeout=self.timeout) as r:
            if not body.get("stream"):
                data = await r.json(content_type=None)
                if r.status != 200:
                    return r.status, "", data
                if "choices" in data:
                    texts = []
                    for c in data["choices"]:
                        message = c.get("message") or {}
                        text = message.get("content") or c.get("text") or ""
                        if message.get("tool_calls"):  # a call, as "name(arguments)"
                            text += "".join(f"{t['function']['name']}({t['function']['arguments']})"
                                            for t in message["tool_calls"])
                        if body.get("logprobs") is True:  # one logprob entry per generated token
                            got = len(((c.get("logprobs") or {}).get("content")) or [])
                            if got != data["usage"]["completion_tokens"]:
                                text += f" <{got} logprobs for {data['usage']['completion_tokens']} tokens>"
                        texts.append(text)
                    if len(set(texts)) > 1:  # n choices at temperature 0 must be one text
                        return r.status, " | ".join(texts), None
                    return r.status, texts[0], None
                return r.status, data.get("content", ""), None
            if r.status != 200:
                return r.status, "", await r.json(content_type=None)
            out, error = [], None
            async for raw in r.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev
                for c in ev.get("choices", []):
                    out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                out.append(ev.get("content", "") if "choices" not in ev else "")
            return (500 if error else 200), "".join(out), error

    async def record_references(self, session) -> None:
        for family, prompts in (("chat", CHAT_PROMPTS), ("text", TEXT_PROMPTS)):
            for i in range(len(prompts)):
                path, body = self.body("chat" if family == "chat" else "completions", family, i, None)
                status, text, err = await self.generate(session, path, body)
                if status != 200:
                    raise SystemExit(f"reference request failed: {status} {err}")
                self.reference[(family, i)] = text
        for i in range(len(TOOL_QUESTIONS)):
            status, text, err = await self.generate(session, *self.tool_body(i))
            if status != 200:
                raise SystemExit(f"reference request failed: {status} {err}")
            self.reference[("tools", i)] = text

    def tool_body(self, i: int) -> tuple[str, dict]:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": TOOL_QUESTIONS[i]}],
                                        "tools": [WEATHER], "max_tokens": 48, "temperature": 0}

    async def healthy(self, session, kind: str) -> None:
        family = "tools" if kind == "tools" else "chat" if kind.startswith("chat") else "text"
        i = self.rng.randrange({"chat": len(CHAT_PROMPTS), "text": len(TEXT_PROMPTS), "tools": len(TOOL_QUESTIONS)}[family])
        spec = None
        if self.spec_types and self.rng.random() < 0.4:
            spec = self.rng.choice(self.spec_types + ["none", ",".join(self.spec_types)])
        if family == "tools":
            path, body = self.tool_body(i)
            if spec is not None:
                body["speculative"] = {"type": spec}
        else:
            path, body = self.body(kind, family, i, spec)
        if kind == "chat":
            extra = self.rng.random()
            if extra < 0.25:
                body.update(logprobs=True, top_logprobs=3)
            elif extra < 0.4:
                body["n"] = 2
        t = time.perf_counter()
        status, text, err = await self.generate(session, path, body)
        self.latency[kind].append(time.perf_counter() - t)
        if status != 200:
            self.fail(kind, f"status {status}", {"path": path, "error": err})
            return
        want = self.reference[(family, i)]
        if text != want:
            self.mismatches.append({"kind": kind, "family": family, "prompt": i, "spec": spec,
                                    "want": want, "got": text, "at_s": round(time.monotonic() - self.t0, 1)})
            return
        self.served[kind] += 1

    async def disconnect(self, session) -> None:
        path, body = self.body("chat-stream", "chat", self.rng.randrange(len(CHAT_PROMPTS)), None)
        body["max_tokens"] = 200
        t = time.perf_counter()
        async with session.post(self.url + path, json=body, timeout=self.timeout) as r:
            if r.status != 200:
                self.fail("disconnect", f"status {r.status}", {"body": await r.text()})
                return
            n = 0
            async for _ in r.content:
                n += 1
                if n >= self.rng.randint(1, 6):
                    break
            r.close()  # drops the connection mid-stream
        self.latency["disconnect"].append(time.perf_counter() - t)
        self.served["disconnect"] += 1

    async def bad(self, session, kind: str) -> None:
        headers = {"Content-Type": "application/json"}
        if kind == "bad-json":
            data = self.rng.choice(['{"messages": [', '{"prompt": "x", "max_tokens": 4,}', "not json", "[1, 2"]).encode()
            path = self.rng.choice(["/v1/chat/completions", "/v1/completions", "/completion"])
        elif kind == "bad-type":
            path, body = self.rng.choice([
                ("/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "four"}),
                ("/v1/completions", {"prompt": "hi", "temperature": "hot"}),
                ("/completion", {"prompt": 5, "n_predict": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "speculative": {"type": 3}}),
            ])
            data = json.dumps(body).encode()
        elif kind == "over-long":
            path, body = self.rng.choice([
                ("/v1/completions", {"prompt": "word " * (self.args.ctx_size * 2), "max_tokens": 4}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": self.args.ctx_size}),
                ("/completion", {"prompt": "x" * (self.args.ctx_size * 200), "n_predict": 4}),
            ])
            data = json.dumps(body).encode()
        else:  # lone-surrogate: JSON escapes that decode to an unpaired surrogate
            path, raw = self.rng.choice([
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'),
                ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}'),
                ("/completion", '{"prompt": "hi", "n_predict": 2, "stop": ["\\udc00"]}'),
            ])
            data = raw.encode()
        t = time.perf_counter()
        async with session.post(self.url + path, data=data, headers=headers, timeout=self.timeout) as r:
            await r.read()
            status = r.status
        self.latency[kind].append(time.perf_counter() - t)
        want = BAD[kind]
        if status in (want if isinstance(want, tuple) else (want,)):
            self.expected[(kind, status)] += 1
            self.served[kind] += 1
        else:
            self.fail(kind, f"status {status}", {"path": path})

    def fail(self, kind: str, cause: str, detail: dict) -> None:
        self.unexpected.append({"kind": kind, "cause": cause, "at_s": round(time.monotonic() - self.t0, 1),
                                **{k: (str(v)[:500]) for k, v in detail.items()}})

    async def one(self, session, kind: str) -> None:
        try:
            if kind in HEALTHY:
                await self.healthy(session, kind)
            elif kind == "disconnect":
                await self.disconnect(session)
            else:
                await self.bad(session, kind)
        except asyncio.TimeoutError:
            self.fail(kind, "timeout", {})
        except aiohttp.ClientError as e:
            self.fail(kind, f"connection: {type(e).__name__}", {"error": e})
        except (ValueError, KeyError) as e:  # an answer we could not parse
            self.fail(kind, f"bad answer: {type(e).__name__}", {"error": e})

    async def client(self, session, end: float) -> None:
        kinds, weights = zip(*MIX)
        while time.monotonic() < end:
            await self.one(session, self.rng.choices(kinds, weights)[0])

    async def monitor(self, session, end: float) -> None:
        while True:
            now = time.monotonic() - self.t0
            if self.pid is not None:
                kib = rss_kib(self.pid)
                if kib is not None:
                    self.rss.append((round(now, 1), kib))
            try:
                async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status != 200:
                        self.health_failures.append({"at_s": round(now, 1), "status": r.status})
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.health_failures.append({"at_s": round(now, 1), "error": type(e).__name__})
            if time.monotonic() >= end:
                return
            await asyncio.sleep(min(self.args.sample_every, max(0.0, end - time.monotonic())))

    async def run(self) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            t = time.perf_counter()
            await self.record_references(session)
            self.reference_s = time.perf_counter() - t
            print(f"references: {len(self.reference)} prompts in {self.reference_s:.1f} s", file=sys.stderr)
            self.t0 = time.monotonic()
            end = self.t0 + self.args.minutes * 60
            await asyncio.gather(self.monitor(session, end), *[self.client(session, end) for _ in range(self.args.clients)])
            self.load_s = time.monotonic() - self.t0
            try:
                async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    self.metrics = {l.split()[0]: float(l.split()[1]) for l in (await r.text()).splitlines()
                                    if l and not l.startswith("#") and "{" not in l and len(l.split()) == 2}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                self.metrics = {}

    # --- the report ---------------------------------------------------------------------------
    def report(self) -> dict:
        warm = self.args.warmup_minutes * 60
        after = [k for s, k in self.rss if s >= warm]
        rss = {
            "samples_kib": self.rss,
            "first_mib": self.rss[0][1] / 1024 if self.rss else None,
            "max_mib": max(k for _, k in self.rss) / 1024 if self.rss else None,
            "last_mib": self.rss[-1][1] / 1024 if self.rss else None,
            "warmup_s": warm,
            "growth_after_warmup_mib": (after[-1] - after[0]) / 1024 if len(after) >= 2 else None,
        }
        errors = Counter(f"{u['kind']}: {u['cause']}" for u in self.unexpected)
        return {
            "url": self.url, "minutes": self.args.minutes, "clients": self.args.clients, "seed": self.args.seed,
            "spec_types": self.spec_types, "load_s": round(self.load_s, 1), "reference_s": round(self.reference_s, 1),
            "served": dict(self.served),
            "expected_4xx": {f"{k} {s}": n for (k, s), n in sorted(self.expected.items())},
            "unexpected": dict(errors), "unexpected_samples": self.unexpected[:50],
            "mismatches": len(self.mismatches), "mismatch_samples": self.mismatches[:20],
            "latency_s": {k: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)} for k, v in sorted(self.latency.items())},
            "rss": rss, "health_failures": self.health_failures,
            "metrics": {k: v for k, v in getattr(self, "metrics", {}).items() if "requests" in k or "tokens_predicted_total" in k},
        }

    @staticmethod
    def markdown(r: dict) -> str:
        f = lambda v, fmt="{:.2f}": "–" if v is None else fmt.format(v)  # noqa: E731
        out = [f"## Soak: {r['minutes']} min, {r['clients']} clients, {r['url']}, spec types {','.join(r['spec_types']) or 'none'}", ""]
        out += ["| kind | served | p50 s | p99 s |", "|---|---|---|---|"]
        for k, lat in r["latency_s"].items():
            out.append(f"| {k} | {r['served'].get(k, 0)} | {f(lat['p50'])} | {f(lat['p99'])} |")
        out += ["", f"Total served as expected: {sum(r['served'].values())} in {r['load_s']} s "
                    f"(references: {r['reference_s']} s before the load)."]
        out += ["", "**Expected 4xx**: " + (", ".join(f"{k}: {n}" for k, n in r["expected_4xx"].items()) or "none")]
        out += ["", "**Unexpected errors**: " + (", ".join(f"{k}: {n}" for k, n in r["unexpected"].items()) or "none")]
        out += ["", f"**Mismatches** against the references: {r['mismatches']}"]
        out += ["", f"**/health failures**: {len(r['health_failures'])}"]
        rss = r["rss"]
        out += ["", f"**RSS** (MiB): first {f(rss['first_mib'], '{:.0f}')}, max {f(rss['max_mib'], '{:.0f}')}, "
                    f"last {f(rss['last_mib'], '{:.0f}')}, growth after the first {rss['warmup_s'] / 60:g} min "
                    f"{f(rss['growth_after_warmup_mib'], '{:+.0f}')} ({len(rss['samples_kib'])} samples)"]
        if rss["samples_kib"]:
            step = max(1, len(rss["samples_kib"]) // 12)
            out.append("RSS over time: " + ", ".join(f"{s:.0f}s {k / 1024:.0f}" for s, k in rss["samples_kib"][::step]))
        return "\n".join(out)


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    port = args.port or free_port()
    log_path = Path(args.server_log)
    # this interpreter, so the server runs the same speculant as the soak (a venv, or a tree on PYTHONPATH)
    cmd = [sys.executable, "-m", "speculant.cli", "serve", "-m", str(args.model), "-np", "4", "-c", str(args.ctx_size),
           "--port", str(port)]
    if args.spec_type:
        cmd += ["--spec-type", args.spec_type]
    cmd += args.server_arg
    print("server: " + " ".join(cmd) + f"  (log: {log_path})", file=sys.stderr)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, log_path
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy within 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--pid", type=int, help="with --url: the server's PID, to sample its RSS")
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL), help="target model when starting the server")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="the server's context (default 4096)")
    p.add_argument("--spec-type", default="ngram-simple,suffix",
                   help="the server's --spec-type; requests pick among these and 'none' (default ngram-simple,suffix)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for `speculant serve` (repeatable)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6: more than the 4 slots)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before it counts as a timeout")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS and /health samples")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="RSS growth is measured after this")
    p.add_argument("--report", default="soak-report.json", help="JSON report path")
    p.add_argument("--server-log", default="soak-server.log", help="the started server's output")
    args = p.parse_args()

    proc = None
    if args.url:
        url, pid = args.url, args.pid
    else:
        proc, url, _ = start_server(args)
        pid = proc.pid
    soak = Soak(args, url, pid)
    try:
        asyncio.run(soak.run())
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"server exited with {code}", file=sys.stderr)
    r = soak.report()
    if proc is not None:
        r["server_exit_code"] = code
    Path(args.report).write_text(json.dumps(r, indent=1))
    print(Soak.markdown(r))
    print(f"\nreport: {args.report}")
    bad = r["unexpected"] or r["mismatches"] or r["health_failures"] or (proc is not None and code != 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
