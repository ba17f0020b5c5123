"""`speculant train eagle3 -m TARGET.gguf -o HEAD.gguf --data DIR`: collect, train, export.

Each phase resumes: the data directory keeps the collected shards (manifest.json) and the
training checkpoint (ckpt.pt), so rerunning the same command after an interruption continues
where it stopped, and a finished run only exports again.
"""
from __future__ import annotations

import json
import sys
import time

from speculant.options import int_in
from speculant.training import add_recipe_arguments, add_top1_weight_argument, recipe_options, training_threads


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eagle3", help="train an EAGLE3 head for a target (llama.cpp's eagle3 GGUF layout)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the target .gguf")
    p.add_argument("-o", "--output", required=True, help="the head .gguf to write")
    p.add_argument("--data", required=True, help="directory for the collected data and the checkpoint (resumable)")
    p.add_argument("--source", action="append", default=None,
                   help="glob of source files to read (repeatable; default: Python's standard library and the "
                        "installed packages' .py and .h files)")
    add_recipe_arguments(p)
    p.add_argument("--tokens", type=int_in(64), default=200_000, help="rows of target states to collect (default 200000)")
    p.add_argument("--piece-tokens", type=int_in(32, 4000), default=480, help="tokens per training document (default 480)")
    p.add_argument("--steps", type=int_in(1), default=2000, help="optimizer steps in all (default 2000)")
    p.add_argument("--batch", type=int_in(1), default=4, help="windows per step (default 4)")
    p.add_argument("--window", type=int_in(8), default=256, help="rows per window (default 256)")
    p.add_argument("--sample-by-rows", action="store_true",
                   help="draw each training window's document in proportion to its rows (default: every document "
                        "alike), so that long documents give their share of long windows")
    p.add_argument("--ttt", type=int_in(1, 8), default=3, help="unrolled training-time-test steps (default 3)")
    add_top1_weight_argument(p)
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--draft-vocab", type=int_in(16), default=16384, help="draft vocabulary size (default 16384)")
    p.add_argument("--ffn", type=int_in(16), default=4096, help="the head's FFN width (default 4096)")
    p.add_argument("--qtype", default="Q8_0", choices=("F32", "F16", "Q8_0", "Q5_0", "Q4_0"), help="matrix type in the GGUF (default Q8_0)")
    p.add_argument("--save-every", type=int_in(1), default=100, help="checkpoint every N steps (default 100)")
    p.add_argument("--time-limit", type=float, default=None, help="stop (with a checkpoint) after this many seconds")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="training matmuls: bf16 autocast or fp32 (default auto: bf16 where the CPU has AVX-512 BF16 or AMX)")
    p.add_argument("-t", "--threads", type=int_in(1), default=None, help="threads")
    p.add_argument("--init", default=None, metavar="HEAD.gguf",
                   help="start from this trained head (its weights and draft vocabulary), e.g. to fine-tune it on --recipe self data")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch

    from speculant import load_model

    from speculant_eagle3.layout import default_target_layers, write_head
    from speculant_eagle3.testing import head_config_for, target_embedding
    from speculant.training import bf16_default, collect, data_rows, default_sources, eog_ids

    from speculant_eagle3.train.loop import train

    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(f"speculant train eagle3: {msg}", file=sys.stderr, flush=True)
    t_start = time.time()
    target = load_model(args.model, progress=sys.stderr.isatty(), threads=args.threads)
    cfg = head_config_for(args.model, n_draft_vocab=min(args.draft_vocab, target.info.n_vocab), n_ff=args.ffn,
                          target_layers=default_target_layers(target.info.n_layers))
    sources = args.source or default_sources()
    # The input of tap layer t is the output of layer t - 1 (the layers the target hands out).
    manifest = collect(target, args.data, args.tokens, sources, tuple(t - 1 for t in cfg.target_layers), args.piece_tokens,
                       tag={"taps": list(cfg.target_layers)}, **recipe_options(args), log=log)
    log(f"data: {manifest['tokens']} tokens, {len(manifest['shards'])} shards in {args.data}")
    del target
    training_threads(args.threads)  # loading the target left torch one thread
    always = sorted(set(eog_ids(args.model)))
    remaining = None if args.time_limit is None else max(1.0, args.time_limit - (time.time() - t_start))
    net, d2t, acc, done = train(cfg, target_embedding(args.model), args.model, args.data, total_steps=args.steps, batch=args.batch,
                          window=args.window, steps=args.ttt, lr=args.lr, save_every=args.save_every, mix=tuple(args.mix), init=args.init, seed=args.seed,
                          top1_weight=args.top1_weight, by_rows=args.sample_by_rows,
                          always=always, log=log, progress=sys.stderr.isatty(), time_limit=remaining,
                          bf16=bf16_default() if args.precision == "auto" else args.precision == "bf16")
    summary = {"tokens": data_rows([args.data, *args.mix]), "steps": done, "of_steps": args.steps, "batch": args.batch, "window": args.window,
               "held_out_accuracy": [round(a, 4) for a in acc],
               "sources": sources, "recipe": args.recipe, "mix": args.mix, "init": args.init, "draft_vocab": len(d2t), "ffn": args.ffn, "ttt": args.ttt,
               "top1_weight": args.top1_weight, "sample_by_rows": args.sample_by_rows}
    write_head(args.output, cfg, net.gguf_weights(), target_path=args.model, d2t=d2t, qtype=args.qtype,
               extra={"speculant.training": json.dumps(summary)})
    log(f"wrote {args.output} after {done} of {args.steps} steps: held-out top-1 accuracy per step {summary['held_out_accuracy']}"
        + ("" if done >= args.steps else " (rerun the same command to continue)"))
    return 0

