"""Structured output against a running `speculant serve`: a JSON-extraction request, with and
without the schema and with and without speculation, runs alternated; decode tok/s per case and
the tokens the grammar drafter supplied (from /metrics, spec_type="grammar").

    speculant serve -m qwen2.5-coder-1.5b-instruct.gguf --spec-type ngram-simple -np 1 &
    python scripts/structured_bench.py --url http://127.0.0.1:8080 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import urllib.request

TEXT = """From: Dana Whitfield <dana.whitfield@northwind.example>
Subject: Order 48213 delayed

Hi team, the order 48213 placed on 2026-10-02 for 3 units of the ThinkPad X1 Carbon (Gen 12) and
2 units of the Dell UltraSharp U2724D monitor has not arrived. Our office is at 14 Harbour Street,
Leith, Edinburgh EH6 6LX. Please call me at +44 131 496 0755. We need it before 2026-11-30,
otherwise cancel the monitors and refund them to the company card ending in 4417.
Thanks, Dana Whitfield, IT manager, Northwind Traders Ltd."""

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}, "phone": {"type": "string"},
            "company": {"type": "string"}, "role": {"type": "string"}},
            "required": ["name", "email", "phone", "company", "role"], "additionalProperties": False},
        "order_id": {"type": "string"},
        "order_date": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "product": {"type": "string"}, "quantity": {"type": "integer"}},
            "required": ["product", "quantity"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "postcode": {"type": "string"}},
            "required": ["street", "city", "postcode"], "additionalProperties": False},
        "deadline": {"type": "string"},
        "requested_action": {"type": "string"},
        "card_last4": {"type": "string"},
    },
    "required": ["customer", "order_id", "order_date", "items", "address", "deadline", "requested_action", "card_last4"],
    "additionalProperties": False,
}
PROMPT = ("Extract the order information from this email as JSON with the fields customer (name, email, phone, "
          "company, role), order_id, order_date, items (product, quantity), address (street, city, postcode), "
          "deadline, requested_action and card_last4. Answer with the JSON only.\n\n" + TEXT)


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def grammar_tokens(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for name in ("draft_tokens", "accepted_tokens"):
        m = re.search(rf'speculant:spec_decode_num_{name}_total\{{spec_type="grammar"\}} (\S+)', text)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--spec", default="ngram-simple", help="the speculative.type of the speculative cases, ';' between cases")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}}
    cases = {"free, plain": {"speculative.n_max": 0}}
    cases.update({f"free, {t}": {"speculative.type": t} for t in args.spec.split(";")})
    cases["schema, plain"] = {"speculative.n_max": 0, **schema}
    cases["schema, grammar drafter only"] = {"speculative.type": "none", **schema}
    cases.update({f"schema, grammar + {t}": {"speculative.type": t, **schema} for t in args.spec.split(";")})
    cases = {k: v for k, v in cases.items() if args.only in k}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, extra in cases.items():
            before = grammar_tokens(args.url)
            body = post(args.url, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
                                   "temperature": 0, "cache_prompt": False, **extra})
            after = grammar_tokens(args.url)
            t = body["timings"]
            text = body["choices"][0]["message"]["content"]
            try:
                json.loads(text)
                parses = "parses"
            except ValueError:
                parses = "does not parse"
            rates[name].append(t["predicted_per_second"])
            g = after["draft_tokens"] - before["draft_tokens"]
            ga = after["accepted_tokens"] - before["accepted_tokens"]
            print(f"round {r} {name:32s} {t['predicted_n']:4d} tokens {t['predicted_per_second']:6.2f} tok/s "
                  f"drafted {t['draft_n']:4d} accepted {t['draft_n_accepted']:4d} (grammar {g:.0f}/{ga:.0f}) {parses}",
                  flush=True)
            if r == 0:
                print("   ", text[:400].replace("\n", "\\n"))
    print()
    for name, xs in rates.items():
        print(f"{name:32s} median {statistics.median(xs):6.2f} tok/s  ({', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
