#!/usr/bin/env python3
"""Speculation on a hybrid target of realistic width: per-row rollback against checkpoint/replay.

Random weights are fine for speed but write nonsense, so the target is made to write the public
workloads' real answers: each row's logits are computed in full (every kernel, every layer, the
output head: the real cost), then replaced by a one-hot on the token the Qwen2.5-Coder-1.5B
answer has there (its greedy output, which equals llama.cpp's). The speculators then draft on
real text and the verification rows cost what they cost on this model.

Reports, per configuration, alternated `--repeats` times in one sitting (medians):
  1. the cost of one verification step of 1+k rows at a ~1000-token context: per-row states
     kept (and the cut back to the middle row), versus a plain forward plus the checkpoint's
     save and restore (whose kept tokens the next step computes again);
  2. the memory of one checkpoint (the recurrent state);
  3. decode tok/s on each workload's answer: plain, spec per-row, spec with checkpoint/replay.

    .venv/bin/python scripts/bench_hybrid.py --arch qwen35 [--preset 0.8b] [--spec suffix,ngram-simple]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from speculant import Batch, ForwardOutput  # noqa: E402
from speculant.engine import Engine, EngineConfig  # noqa: E402
from speculant.loader import load_model  # noqa: E402
from speculant.speculator import build_speculators, parse_spec_types  # noqa: E402
from speculant.testing.tiny_gguf import write_tiny_model  # noqa: E402

MODELS = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))
TARGET_1P5B = MODELS / "qwen2.5-coder-1.5b-instruct.gguf"
N_VOCAB = 151936  # the 1.5B's ids, so its answers can be forced

# Realistic widths (random weights): dimensions of the released small models of each family.
PRESETS = {
    # Qwen3.5-0.8B-like: 24 layers, every 4th full attention, DeltaNet 16 heads x 128.
    ("qwen35", "0.8b"): dict(n_embd=1024, n_layers=24, n_head=8, n_kv_head=2, head_dim=256, n_ff=3584,
                             full_attention_interval=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16, ssm_d_conv=4),
    # LFM2-350M-like: 16 layers, 6 of them attention.
    ("lfm2", "350m"): dict(n_embd=1024, n_layers=16, n_head=16, n_kv_head=8, n_ff=4608,
                           attn_layers=(2, 5, 8, 10, 12, 14)),
}


class ForcedStream:
    """The model, with each row's logits replaced by a one-hot on the stream's next token."""

    def __init__(self, model, streams: dict[int, list[int]]):
        self.model, self.streams = model, streams
        self.info, self.tokenizer = model.info, model.tokenizer

    def new_context(self, max_tokens):
        return self.model.new_context(max_tokens)

    def forward(self, batch: Batch, context, hidden_layers=()):
        out = self.model.forward(batch, context, hidden_layers)
        logits = torch.full_like(out.logits, -30.0)
        rows = [i for i, w in enumerate(batch.want_logits) if w]
        for r, i in enumerate(rows):
            stream = self.streams[batch.seq_ids[i]]
            nxt = batch.positions[i] + 1
            logits[r, stream[nxt] if nxt < len(stream) else 0] = 30.0
        return ForwardOutput(logits, out.hidden)


def make_streams(path: Path) -> dict:
    """The 1.5B's greedy answers to the public workloads (prompt and answer token ids), cached."""
    if path.exists():
        return json.loads(path.read_text())
    workloads = json.loads((ROOT / "tests" / "data" / "workloads-public.json").read_text())
    model = load_model(str(TARGET_1P5B), progress=False)
    engine = Engine(model, EngineConfig(n_ctx=4096), build_speculators(["suffix", "ngram-simple"], {}, target=model))
    out = {}
    for w in workloads:
        tok = model.tokenizer
        prompt = tok.encode(tok.apply_chat_template(w["messages"], add_generation_prompt=True))
        answer = list(engine.generate(prompt, w["max_tokens"]))
        out[w["name"]] = {"prompt": prompt, "answer": answer}
        print(f"stream {w['name']}: {len(prompt)} prompt, {len(answer)} answer tokens", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def step_costs(model, ks: list[int], repeats: int) -> list[dict]:
    """One sequence at ~1000 tokens: a verification forward of 1+k rows keeping per-row states,
    against one keeping none plus a checkpoint save and restore."""
    rows = []
    ctx = model.new_context(4096)
    prompt = [(i * 7919) % 50000 for i in range(1000)]
    for a in range(0, len(prompt), 500):
        model.forward(Batch.for_sequence(0, a, prompt[a:a + 500], logits="none"), ctx)
    base = ctx.save(0)
    for k in ks:
        per_row, rollback, plain, save, restore = [], [], [], [], []
        toks = prompt[:1 + k]
        for rep in range(repeats + 1):  # the first round warms up and is not counted
            for keep in (True, False):
                ctx.keep_rows, ctx.rows_for = keep, None
                t0 = time.perf_counter()
                handle = None if keep else ctx.save(0)
                t1 = time.perf_counter()
                model.forward(Batch.for_sequence(0, 1000, toks, logits="all"), ctx)
                t2 = time.perf_counter()
                if keep:  # cut back to the middle row (a partial acceptance), then to the start
                    ctx.truncate(0, 1000 + (1 + k) // 2)
                    t3 = time.perf_counter()
                    ctx.restore(0, base)
                    if rep:
                        per_row.append(t2 - t1)
                        rollback.append(t3 - t2)
                else:
                    ctx.restore(0, handle)
                    t3 = time.perf_counter()
                    if rep:
                        plain.append(t2 - t1)
                        save.append(t1 - t0)
                        restore.append(t3 - t2)
        rows.append({"k": k, "per_row_ms": 1e3 * statistics.median(per_row), "rollback_ms": 1e3 * statistics.median(rollback),
                     "plain_ms": 1e3 * statistics.median(plain),
                     "save_ms": 1e3 * statistics.median(save), "restore_ms": 1e3 * statistics.median(restore),
                     "kept_mb": ctx.nbytes(0) / 2**20})
    return rows


def decode(model, stream: dict, spec: list[str] | None, use_checkpoints: bool, n_max: int) -> dict:
    prompt, answer = stream["prompt"], stream["answer"]
    forced = ForcedStream(model, {0: prompt + answer})
    specs = build_speculators(spec, {}, target=model) if spec else []
    engine = Engine(forced, EngineConfig(n_ctx=4096, draft_n_max=n_max, spec_use_checkpoints=use_checkpoints), specs)
    seq = engine.add(prompt, len(answer))
    while seq.n_cached < len(prompt) - 1:  # the prompt is not timed
        engine.step()
    t0 = time.perf_counter()
    n0 = len(seq.tokens)
    while seq.finish_reason is None:
        engine.step()
    seconds = time.perf_counter() - t0
    got = seq.tokens[len(prompt):]
    assert got == answer[: len(got)], "the forced stream was not followed"
    drafts = sum(s.drafts for s in engine.spec_stats.values())
    accepted = sum(s.accepted for s in engine.spec_stats.values())
    r = engine.recurrent_stats
    return {"tok_s": (len(seq.tokens) - n0) / seconds, "mean_accept": 1 + accepted / drafts if drafts else 1.0,
            "rollbacks": r.rollbacks, "replays": r.replays, "replayed_rows": r.replayed_rows,
            "checkpoint_ms": 1e3 * r.checkpoint_seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen35", choices=sorted({a for a, _ in PRESETS}))
    ap.add_argument("--preset", default=None)
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--spec", default="suffix,ngram-simple")
    ap.add_argument("--n-max", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--streams", default=str(Path.home() / ".cache" / "speculant" / "public-streams.json"))
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    preset = a.preset or next(p for arch, p in PRESETS if arch == a.arch)
    dims = PRESETS[(a.arch, preset)]
    streams = make_streams(Path(a.streams))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, "hybrid.gguf"), a.arch, qtype=a.qtype, embd_qtype="Q8_0",
                                n_vocab=N_VOCAB, n_ctx=8192, **dims)
        model = load_model(path, progress=False)
    spec = parse_spec_types(a.spec)
    result = {"arch": a.arch, "preset": preset, "dims": dims, "qtype": a.qtype, "spec": a.spec, "n_max": a.n_max,
              "threads": torch.get_num_threads()}
    ctx = model.new_context(16)
    result["checkpoint_mb"] = ctx.state_nbytes() / 2**20
    print(f"{a.arch} {preset} {a.qtype}: one checkpoint (the recurrent state) = {result['checkpoint_mb']:.2f} MiB", flush=True)
    result["steps"] = step_costs(model, [int(k) for k in a.ks.split(",")], a.repeats)
    print("k  per-row ms  rollback ms  plain ms  save ms  restore ms")
    for r in result["steps"]:
        print(f"{r['k']:<3}{r['per_row_ms']:>10.1f}{r['rollback_ms']:>13.2f}{r['plain_ms']:>10.1f}{r['save_ms']:>9.2f}"
              f"{r['restore_ms']:>12.2f}", flush=True)
    configs = [("plain", None, False), ("per-row", spec, False), ("replay", spec, True)]
    result["workloads"] = {}
    for name, stream in streams.items():
        if a.only and name not in a.only:
            continue
        runs = {c: [] for c, _, _ in configs}
        for _ in range(a.repeats):  # alternated: the box's drift hits every configuration alike
            for c, s, ckpt in configs:
                runs[c].append(decode(model, stream, s, ckpt, a.n_max))
        summary = {}
        for c, rs in runs.items():
            summary[c] = {**rs[len(rs) // 2], "tok_s": statistics.median(r["tok_s"] for r in rs),
                          "tok_s_all": [round(r["tok_s"], 2) for r in rs]}
        base = summary["plain"]["tok_s"]
        for c in summary:
            summary[c]["speedup"] = summary[c]["tok_s"] / base
        result["workloads"][name] = summary
        print(f"{name}: " + "  ".join(f"{c} {v['tok_s']:.2f} tok/s ({v['speedup']:.2f}x, accept {v['mean_accept']:.2f}, "
                                       f"replayed rows {v['replayed_rows']})" for c, v in summary.items()), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
