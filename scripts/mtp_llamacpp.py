"""llama.cpp's draft-mtp next to speculant's mtp on the same small GGUF files: does llama-server load
the file (the target's own NextN block, or our sidecar with -md), does it draft, and are its
drafts ours.

For each case: write the files the tests write, run llama-server (`--spec-type draft-mtp
--spec-draft-n-max N -v`, greedy) on each prompt, read its greedy tokens and its drafts (the
`draft candidate 0` lines its verbose log prints per draft step), then run speculant's engine with
`mtp` on the same prompts, draft_n_max N, and compare: greedy tokens, and the draft of every
round where both histories agree. Bench/test-data only: llama.cpp is never a runtime dependency.

    .venv/bin/python scripts/mtp_llamacpp.py --llama-server PATH [--only NAME ...] [--json OUT]

Cases: a qwen35 file with its NextN block (llama.cpp uses it with no -md); the block split off into
a sidecar as `convert_hf_to_gguf.py --mtp` writes one (-md); a sidecar `speculant train mtp`
trains for the qwen35 trunk (drafts that get accepted); a sidecar for a qwen2 target (llama.cpp
has no MTP graph for qwen2: it is expected to refuse it, and the log says how).
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
    [5, 77, 300, 12, 9, 44, 123, 8],
    [42, 7, 7, 42, 7, 7, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 98, 97, 96, 95],
]
# qwen35-q8_0 is tests/hybrid_cases.py's case of that name (its trunk bit-exact with llama.cpp);
# the sidecar cases split its NextN block off as convert_hf_to_gguf.py --mtp does.
Q35 = {"qtype": "Q8_0", "seed": 22, "n_layers": 5, "recurrent_layers": [True, False, True, True, False], "head_dim": 32,
       "n_rot": 8, "rope_sections": [1, 1, 1, 1], "tie_embeddings": True}
CASES = [
    {"name": "qwen35-in-file", "arch": "qwen35", "writer": {**Q35, "nextn_layers": 1}, "sidecar": None},
    {"name": "qwen35-sidecar", "arch": "qwen35", "writer": {**Q35, "nextn_layers": 1}, "sidecar": "split"},
    {"name": "qwen35-trained-sidecar", "arch": "qwen35", "writer": Q35, "sidecar": "train"},
    {"name": "qwen2-sidecar", "arch": "qwen2", "writer": {"qtype": "F32", "seed": 3, "n_layers": 2}, "sidecar": "random"},
]
# `speculant train mtp` with tiny settings (seconds): the target's own chat turns over the core's sources
TRAIN = ["--source", str(ROOT / "core/speculant/*.py"), "--tokens", "2000", "--piece-tokens", "100", "--batch", "4",
         "--window", "64", "--lr", "3e-3", "--steps", "400", "--save-every", "1000", "--qtype", "F32", "--precision", "fp32",
         "--train-vocab", "0"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _serve(server: str, args: list[str], port: int, log: Path):
    with open(log, "w") as lf:
        proc = subprocess.Popen(["nice", "-n", "10", server, *args, "--port", str(port), "-t", "2", "-c", "1024", "-np", "1",
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


DRAFT_LINE = re.compile(rb"draft candidate +0, pos +(\d+): +(\d+)")


def llama_rounds(log: bytes) -> list[list[int]]:
    rounds: list[list[int]] = []
    for m in DRAFT_LINE.finditer(log):
        pos, tok = int(m.group(1)), int(m.group(2))
        if pos == 0 or not rounds:
            rounds.append([])
        rounds[-1].append(tok)
    return rounds


def agreement(mine: list[list[int]], theirs: list[list[int]]) -> dict:
    """Per draft step, how many rounds drafted the same token, with the rounds aligned (our engine
    may draft once more right after the prompt: the offset that agrees best is taken)."""
    best = None
    for offset in (0, 1):
        pairs = list(zip(mine[offset:], theirs))
        n = max((len(b) for _, b in pairs), default=0)
        same = [sum(1 for a, b in pairs if len(a) > j and len(b) > j and a[: j + 1] == b[: j + 1]) for j in range(n)]
        total = [sum(1 for _, b in pairs if len(b) > j) for j in range(n)]
        if best is None or sum(same) > sum(best["same_prefix_per_step"]):
            best = {"offset": offset, "same_prefix_per_step": same, "rounds_per_step": total}
    return best or {}


def ours(target, prompt: list[int], n_predict: int, n_max: int, draft_model: str | None):
    from speculant.engine import Engine, EngineConfig
    from speculant.sampling import SamplingParams
    from speculant.speculator import build_speculators

    spec = build_speculators(["mtp"], {"seed": 1}, target=target, draft_model=draft_model)[0]
    rounds = []
    original = spec.propose_batch

    def spy(requests):
        out = original(requests)
        rounds.extend(list(d.tokens) for d in out if d is not None)
        return out
    spy.speculant_impl = original.speculant_impl
    spec.propose_batch = spy
    engine = Engine(target, EngineConfig(n_ctx=1024, draft_n_max=n_max, adaptive=False), [spec])
    seq = engine.add(prompt, n_predict, SamplingParams())
    while engine.active():
        engine.step()
    st = engine.spec_stats["mtp"]
    return seq.tokens[seq.n_prompt:], rounds, st.drafted, st.accepted


def run_case(case: dict, server: str, port: int, n_predict: int, n_max: int) -> dict:
    import torch

    from speculant.loader import load_model
    from speculant.testing.tiny_gguf import write_tiny_model
    from speculant_mtp.layout import split_sidecar
    from speculant_mtp.testing import write_random_sidecar

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        full = write_tiny_model(os.path.join(tmp, "target.gguf"), case["arch"], **case["writer"])
        target_path, sidecar = full, None
        if case["sidecar"] == "split":
            sidecar = split_sidecar(full, os.path.join(tmp, "mtp-target.gguf"))
            target_path = write_tiny_model(os.path.join(tmp, "trunk.gguf"), case["arch"], **{**case["writer"], "nextn_layers": 0})
        elif case["sidecar"] == "random":
            sidecar = write_random_sidecar(os.path.join(tmp, "mtp-target.gguf"), full, seed=1)[0]
        elif case["sidecar"] == "train":
            from speculant.cli import main as cli

            sidecar = os.path.join(tmp, "mtp-trained.gguf")
            n_ff = str(case["writer"].get("n_ff", 128))  # the trunk's width: one feed_forward_length for all blocks
            if cli(["train", "mtp", "-m", full, "-o", sidecar, "--data", os.path.join(tmp, "data"), "--ffn", n_ff, *TRAIN]):
                raise RuntimeError("speculant train mtp failed")
        log = Path(tmp) / "server.log"
        args = ["-m", target_path, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
        if sidecar:
            args += ["-md", sidecar]
        proc, url = _serve(server, args, port, log)
        result = {"case": case["name"], "sidecar": case["sidecar"], "llama_loaded": url is not None, "prompts": []}
        try:
            target = load_model(target_path, progress=False)
            # and a turn like the trainer's data (a user asking for a source file)
            chat = target.tokenizer.encode_chat([{"role": "user", "content": "Show me the source of `speculant/engine.py`."}],
                                                add_generation_prompt=True)
            for prompt in PROMPTS + [chat]:
                mine, my_rounds, drafted, accepted = ours(target, prompt, n_predict, n_max, sidecar)
                row = {"prompt": prompt, "ours": {"tokens": mine, "drafted": drafted, "accepted": accepted}}
                if url is not None:
                    before = log.read_bytes()
                    r = _post(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                                                    "cache_prompt": False, "return_tokens": True})
                    time.sleep(0.2)
                    theirs = llama_rounds(log.read_bytes()[len(before):])
                    row["llama"] = {"tokens": r["tokens"], "drafted": r["timings"].get("draft_n"),
                                    "accepted": r["timings"].get("draft_n_accepted")}
                    row["same_tokens"] = r["tokens"] == mine
                    row["rounds"] = {"ours": len(my_rounds), "llama": len(theirs), **agreement(my_rounds, theirs)}
                result["prompts"].append(row)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        if url is None:
            text = log.read_text(errors="replace").splitlines()
            result["llama_error"] = [l for l in text if re.search(r"error|failed|missing|wrong", l, re.I)][-6:]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--port", type=int, default=8193)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    results = []
    for case in CASES:
        if args.only and case["name"] not in args.only:
            continue
        res = run_case(case, args.llama_server, args.port, args.n_predict, args.n_max)
        results.append(res)
        print(json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    raise SystemExit(main())
