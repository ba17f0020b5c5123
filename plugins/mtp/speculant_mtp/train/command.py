"""`speculant train mtp -m TARGET.gguf -o mtp-X.gguf --data DIR`: collect, train, export a sidecar.

Trains a NextN / MTP block for a target that has none (qwen2, qwen3, llama: a block shaped as the
target's own layers), and writes it as an MTP sidecar in llama.cpp's layout, for
`--spec-type mtp -md mtp-X.gguf`. Each phase resumes: the data directory keeps the collected
shards (speculant.training: the target's final hidden state and top-k over local source files)
and the training checkpoint (mtp-ckpt.pt), so rerunning the same command after an interruption
continues where it stopped, and a finished run only exports again.
"""
from __future__ import annotations

import json
import sys
import time

from speculant.options import int_in
from speculant.training import add_recipe_arguments, add_top1_weight_argument, recipe_options, training_threads


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("mtp", help="train an MTP (NextN) block for a target, written as a llama.cpp-layout sidecar",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the target .gguf")
    p.add_argument("-o", "--output", required=True, help="the sidecar .gguf to write (llama.cpp names them mtp-....gguf)")
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
    p.add_argument("--unroll", type=int_in(1, 8), default=3, help="draft steps unrolled in training (default 3)")
    add_top1_weight_argument(p)
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    p.add_argument("--train-vocab", type=int_in(0), default=16384,
                   help="tokens the training softmax runs over, the most frequent first (0: all; default 16384)")
    p.add_argument("--ffn", type=int_in(16), default=4096, help="the block's FFN width (default 4096)")
    p.add_argument("--qtype", default="Q8_0", choices=("F32", "F16", "Q8_0", "Q5_0", "Q4_0"), help="matrix type in the GGUF (default Q8_0)")
    p.add_argument("--save-every", type=int_in(1), default=100, help="checkpoint every N steps (default 100)")
    p.add_argument("--time-limit", type=float, default=None, help="stop (with a checkpoint) after this many seconds")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="training matmuls: bf16 autocast or fp32 (default auto: bf16 where the CPU has AVX-512 BF16 or AMX)")
    p.add_argument("-t", "--threads", type=int_in(1), default=None, help="threads")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch

    from speculant import SpeculantError, load_model
    from speculant.gguf import open_gguf
    from speculant.training import bf16_default, collect, data_rows, default_sources, eog_ids

    from speculant_mtp.layout import has_nextn, write_sidecar
    from speculant_mtp.testing import config_for, target_parts
    from speculant_mtp.train.loop import train

    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(f"speculant train mtp: {msg}", file=sys.stderr, flush=True)
    t_start = time.time()
    if has_nextn(open_gguf(args.model)):
        log(f"note: {args.model} has an MTP block of its own (--spec-type mtp uses it without -md); training another")
    try:
        cfg = config_for(args.model, n_ff=args.ffn)
    except ValueError as e:
        raise SpeculantError(str(e)) from None
    target = load_model(args.model, progress=sys.stderr.isatty(), threads=args.threads)
    if target.info.n_layers != cfg.n_trunk:
        raise SpeculantError(f"{args.model}: {target.info.n_layers} layers loaded, the file says {cfg.n_trunk}")
    sources = args.source or default_sources()
    # h: the target's final hidden state after output_norm (what llama.cpp's MTP graphs read)
    manifest = collect(target, args.data, args.tokens, sources, (target.info.n_layers,), args.piece_tokens, **recipe_options(args), log=log)
    log(f"data: {manifest['tokens']} tokens, {len(manifest['shards'])} shards in {args.data}")
    del target
    training_threads(args.threads)  # loading the target left torch one thread
    embed, lm_head = target_parts(args.model)
    remaining = None if args.time_limit is None else max(1.0, args.time_limit - (time.time() - t_start))
    net, vocab, acc, done = train(cfg, embed, lm_head, args.model, args.data, total_steps=args.steps, batch=args.batch,
                           window=args.window, steps=args.unroll, lr=args.lr, n_train_vocab=args.train_vocab,
                           save_every=args.save_every, mix=tuple(args.mix), seed=args.seed, always=sorted(set(eog_ids(args.model))),
                           bias=not cfg.gated, log=log, progress=sys.stderr.isatty(), time_limit=remaining,
                           bf16=bf16_default() if args.precision == "auto" else args.precision == "bf16", top1_weight=args.top1_weight)
    summary = {"tokens": data_rows([args.data, *args.mix]), "steps": done, "of_steps": args.steps, "batch": args.batch, "window": args.window,
               "held_out_accuracy": [round(a, 4) for a in acc], "sources": sources, "recipe": args.recipe, "mix": args.mix, "ffn": args.ffn,
               "unroll": args.unroll, "train_vocab": args.train_vocab, "top1_weight": args.top1_weight}
    write_sidecar(args.output, args.model, net.gguf_weights(), qtype=args.qtype, draft_vocab=vocab,
                  extra={"speculant.training": json.dumps(summary)})
    log(f"wrote {args.output} after {done} of {args.steps} steps: held-out top-1 accuracy per draft step "
        f"{summary['held_out_accuracy']}" + ("" if done >= args.steps else " (rerun the same command to continue)"))
    return 0
