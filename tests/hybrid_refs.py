"""Reading the llama.cpp references of the hybrid test models and checking a model against them
(tests/hybrid_cases.py lists the cases; scripts/hybrid_references.py writes the files)."""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import torch.nn.functional as F

from speculant import hookimpl

from speculant.engine import Engine, EngineConfig
from speculant.gguf import dequantize
from speculant.loader import load_model
from speculant.plugins import load_registry
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_cpu.backend import CpuBackend

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


class F32LinearBackend(CpuBackend):
    """The CPU backend (native attention, fp16 KV, llama.cpp's norms and rope) with float32
    linear layers, for F32 files (the CPU backend's own are bf16)."""

    name = "f32-linear"

    def linear(self, weight, bias=None):
        w = dequantize(weight.data, weight.qtype, weight.shape)
        b = None if bias is None else self.tensor(bias)
        return lambda x: F.linear(x, w, b)


def registry_with_f32():
    """The plugin registry with the f32-linear test backend added."""
    plugin = types.SimpleNamespace(speculant_register_backends=hookimpl(lambda register: register("f32-linear", F32LinearBackend)))
    return load_registry(extra_plugins=[("test-f32-linear-backend", plugin)])


def _incomplete_utf8(text: bytes) -> bool:
    """llama-server's validate_utf8(text) < len(text): a UTF-8 lead byte among the last four
    bytes whose character needs more bytes than follow it."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if ((c & 0xE0) == 0xC0 and i < 2) or ((c & 0xF0) == 0xE0 and i < 3) or ((c & 0xF8) == 0xF0 and i < 4):
            return True
    return False


def llama_server_steps(tokenizer, tokens: list[int]) -> list[int]:
    """The generated positions llama-server reports probabilities for: those after which the
    text so far (control tokens render as nothing) does not end inside a UTF-8 character."""
    text, steps = b"", []
    for j, t in enumerate(tokens):
        text += tokenizer.token_bytes(t, special=False)
        if not _incomplete_utf8(text):
            steps.append(j)
    return steps
