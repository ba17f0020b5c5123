#!/usr/bin/env python3
"""Our layer outputs and logits against llama.cpp's (dump.cpp's files), step by step: the prompt
as one batch, then one token at a time, as dump.cpp fed them. Prints, per step, the largest
difference and the count of differing values of each layer's output (llama.cpp's `l_out-N`) and
of the logits; all zeros means bit-identical. Narrow a difference down by comparing the dump's
other tensors (attn_norm-N, conv_output_silu-N, attn_output-N, ...) with the architecture's own
intermediates.

    .venv/bin/python scripts/llamacpp_tensors/compare.py MODEL.gguf OUTDIR PROMPT_LEN tok tok ...
"""
from __future__ import annotations

import os
import sys

import numpy as np

from speculant import Batch
from speculant.loader import load_model


def load(outdir: str, step: int, name: str) -> np.ndarray | None:
    path = os.path.join(outdir, f"{step}_{name}.bin")
    if not os.path.exists(path):
        return None
    raw = open(path, "rb").read()
    ne = np.frombuffer(raw[:32], np.int64)
    return np.frombuffer(raw[32:], np.float32).reshape(ne[3], ne[2], ne[1], ne[0]).squeeze()


def main() -> int:
    path, outdir, n_prompt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tokens = [int(t) for t in sys.argv[4:]]
    model = load_model(path, progress=False)
    n_layers = model.info.n_layers
    ctx = model.new_context(len(tokens) + 1)
    batches = [Batch.for_sequence(0, 0, tokens[:n_prompt], prompt_len=n_prompt)]
    batches += [Batch.for_sequence(0, i, [tokens[i]], prompt_len=n_prompt) for i in range(n_prompt, len(tokens))]
    for step, batch in enumerate(batches):
        out = model.forward(batch, ctx, hidden_layers=tuple(range(n_layers)))
        cols = []
        for i in range(n_layers):
            ref = load(outdir, step, f"l_out-{i}")
            if ref is None:
                continue
            ours = out.hidden[i].numpy().reshape(ref.shape)
            cols.append(f"L{i}:{np.abs(ref - ours).max():.1e}/{int((ref != ours).sum())}")
        ref = load(outdir, step, "LOGITS")
        ours = out.logits[-1].numpy()
        cols.append(f"logits:{np.abs(ref - ours).max():.1e}/{int((ref != ours).sum())}")
        print(step, " ".join(cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
