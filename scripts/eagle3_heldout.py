"""Held-out top-1 accuracy of EAGLE3 heads at each unrolled draft step, per data directory.

    python scripts/eagle3_heldout.py -m TARGET.gguf --head A.gguf --head B.gguf \
        --data DIR1 --data DIR2 [--windows 128]

The documents held out are those `speculant train eagle3 --data DIR1 --mix DIR2 ...` holds out
(every 20th of the directories' documents taken together, ``speculant.training.split``), so a
head fine-tuned that way is compared on text it never saw, next to the head it started from.
Each directory's held-out documents are scored on their own (one recipe's text can be easier
than another's); the same windows for every head.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from speculant.gguf import open_gguf
from speculant.training import held_out_by_directory, target_to_draft
from speculant_eagle3.layout import default_target_layers
from speculant_eagle3.testing import head_config_for, target_embedding
from speculant_eagle3.train.loop import Batches, evaluate, init_from_head
from speculant_eagle3.train.net import Eagle3Net


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--head", action="append", required=True)
    p.add_argument("--data", action="append", required=True, help="data directories, in --data/--mix order")
    p.add_argument("--windows", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    shards, held = held_out_by_directory(args.data)
    embed = target_embedding(args.model)
    n_layers = int(open_gguf(args.model).arch_key("block_count"))
    for head in args.head:
        g = open_gguf(head)
        training = json.loads(g.metadata.get("speculant.training", "{}"))
        n_ff = int(training.get("ffn", 4096))
        cfg = head_config_for(args.model, n_draft_vocab=len(np.asarray(g.tensors["d2t"].data).reshape(-1)), n_ff=n_ff,
                              target_layers=default_target_layers(n_layers))  # as `speculant train eagle3` makes it
        net = Eagle3Net(cfg, embed)
        d2t = init_from_head(net, head)
        t2d = target_to_draft(d2t, cfg.n_target_vocab)
        for directory, docs in held.items():
            batches = Batches(shards, docs, t2d, args.window, args.steps, seed=0)
            acc = evaluate(net, batches, batches.docs, args.steps, n=args.windows, seed=0)
            print(f"{head}  {directory} ({len(docs)} held-out documents): "
                  f"top-1 per draft step {' / '.join(f'{a:.3f}' for a in acc)}", flush=True)


if __name__ == "__main__":
    main()
