#!/usr/bin/env python3
"""llama.cpp's greedy outputs for the hybrid test models (tests/hybrid_cases.py).

For each case: write the GGUF the tests write (same writer, same seed), run llama-server on it
(2 threads, greedy), ask /completion for each prompt with n_probs, and store the tokens and the
top log-probabilities of every generated position in tests/data/llamacpp-outputs/hybrid/NAME.json.
Bench/test-data only: llama.cpp is never a runtime dependency. Build llama-server as in
docs/benchmarks.md ("later run"); the build id is recorded in each file.

    .venv/bin/python scripts/hybrid_references.py --llama-server PATH [--only ARCH|NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hybrid_cases import CASES  # noqa: E402

from speculant.testing.tiny_gguf import write_tiny_model  # noqa: E402

OUT_DIR = ROOT / "tests" / "data" / "llamacpp-outputs" / "hybrid"
N_PROBS = 5


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy")


def build_id(server: str) -> str:
    out = subprocess.run([server, "--version"], capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_case(case: dict, server: str, port: int, build: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, f"{case['name']}.gguf"), case["arch"], **case["writer"])
        log = Path(tmp) / "server.log"
        url = f"http://127.0.0.1:{port}"
        with open(log, "w") as lf:
            proc = subprocess.Popen([server, "-m", path, "--port", str(port), "-t", "2", "-c", "1024", "-np", "1",
                                     "--temp", "0", "--no-warmup"], stdout=lf, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, log)
            results = []
            for prompt in case["prompts"]:
                r = _post(url + "/completion", {"prompt": prompt, "n_predict": case["n_predict"], "temperature": 0,
                                                "top_k": 1, "n_probs": N_PROBS, "cache_prompt": False,
                                                "return_tokens": True})
                probs = r.get("completion_probabilities", [])
                results.append({
                    "prompt": prompt,
                    "tokens": r["tokens"],
                    "top_logprobs": [[[p["id"], p["logprob"]] for p in step["top_logprobs"]] for step in probs],
                })
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {"case": case["name"], "arch": case["arch"], "writer": case["writer"], "llama_cpp": build,
            "n_probs": N_PROBS, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--only", nargs="*", default=None, help="architectures or case names")
    ap.add_argument("--port", type=int, default=8097)
    a = ap.parse_args()
    build = build_id(a.llama_server)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if a.only and case["arch"] not in a.only and case["name"] not in a.only:
            continue
        ref = run_case(case, a.llama_server, a.port, build)
        (OUT_DIR / f"{case['name']}.json").write_text(json.dumps(ref, indent=1) + "\n")
        print(f"{case['name']}: {sum(len(r['tokens']) for r in ref['results'])} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
