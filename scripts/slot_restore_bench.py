#!/usr/bin/env python3
"""A conversation's second turn three ways, served: continued in the server that answered the first
turn (kept), in a fresh server after `/slots/0?action=restore` of the file the first saved
(restored), and in a fresh server from nothing (cold). Prints each one's prompt time, cached
tokens, decode speed and drafts, and whether the three texts are the same.

With a drafter on hidden states (eagle3, mtp, dflash) the file carries the drafter's own states
(`export_state`), so the restored turn should draft as the kept one does.

    .venv/bin/python scripts/slot_restore_bench.py -m MODEL -- --spec-type eagle3 -md HEAD.gguf

The first turn asks about a source file of this repository (not a benchmark workload).
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
MODELS = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, args, extra: list[str], slots: str):
        self.port = args.port
        cmd = [str(Path(sys.executable).with_name("speculant")), "serve", "-m", args.model, "--port", str(self.port), "-np", "1",
               "-c", str(args.ctx), "--slot-save-path", slots, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}): {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise SystemExit("the server did not become healthy in 300 s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def row(label: str, answer: dict, extra: str = "") -> str:
    t = answer["timings"]
    return (f"{label:<9} prompt {t['prompt_n']:>5} tokens, {t['cache_n']:>5} cached, {t['prompt_ms'] / 1e3:7.2f} s | "
            f"decode {t['predicted_per_second']:6.2f} tok/s | drafted {t.get('draft_n', 0):>4}, accepted "
            f"{t.get('draft_n_accepted', 0):>4}{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--source", default=str(ROOT / "core" / "speculant" / "chain.py"), help="the file the first turn asks about")
    ap.add_argument("--chars", type=int, default=5000, help="how much of it")
    ap.add_argument("-n", type=int, default=128, help="tokens of each turn's answer")
    ap.add_argument("extra", nargs="*", help="after --: flags for `speculant serve` (the spec type)")
    args = ap.parse_args()
    code = Path(args.source).read_text()[: args.chars]
    first = f"<|im_start|>user\nExplain what this code does:\n```python\n{code}\n```<|im_end|>\n<|im_start|>assistant\n"
    with tempfile.TemporaryDirectory() as slots:
        with Server(args, args.extra, slots) as s:
            a1 = post(s.url, "/completion", {"prompt": first, "n_predict": args.n, "temperature": 0})
            second = first + a1["content"] + "<|im_end|>\n<|im_start|>user\nNow write a test for it.<|im_end|>\n<|im_start|>assistant\n"
            t0 = time.perf_counter()
            saved = post(s.url, "/slots/0?action=save", {"filename": "turn1.bin"})
            save_s = time.perf_counter() - t0
            kept = post(s.url, "/completion", {"prompt": second, "n_predict": args.n, "temperature": 0})
        size = os.path.getsize(os.path.join(slots, "turn1.bin"))
        with Server(args, args.extra, slots) as s:
            t0 = time.perf_counter()
            restored_info = post(s.url, "/slots/0?action=restore", {"filename": "turn1.bin"})
            restore_s = time.perf_counter() - t0
            restored = post(s.url, "/completion", {"prompt": second, "n_predict": args.n, "temperature": 0})
        with Server(args, args.extra, slots) as s:
            cold = post(s.url, "/completion", {"prompt": second, "n_predict": args.n, "temperature": 0})
    print(f"serve flags: {' '.join(args.extra) or '(plain)'}; first turn {a1['timings']['prompt_n']} prompt tokens")
    print(f"slot file: {saved['n_saved']} tokens, {size / 2**20:.1f} MiB, saved in {save_s:.2f} s, "
          f"restored ({restored_info['n_restored']} tokens) in {restore_s:.2f} s")
    print(row("kept", kept))
    print(row("restored", restored))
    print(row("cold", cold))
    same = kept["content"] == restored["content"] == cold["content"]
    print("same text in all three:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
