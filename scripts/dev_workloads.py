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
are built otherwise). `--many` adds ten more edits of other modules to the default two.
`--records` gives answers that write records from the prompt again in another layout (a Markdown
table, a YAML list, a Python dict, CSV from local package and module metadata), where
copy-edits' records drafts apply.
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
# More of the same kind (`--many`): for statistics over many edits (how far a copy runs before the
# answer departs from it), where two workloads give a handful of events.
MORE_TASKS = [
    ("dev-edit-genericpath", "genericpath", "Add Python type hints to every function in this module. Output the complete modified file."),
    ("dev-edit-linecache", "linecache", "Rename the function `getline` to `get_line` everywhere in this module. Output the complete modified file."),
    ("dev-edit-sched", "sched", "Add a docstring to every method that lacks one. Output the complete modified file."),
    ("dev-edit-stat", "stat", "Add Python type hints to every function in this module. Output the complete modified file."),
    ("dev-edit-reprlib", "reprlib", "Rename the class `Repr` to `Representer` everywhere in this module. Output the complete modified file."),
    ("dev-edit-graphlib", "graphlib", "Add Python type hints to every method in this module. Output the complete modified file."),
    ("dev-edit-copyreg", "copyreg", "Add a short docstring to every function that lacks one. Output the complete modified file."),
    ("dev-edit-glob", "glob", "Rename the parameter `pathname` to `pattern_path` everywhere in this module. Output the complete modified file."),
    ("dev-edit-getopt", "getopt", "Replace every %-formatting with an f-string in this module. Output the complete modified file."),
    ("dev-edit-shelve", "shelve", "Add Python type hints to every method in this module. Output the complete modified file."),
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


def module_rows(names=("colorsys", "fnmatch", "glob", "shelve", "sched", "stat", "reprlib", "graphlib", "getopt",
                        "linecache", "copyreg", "genericpath", "bisect", "heapq", "textwrap", "difflib")) -> list[dict]:
    """Module name, its file's size in lines and its docstring's first line, for standard modules."""
    out = []
    for name in names:
        m = importlib.import_module(name)
        doc = ((m.__doc__ or "").strip().splitlines() or [""])[0]
        out.append({"module": name, "lines": len(Path(m.__file__).read_text().splitlines()), "doc": doc[:80]})
    return out


def records_workloads(max_tokens: int = 384) -> list[dict]:
    packages, modules = json.dumps(package_rows(16)), json.dumps(module_rows())
    asks = [
        ("dev-records-packages-table", "Write these packages as a Markdown table with columns package, version and what "
         "it does, one row per package, in this order:\n" + packages),
        ("dev-records-packages-yaml", "Write these packages as a YAML list, each item with the keys name, version and "
         "summary, in this order:\n" + packages),
        ("dev-records-modules-dict", "Write a Python dict literal MODULE_LINES mapping each module name to its number of "
         "lines, in this order:\n" + modules),
        ("dev-records-modules-csv", "Write these modules as CSV with the header module,lines,doc and one row per "
         "module, in this order:\n" + modules),
    ]
    return [{"name": name, "kind": "grounded", "max_tokens": max_tokens, "messages": [{"role": "user", "content": ask}]}
            for name, ask in asks]


def workloads(max_tokens: int = 384, many: bool = False) -> list[dict]:
    out = []
    for name, module, ask in TASKS + (MORE_TASKS if many else []):
        source = Path(importlib.import_module(module).__file__).read_text()
        out.append({"name": name, "kind": "grounded", "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{ask}\n```python\n{source}```"}]})
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--free", "--many", "--records")]
    if "--free" in sys.argv[1:]:
        made = free_workloads(*map(int, args))
    elif "--records" in sys.argv[1:]:
        made = records_workloads(*map(int, args))
    else:
        made = workloads(*map(int, args), many="--many" in sys.argv[1:])
    json.dump(made, sys.stdout, indent=1)
