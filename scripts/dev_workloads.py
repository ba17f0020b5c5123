#!/usr/bin/env python3
"""Development workloads for tuning speculation settings, built from this machine's Python
standard library, so that nothing is tuned on the public benchmark workloads
(tests/data/workloads-public.json). Same shape as those (a system prompt, one user turn asking
for a whole-file edit), other modules:

    python scripts/dev_workloads.py > /tmp/dev.json
    speculant bench -m MODEL --workloads /tmp/dev.json --spec-type ...
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


def workloads(max_tokens: int = 384) -> list[dict]:
    out = []
    for name, module, ask in TASKS:
        source = Path(importlib.import_module(module).__file__).read_text()
        out.append({"name": name, "kind": "grounded", "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{ask}\n```python\n{source}```"}]})
    return out


if __name__ == "__main__":
    json.dump(workloads(int(sys.argv[1]) if len(sys.argv) > 1 else 384), sys.stdout, indent=1)
