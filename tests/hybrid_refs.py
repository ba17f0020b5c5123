"""Reading the llama.cpp references of the hybrid test models and checking a model against them
(tests/hybrid_cases.py lists the cases; scripts/hybrid_references.py writes the files)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model

REF_DIR = Path(__file__).parent / "data" / "llamacpp-outputs" / "hybrid"


def reference(name: str) -> dict | None:
    path = REF_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ours(ref: dict, tmp_dir: str | os.PathLike, speculators=(), **config) -> list[dict]:
    """Our greedy tokens and top log-probabilities for each of the reference's prompts, with the
    model the reference was made from (written again from its writer kwargs)."""
    path = write_tiny_model(os.path.join(tmp_dir, f"{ref['case']}.gguf"), ref["arch"], **ref["writer"])
    model = load_model(path, progress=False)
    engine = Engine(model, EngineConfig(n_ctx=1024, **config), list(speculators))
    out = []
    for r in ref["results"]:
        seq = engine.add(list(r["prompt"]), len(r["tokens"]), logprobs=ref["n_probs"])
        while seq.finish_reason is None:
            engine.step()
        engine.release(seq)
        out.append({"tokens": seq.tokens[seq.n_prompt:], "top_logprobs": [list(lp.top) for lp in seq.logprobs]})
    return out


def max_logprob_diff(ref_top: list, our_top: list) -> float:
    """The largest difference of log-probability over the tokens both top lists name."""
    worst = 0.0
    for theirs, mine in zip(ref_top, our_top):
        m = dict((int(t), lp) for t, lp in mine)
        for t, lp in theirs:
            if int(t) in m:
                worst = max(worst, abs(m[int(t)] - lp))
    return worst
