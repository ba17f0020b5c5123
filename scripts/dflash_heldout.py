"""Held-out accuracy of DFlash drafters per block row, and their mean accepted length, per data directory.

    python scripts/dflash_heldout.py -m TARGET.gguf --head A.gguf --head B.gguf \
        --data DIR1 --data DIR2 [--windows 128]

The documents held out are those `speculant train dflash --data DIR1 --mix DIR2 ...` holds out
(every 20th of the directories' documents taken together, ``speculant.training.split``), so a
drafter fine-tuned that way (`--init`) is compared on text it never saw, next to the drafter it
started from. Each directory's held-out documents are scored on their own; the same windows and
blocks for every drafter. The accepted length is that of greedy drafts against the target's
top-1 (1 + the rows right in a row), the trainer's figure.
"""
from __future__ import annotations

import argparse

import torch

from speculant.gguf import open_gguf
from speculant.training import held_out_by_directory, init_from_head, target_to_draft
from speculant_dflash.layout import read_config
from speculant_dflash.testing import target_embedding
from speculant_dflash.train.loop import Batches, evaluate
from speculant_dflash.train.net import DFlashNet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--head", action="append", required=True)
    p.add_argument("--data", action="append", required=True, help="data directories, in --data/--mix order")
    p.add_argument("--windows", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--blocks", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    shards, held = held_out_by_directory(args.data)
    embed = target_embedding(args.model)
    for head in args.head:
        cfg = read_config(open_gguf(head))
        net = DFlashNet(cfg, embed)
        d2t = init_from_head(net.gguf_modules(), head)
        t2d = target_to_draft(d2t, cfg.n_target_vocab)
        for directory, docs in held.items():
            batches = Batches(shards, docs, t2d, args.window, cfg.block_size, args.blocks, cfg.mask_token_id, seed=0)
            acc, tau = evaluate(net, batches, batches.docs, n=args.windows, seed=0)
            print(f"{head}  {directory} ({len(docs)} held-out documents): top-1 per block row "
                  f"{' / '.join(f'{a:.3f}' for a in acc)}, accepted length {tau:.3f}", flush=True)


if __name__ == "__main__":
    main()
