#!/usr/bin/env python3
"""Development workloads for tuning speculation settings, built from this machine's Python
standard library, so that nothing is tuned on the public benchmark workloads
(tests/data/workloads-public.json). Same shape as those (a system prompt, one user turn asking
for a whole-file edit), other modules:

    python scripts/dev_workloads.py > /tmp/dev.json
    speculant bench -m MODEL --workloads /tmp/dev.json --spec-type ...

`--free` gives the other kind instead: answers written from scratch (a program from a one-line
ask, a table from local package metadata), where drafters on hidden states, not copying, are
what speeds decoding up; for checking a head, never trained on (speculant.distill's requests
are built otherwise).
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

SYSTEM = "You are an expert programmer. Respond only with code. Do not add any other comments."
TASKS = [
    ("dev-edit-colorsys", "colorsys", "Add Python type hints to every function in this module. Output the complete modified file."),
    ("dev-edit-fnmatch", "fnmatch", "Rename the parameter `pat` to `pattern` everywhere in this module. Output the complete modified file."),
]


FREE_TASKS = [
    ("dev-free-lru-go", None, "Write an LRU cache in Go with a small main that exercises it. Only code, please."),
    ("dev-free-stack-rust", "You are a helpful assistant.", "Implement a generic stack in Rust with push, pop and peek, and show it in use."),
]


def package_rows(n: int = 8) -> list[dict]:
    """Name, version and summary of the first n installed distributions (by name)."""
    from importlib import metadata

    rows = {d.metadata["Name"]: d for d in metadata.distributions() if d.metadata["Name"]}
    return [{"name": k, "version": rows[k].version, "summary": (rows[k].metadata["Summary"] or "")[:80]}
            for k in sorted(rows, key=str.lower)[:n]]


def free_workloads(max_tokens: int = 256) -> list[dict]:
    out = []
    for name, system, ask in FREE_TASKS:
        out.append({"name": name, "kind": "free", "max_tokens": max_tokens,
                    "messages": ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ask}]})
    out.append({"name": "dev-free-packages-table", "kind": "grounded", "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "Write these packages as a Markdown table with columns package, version "
                              "and what it does:\n" + json.dumps(package_rows())}]})
    return out


def workloads(max_tokens: int = 384) -> list[dict]:
    out = []
    for name, module, ask in TASKS:
        source = Path(importlib.import_module(module).__file__).read_text()
        out.append({"name": name, "kind": "grounded", "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{ask}\n```python\n{source}```"}]})
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--free"]
    make = free_workloads if "--free" in sys.argv[1:] else workloads
    json.dump(make(int(args[0])) if args else make(), sys.stdout, indent=1)
