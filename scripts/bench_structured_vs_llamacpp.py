"""Structured outputs against llama-server, one sitting: JSON extraction and tool calls, with and
without constraints and speculation (issue 23).

Starts one `speculant serve` (`--spec-type suffix,ngram-simple`, the speculator chosen per
request) and three llama-servers (plain, `--spec-type ngram-simple`, `--spec-type ngram-map-k`:
llama-server takes no per-request speculation), all `-t 2 -c 4096 -np 1`, then sends every
request of scripts/workloads/structured.json to every case, greedy, one at a time, the cases
alternated item by item, for --rounds rounds. Only one server works at a time; the others wait
idle. Per request it records the server's own decode timings (`timings.predicted_n`,
`predicted_ms`), drafted/accepted tokens, for speculant the grammar drafter's share (the
/metrics counters of spec_type="grammar" before and after), and whether the output parses and
validates. At the end (servers stopped) it times speculant's grammar mask in-process along the
real outputs: llguidance's mask over the whole vocabulary, per token.

    LLAMA_SERVER=/tmp/llamacpp/.../build/bin/llama-server \\
      .venv/bin/python scripts/bench_structured_vs_llamacpp.py --rounds 3 --out /tmp/structured.jsonl

Cases (JSON extraction; `schema` = response_format json_schema, the same schema to both):
  ours free plain, ours schema plain (`speculative.n_max: 0`), ours schema grammar drafter only
  (`speculative.type: none`), ours schema + ngram-simple, ours schema + suffix, ours free +
  suffix; llama free plain, llama schema plain, llama schema + ngram-simple, llama schema +
  ngram-map-k. Tool calls: each request with tool_choice auto and required, on the same servers
  (ours: plain, grammar only, ngram-simple, suffix; llama: plain, ngram-simple, ngram-map-k).

Suffix decoding's shared index of earlier outputs is off (`--spec-suffix-max-cached-tokens 0`):
the rounds repeat the same requests, and with it on, later rounds would draft the earlier
answers whole.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.expanduser("~/.cache/speculant-models")


def post(url, body, timeout=900):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"}


def grammar_counters(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for name in ("draft_tokens", "accepted_tokens"):
        m = re.search(rf'speculant:spec_decode_num_{name}_total\{{spec_type="grammar"\}} (\S+)', text)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def wait_healthy(url, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy in time")


def validate(value, schema):
    """None when `value` is valid against `schema`, else the first error (jsonschema, if installed)."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(value, schema)
        return None
    except jsonschema.ValidationError as e:
        return e.message[:200]


def check_json(text, schema):
    if text is None:
        return "no content"
    try:
        value = json.loads(text)
    except ValueError:
        return "does not parse"
    err = validate(value, schema)
    return "valid" if err is None else f"invalid: {err}"


def check_tools(message, item):
    calls = message.get("tool_calls") or []
    if not calls:
        return "no call (text)"
    c = calls[0]["function"]
    if c["name"] != item["expected_tool"]:
        return f"called {c['name']}"
    try:
        args = json.loads(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"]
    except ValueError:
        return "arguments do not parse"
    schema = next(t["function"]["parameters"] for t in item["tools"] if t["function"]["name"] == c["name"])
    err = validate(args, schema)
    return ("valid" if err is None else f"invalid: {err}") + (f" (+{len(calls) - 1} calls)" if len(calls) > 1 else "")


def cases(which):
    """(label, server, extra body fields, constrained?) per workload kind."""
    ours = {
        "json": [
            ("ours free plain", "ours", {"speculative.n_max": 0}, False),
            ("ours free suffix", "ours", {"speculative.type": "suffix"}, False),
            ("ours schema plain", "ours", {"speculative.n_max": 0}, True),
            ("ours schema grammar-only", "ours", {"speculative.type": "none"}, True),
            ("ours schema ngram-simple", "ours", {"speculative.type": "ngram-simple"}, True),
            ("ours schema suffix", "ours", {"speculative.type": "suffix"}, True),
        ],
        "tools": [
            ("ours plain", "ours", {"speculative.n_max": 0}, None),
            ("ours grammar-only", "ours", {"speculative.type": "none"}, None),
            ("ours ngram-simple", "ours", {"speculative.type": "ngram-simple"}, None),
            ("ours suffix", "ours", {"speculative.type": "suffix"}, None),
        ],
    }
    llama = {
        "json": [
            ("llama free plain", "llama-plain", {}, False),
            ("llama schema plain", "llama-plain", {}, True),
            ("llama schema ngram-simple", "llama-ngram-simple", {}, True),
            ("llama schema ngram-map-k", "llama-ngram-map-k", {}, True),
        ],
        "tools": [
            ("llama plain", "llama-plain", {}, None),
            ("llama ngram-simple", "llama-ngram-simple", {}, None),
            ("llama ngram-map-k", "llama-ngram-map-k", {}, None),
        ],
    }
    out = {}
    for kind in ("json", "tools"):
        a, b = ours[kind], llama[kind] if which["llama"] else []
        # interleave the two servers' cases: ours, llama, ours, llama, ...
        merged = []
        for i in range(max(len(a), len(b))):
            merged += a[i:i + 1] + b[i:i + 1]
        out[kind] = merged
    return out


def start_servers(args):
    t = args.model
    common = ["-c", "4096", "-np", "1", "-t", str(args.threads)]
    servers = {
        "ours": (f"http://127.0.0.1:{args.port}", [os.path.join(ROOT, ".venv/bin/speculant"), "serve", "-m", t, "--port", str(args.port),
                 *common, "--spec-type", "suffix,ngram-simple", "--spec-suffix-max-cached-tokens", "0"]),
    }
    if args.llama_server:
        for k, (name, flags) in enumerate([("llama-plain", []), ("llama-ngram-simple", ["--spec-type", "ngram-simple"]),
                                           ("llama-ngram-map-k", ["--spec-type", "ngram-map-k"])]):
            port = args.port + 1 + k
            servers[name] = (f"http://127.0.0.1:{port}", [args.llama_server, "-m", t, "--port", str(port), *common, "--jinja", *flags])
    procs = {}
    for name, (url, cmd) in servers.items():
        log = open(os.path.splitext(args.out)[0] + f".{name}.log", "w")
        print(f"# {name}: {' '.join(cmd)}", flush=True)
        procs[name] = (url, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), cmd)
    for name, (url, proc, _) in procs.items():
        wait_healthy(url, proc)
    return procs


def request_body(kind, item, extra, constrained, tool_choice, max_tokens):
    if kind == "json":
        body = {"messages": [{"role": "user", "content": item["prompt"]}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": item["schema_name"], "schema": item["schema"]}}
    else:
        body = {"messages": item["messages"], "tools": item["tools"], "tool_choice": tool_choice}
    return {**body, "max_tokens": max_tokens, "temperature": 0, **extra}


def run(args, procs, workloads, out):
    plan = cases({"llama": bool(args.llama_server)})
    jobs = []  # (kind, item, case, tool_choice)
    for item in workloads["json_extraction"]:
        for case in plan["json"]:
            jobs.append(("json", item, case, None))
    for item in workloads["tool_calls"]:
        for choice in ("auto", "required"):
            for case in plan["tools"]:
                jobs.append(("tools", item, case, choice))
    if args.only:
        jobs = [j for j in jobs if re.search(args.only, f"{j[0]} {j[1]['name']} {j[2][0]} {j[3]}")]
    # warm-up: each server's first structured request (llguidance's vocabulary, 0.4 s) and first tool request
    for name, (url, _, _) in procs.items():
        item = workloads["json_extraction"][0]
        post(url, request_body("json", item, {}, True, None, 8))
        post(url, request_body("tools", workloads["tool_calls"][0], {}, None, "required", 8))
    for r in range(args.rounds):
        for kind, item, (label, server, extra, constrained), choice in jobs:
            url = procs[server][0]
            ours = server == "ours"
            before = grammar_counters(url) if ours else None
            t0 = time.perf_counter()
            body = post(url, request_body(kind, item, extra, constrained, choice, args.max_tokens if kind == "json" else args.tool_max_tokens))
            wall = time.perf_counter() - t0
            after = grammar_counters(url) if ours else None
            row = {"round": r, "kind": kind, "item": item["name"], "case": label, "server": server,
                   "tool_choice": choice, "constrained": constrained if kind == "json" else choice == "required", "wall_s": wall}
            if "error" in body:
                row["error"] = body["error"]
            else:
                t = body.get("timings") or {}
                ch = body["choices"][0]
                msg = ch["message"]
                row.update({k: t.get(k) for k in ("prompt_n", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted")})
                row["finish_reason"] = ch.get("finish_reason")
                row["content"] = msg.get("content")
                row["tool_calls"] = [c["function"] for c in msg.get("tool_calls") or []] or None
                row["check"] = check_json(msg.get("content"), item["schema"]) if kind == "json" else check_tools(msg, item)
                if ours:
                    row["grammar_drafted"] = after["draft_tokens"] - before["draft_tokens"]
                    row["grammar_accepted"] = after["accepted_tokens"] - before["accepted_tokens"]
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            g = f" grammar {row['grammar_drafted']:.0f}/{row['grammar_accepted']:.0f}" if row.get("grammar_drafted") is not None else ""
            d = f" drafted {row.get('draft_n')} acc {row.get('draft_n_accepted')}" if row.get("draft_n") is not None else ""
            print(f"r{r} {kind:5s} {item['name']:15s} {label:28s} {choice or '':8s} "
                  + (f"ERROR {row['error']}" if "error" in row else
                     f"{row['predicted_n']:4d} tok {row['predicted_per_second']:6.2f} tok/s{d}{g} {row['check']}"), flush=True)


def mask_cost(args, rows, workloads):
    """The grammar's cost per token along ours' constrained outputs, in this process, torch on
    --threads threads as in the server, per token position: the next-token mask as the engine
    builds it (GrammarConstraint.mask(): llguidance's bitmask over the whole vocabulary, expanded
    to a bool row), the bitmask alone, the greedy fast path (valid_prefix of the argmax: when the
    grammar allows the model's own choice no mask is built), forced() (the grammar drafter's
    fast-forward tokens, asked once a step) and advance()."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "server"))
    from speculant.gguf import Tokenizer
    from speculant_server.grammar import Grammars
    from speculant_server.protocol import GrammarSpec

    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_gguf(args.model)
    grammars = Grammars(tok, args.n_vocab)
    grammars.lltokenizer()
    items = {i["name"]: i for i in workloads["json_extraction"]}
    seen = set()
    names = ("mask", "bitmask", "check", "forced", "advance")
    times = {k: [] for k in names}
    for row in rows:
        if row.get("case") != "ours schema plain" or row["item"] in seen or not row.get("content"):
            continue
        seen.add(row["item"])
        g = grammars.compile(GrammarSpec("json", items[row["item"]]["schema"], "response_format"))
        ids = tok.encode(row["content"], add_special=False, parse_special=False)
        per = {k: [] for k in names}
        for _ in range(3):
            c = grammars.constraint(g)
            for t in ids:
                t0 = time.perf_counter()
                c.mask()
                t1 = time.perf_counter()
                c._fill()
                t2 = time.perf_counter()
                ok = c.valid_prefix((t,))
                t3 = time.perf_counter()
                c.forced()
                t4 = time.perf_counter()
                c.advance(t)
                t5 = time.perf_counter()
                for k, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    per[k].append(dt)
                if ok != 1 or c.error:
                    break
        for k in names:
            times[k] += per[k]
        print(f"mask {row['item']:15s} {len(ids):4d} tokens{' (STOPPED: ' + str(c.error) + ')' if c.error or ok != 1 else ''}: "
              + ", ".join(f"{k} {statistics.mean(per[k]) * 1e3:.3f}" for k in names) + " ms mean")

    def p(xs, q):
        return sorted(xs)[int(len(xs) * q)] * 1e3

    for k in names:
        xs = times[k]
        if xs:
            print(f"mask all {k:8s} mean {statistics.mean(xs) * 1e3:.4f} ms  p50 {p(xs, .5):.4f}  p90 {p(xs, .9):.4f}  "
                  f"max {max(xs) * 1e3:.3f}  ({len(xs)} token positions, 3 passes, torch threads {args.threads})")


def summarize(rows):
    by = {}
    for r in rows:
        if "error" in r or not r.get("predicted_n"):
            continue
        key = (r["kind"], r["case"], r["tool_choice"])
        by.setdefault(key, []).append(r)
    print("\n# per case: decode tok/s = sum(predicted_n) / sum(predicted_ms) over all items, median of rounds")
    for (kind, case, choice), rs in by.items():
        rounds = sorted({r["round"] for r in rs})
        rates = []
        for rd in rounds:
            x = [r for r in rs if r["round"] == rd]
            rates.append(sum(r["predicted_n"] for r in x) / sum(r["predicted_ms"] for r in x) * 1e3)
        r0 = [r for r in rs if r["round"] == rounds[0]]
        n = sum(r["predicted_n"] for r in r0)
        dr = sum(r.get("draft_n") or 0 for r in r0)
        ac = sum(r.get("draft_n_accepted") or 0 for r in r0)
        gd = sum(r.get("grammar_drafted") or 0 for r in r0)
        ga = sum(r.get("grammar_accepted") or 0 for r in r0)
        ok = sum(r["check"] == "valid" for r in rs)
        print(f"{kind:5s} {case:28s} {choice or '':8s} tokens {n:5d}  {statistics.median(rates):6.2f} tok/s "
              f"({', '.join(f'{x:.2f}' for x in rates)})  drafted/accepted {dr}/{ac}  grammar {gd:.0f}/{ga:.0f} "
              f"({ga / n * 100 if n else 0:.0f}% of tokens)  valid {ok}/{len(rs)}")


def compare(rows):
    """Same text? Every case against its server's plain case of the same item (and tool_choice),
    and ours against llama's plain case: the text exactly, else the parsed value (JSON content,
    or the calls' names and parsed arguments)."""

    def value(r):
        if r.get("tool_calls"):
            return [(c["name"], json.loads(c["arguments"])) for c in r["tool_calls"]]
        try:
            return json.loads(r.get("content") or "")
        except ValueError:
            return None

    def text(r):
        return json.dumps(r.get("tool_calls")) if r.get("tool_calls") else r.get("content")

    ref = {}
    for r in rows:
        if "error" in r or r["round"] != min(x["round"] for x in rows):
            continue
        ref.setdefault((r["kind"], r["item"], r["tool_choice"], r["case"]), r)
    print("\n# same output? (round 0; '=' same text, '~' same parsed value, 'x' different)")
    for (kind, item, choice, case), r in sorted(ref.items()):
        server = "ours" if case.startswith("ours") else "llama"
        free = " free " in case
        base_case = {("json", "ours", True): "ours free plain", ("json", "ours", False): "ours schema plain",
                     ("json", "llama", True): "llama free plain", ("json", "llama", False): "llama schema plain"}.get(
            (kind, server, free), f"{server} plain")
        out = []
        for other in (base_case, "llama " + base_case.split(" ", 1)[1] if server == "ours" else None):
            o = ref.get((kind, item, choice, other))
            if other is None or o is None or o is r:
                continue
            mark = "=" if text(o) == text(r) else "~" if value(o) is not None and value(o) == value(r) else "x"
            out.append(f"{mark} {other}")
        print(f"{kind:5s} {item:15s} {choice or '':8s} {case:28s} " + "; ".join(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(MODELS, "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary (none: ours only)")
    ap.add_argument("--workloads", default=os.path.join(ROOT, "scripts/workloads/structured.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--tool-max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8090, help="ours; llama-servers on the next three")
    ap.add_argument("--only", default="", help="regex over 'kind item case tool_choice'")
    ap.add_argument("--n-vocab", type=int, default=151936, help="the model's vocabulary (logits) size, for the mask timing")
    ap.add_argument("--no-mask", action="store_true", help="skip the in-process mask timing")
    ap.add_argument("--summary", action="store_true", help="only summarize --out (and time the masks)")
    ap.add_argument("--out", required=True, help="JSON lines, one per request")
    args = ap.parse_args()
    workloads = json.load(open(args.workloads))
    if not args.summary:
        procs = start_servers(args)
        try:
            with open(args.out, "a") as out:
                run(args, procs, workloads, out)
        finally:
            for name, (_, proc, _) in procs.items():
                proc.terminate()
            for name, (_, proc, _) in procs.items():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rows = [json.loads(line) for line in open(args.out) if line.strip()]
    summarize(rows)
    compare(rows)
    if not args.no_mask:
        mask_cost(args, rows, workloads)


if __name__ == "__main__":
    main()
