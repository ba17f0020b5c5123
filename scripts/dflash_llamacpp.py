"""llama.cpp's draft-dflash next to speculant's dflash on the same small GGUF files: does llama-server
load our drafter, does it draft, are its drafts ours, and how much of them each engine accepts.

For each case: write the target and the drafter the tests write (tests/test_dflash.py reads the
`random` cases back from tests/data/dflash-llamacpp.json), run llama-server (`--spec-type
draft-dflash --spec-draft-n-max B-1 -v`, greedy) on each prompt, read its greedy tokens, its
acceptance (timings) and its drafts (the `draft candidate 0` lines of its verbose log, one per
block row), then run speculant's engine with `dflash` on the same prompts, draft_n_max B-1, and
compare: greedy tokens, the draft of every round, the acceptance. A `trained` case first trains a
drafter with `speculant train dflash` (tiny settings, ~15 s on 2 cores). Bench/test-data only:
llama.cpp is never a runtime dependency.

    .venv/bin/python scripts/dflash_llamacpp.py --llama-server PATH [--only NAME ...] [--json OUT]

The --json file holds one JSON object a line: the cases, each case's outcome, each prompt's result.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    [2, 265, 310, 494, 277, 286, 369, 427, 262, 344, 498, 302],
    [5, 77, 300, 12, 9, 44, 123, 8, 42, 7, 7, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 98, 97, 96, 95],
]
LLAMA = {"n_layers": 4, "n_embd": 64, "n_ctx": 2048, "n_vocab": 512, "tokenizer": "llama"}
CASES = [
    {"name": "llama-random", "arch": "llama", "writer": LLAMA, "head": {"block_size": 4}},
    {"name": "llama-random-d2t-q8", "arch": "llama", "writer": {**LLAMA, "qtype": "Q8_0"},
     "head": {"block_size": 6, "n_draft_vocab": 300, "qtype": "Q8_0", "seed": 1}},
    {"name": "qwen3-random", "arch": "qwen3", "writer": {"n_layers": 4, "n_embd": 64, "n_ctx": 2048}, "head": {"block_size": 4}},
    {"name": "lfm2-random", "arch": "lfm2", "writer": {"n_layers": 4, "n_ctx": 2048, "seed": 1}, "head": {"block_size": 4}},
    {"name": "llama-trained", "arch": "llama", "writer": LLAMA, "head": {"block_size": 4}, "train": True},
]
TRAIN = ["--tokens", "8000", "--piece-tokens", "200", "--batch", "4", "--window", "64", "--blocks", "8", "--block-size", "4",
         "--draft-vocab", "300", "--ffn", "128", "--layers", "2", "--save-every", "500", "--qtype", "F16",
         "--precision", "fp32", "--steps", "1500", "--lr", "2e-3", "--source", str(ROOT / "core/speculant/*.py")]
DRAFT_LINE = re.compile(rb"draft candidate +0, pos +(\d+): +(\d+)")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _serve(server: str, args: list[str], port: int, log: Path):
    with open(log, "w") as lf:
        proc = subprocess.Popen(["nice", "-n", "10", server, *args, "--port", str(port), "-t", "2", "-c", "2048", "-np", "1",
                                 "--temp", "0", "--no-warmup", "-v"], stdout=lf, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            return proc, None
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except Exception:
            pass
        time.sleep(0.2)
    return proc, None


def llama_rounds(log: bytes) -> list[list[int]]:
    rounds: list[list[int]] = []
    for m in DRAFT_LINE.finditer(log):
        pos, tok = int(m.group(1)), int(m.group(2))
        if pos == 0 or not rounds:
            rounds.append([])
        rounds[-1].append(tok)
    return rounds


def aligned(mine: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, list]:
    """The rounds paired up (on a hybrid target llama-server does not draft right after the
    prompt, where speculant does: the offset, 0 or 1, that agrees best), and how many agree (a
    draft cut by the token budget agrees where it is a prefix)."""
    best = None
    for offset in (0, 1):
        pairs = list(zip(mine[offset:], theirs))
        same = sum(a == b[: len(a)] for a, b in pairs)
        if best is None or same > best[1]:
            best = (offset, same, pairs)
    return best


def ours(target, prompt: list[int], n_predict: int, n_max: int, draft_model: str):
    from speculant.engine import Engine, EngineConfig
    from speculant.sampling import SamplingParams
    from speculant.speculator import build_speculators

    spec = build_speculators(["dflash"], {"seed": 1}, target=target, draft_model=draft_model)[0]
    rounds = []
    original = spec.propose_batch

    def spy(requests):
        out = original(requests)
        rounds.extend(list(d.tokens) for d in out if d is not None)
        return out
    spy.speculant_impl = original.speculant_impl
    spec.propose_batch = spy
    engine = Engine(target, EngineConfig(n_ctx=2048, draft_n_max=n_max, adaptive=False), [spec])
    seq = engine.add(prompt, n_predict, SamplingParams())
    while engine.active():
        engine.step()
    st = engine.spec_stats["dflash"]
    return seq.tokens[seq.n_prompt:], rounds, st.drafted, st.accepted


def write_case(case: dict, tmp: str) -> tuple[str, str]:
    from speculant.testing.tiny_gguf import write_tiny_model
    from speculant_dflash.testing import write_random_head

    target = write_tiny_model(os.path.join(tmp, "target.gguf"), case["arch"], **case["writer"])
    head = os.path.join(tmp, "dflash.gguf")
    if case.get("train"):
        from speculant.cli import main

        if main(["train", "dflash", "-m", target, "-o", head, "--data", os.path.join(tmp, "data"), *TRAIN]) != 0:
            raise SystemExit("training failed")
    else:
        write_random_head(head, target, **case["head"])
    return target, head


def run_case(case: dict, server: str, port: int, n_predict: int) -> dict:
    import torch

    from speculant.loader import load_model

    torch.set_num_threads(1)
    n_max = case["head"]["block_size"] - 1
    with tempfile.TemporaryDirectory() as tmp:
        target_path, head = write_case(case, tmp)
        log = Path(tmp) / "server.log"
        proc, url = _serve(server, ["-m", target_path, "-md", head, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max)],
                           port, log)
        result = {"case": case["name"], "n_max": n_max, "llama_loaded": url is not None, "prompts": []}
        try:
            if url is None:
                result["error"] = log.read_bytes()[-3000:].decode(errors="replace")
                return result
            target = load_model(target_path, progress=False)
            for prompt in PROMPTS:
                start = log.stat().st_size
                r = _post(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                "cache_prompt": False, "return_tokens": True})
                time.sleep(0.2)
                theirs = llama_rounds(log.read_bytes()[start:])
                mine, my_rounds, drafted, accepted = ours(target, prompt, n_predict, n_max, head)
                offset, same, pairs = aligned(my_rounds, theirs)
                result["prompts"].append({
                    "prompt": prompt, "llama_tokens": r["tokens"], "same_tokens": r["tokens"] == mine,
                    "llama_drafts": theirs, "our_drafts": my_rounds, "offset": offset,
                    "same_drafts": same, "same_first": sum(a[:1] == b[:1] for a, b in pairs), "rounds": len(pairs),
                    "llama_accepted": r["timings"].get("draft_n_accepted"), "llama_drafted": r["timings"].get("draft_n"),
                    "our_accepted": accepted, "our_drafted": drafted,
                })
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--only", action="append", default=None)
    ap.add_argument("--json", default=None, help="write the results here (tests/data/dflash-llamacpp.json for the tests)")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--port", type=int, default=18461)
    args = ap.parse_args()
    results = []
    for case in CASES:
        if args.only and case["name"] not in args.only:
            continue
        res = run_case(case, args.llama_server, args.port, args.n)
        results.append(res)
        if not res["llama_loaded"]:
            print(f"{case['name']}: llama-server did not start:\n{res['error']}", file=sys.stderr)
            continue
        for p in res["prompts"]:
            print(f"{case['name']}: same tokens {p['same_tokens']}, same drafts {p['same_drafts']}/{p['rounds']} "
                  f"(first token {p['same_first']}, offset {p['offset']}), "
                  f"accepted llama.cpp {p['llama_accepted']}/{p['llama_drafted']}, speculant {p['our_accepted']}/{p['our_drafted']}",
                  flush=True)
    if args.json:
        # one line per case and per prompt's result: small, and a rerun's diff reads line by line
        lines = [json.dumps({"case": c}) for c in CASES if not args.only or c["name"] in args.only]
        lines += [json.dumps({k: v for k, v in res.items() if k != "prompts"}) for res in results]
        lines += [json.dumps({"result": res["case"], **p}) for res in results for p in res.get("prompts", [])]
        Path(args.json).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
