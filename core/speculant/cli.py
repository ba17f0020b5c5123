"""`speculant` command line: generate (and, through plugins, more). User errors: one line, exit 2."""
from __future__ import annotations

import argparse
import os
import sys
import time

from speculant.errors import ModelFileError, SpeculantError
from speculant.options import float_where as _float, int_in as _int


# --- flags -------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block is for --help, not for every typo."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=_float("a number >= 0", lambda v: v >= 0), default=0.0,
                   help="temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=_int(0), default=40, help="top-k filter, 0 = off (default 40)")
    p.add_argument("--top-p", type=_float("a number in (0, 1]", lambda v: 0 < v <= 1), default=0.95,
                   help="top-p filter, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=_float("a number in [0, 1]", lambda v: 0 <= v <= 1), default=0.05,
                   help="min-p filter, 0 = off (default 0.05)")
    p.add_argument("--seed", type=_int(0, 2**64 - 1), default=None, help="random seed (default: random)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculation flags, named like llama.cpp's; plugins add their own through speculant_add_options."""
    from speculant.plugins import default_registry

    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec-type", default=None, help="comma list of speculators, tried in this order (default: none); "
                   "bench compares several lists separated by ';'")
    g.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", default=None,
                   help="draft model .gguf for model-based speculators (draft-simple), with the target's vocabulary")
    g.add_argument("--spec-draft-n-max", "--draft-max", dest="spec_draft_n_max", type=_int(0, 64), default=16,
                   help="most tokens verified per step, for every spec type (default 16, at most 64)")
    g.add_argument("--spec-draft-n-min", "--draft-min", dest="spec_draft_n_min", type=_int(0, 64), default=0,
                   help="drop drafts shorter than this (default 0)")
    g.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_draft_p_min",
                   type=_float("a number in [0, 1]", lambda v: 0 <= v <= 1), default=0.0,
                   help="model drafters stop below this confidence, the draft token's probability (default 0)")
    g.add_argument("--no-spec-adaptive", dest="spec_adaptive", action="store_false",
                   help="verify every draft in full instead of the length the cost model picks")
    default_registry().add_options(g)


def engine_setup(args, model):
    """EngineConfig and speculators from the flags (one place for generate, bench and serve)."""
    from speculant.engine import EngineConfig
    from speculant.speculator import build_speculators, parse_spec_types

    config = EngineConfig(n_ctx=args.ctx_size, draft_n_max=args.spec_draft_n_max, draft_n_min=args.spec_draft_n_min,
                          draft_p_min=args.spec_draft_p_min, adaptive=args.spec_adaptive)
    names = parse_spec_types(args.spec_type)
    return config, build_speculators(names, vars(args), target=model, draft_model=args.spec_draft_model, backend=args.device)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="target model, a .gguf file")
    p.add_argument("-c", "--ctx-size", type=_int(2), default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--device", default="cpu", help="backend plugin (default cpu)")
    p.add_argument("-t", "--threads", type=_int(1), default=None,
                   help="CPU threads (default: $SPECULANT_THREADS, else all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speculant", description="Speculative-decoding inference engine for GGUF models.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_model_args(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("-n", "--n-predict", type=_int(1), default=128,
                   help="tokens to generate, at most what the context has left (default 128)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    add_sampling_args(g)
    add_spec_args(g)

    b = sub.add_parser("bench", help="load time, peak memory and decode speed on workload files")
    add_model_args(b)
    b.add_argument("--workloads", nargs="+", default=[], help="workload JSON files (messages are chat-templated)")
    b.add_argument("--kernels", action="store_true",
                   help="time one target forward over 1, 2, 4, 8 and 16 rows (the verification cost ratio) instead")
    b.add_argument("--kernels-context", type=_int(0), default=256, metavar="N",
                   help="--kernels: tokens already cached before the timed rows (default 256)")
    b.add_argument("-n", "--n-predict", type=_int(1), default=None, help="tokens per workload (default: its max_tokens)")
    b.add_argument("--repeats", type=_int(1), default=1, help="runs per workload; medians are reported (default 1)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_spec_args(b)

    from speculant_server.cli import add_parser as add_serve_parser

    add_serve_parser(sub)

    pl = sub.add_parser("plugins", help="list the installed plugins: kind, distribution, what they register, hooks")
    pl.add_argument("--all", action="store_true", help="also those SPECULANT_PLUGINS / SPECULANT_DISABLE_PLUGINS kept out")
    pl.add_argument("--json", action="store_true", help="JSON instead of the table")
    return parser


# --- commands ----------------------------------------------------------------------------------
def load(args):
    """The model named by -m, with a progress bar on a terminal; OS errors name the file."""
    from speculant.loader import load_model

    try:
        model = load_model(args.model, backend=args.device, progress=sys.stderr.isatty())
    except OSError as e:  # permission denied, I/O error, ... while reading the file
        raise ModelFileError(f"{args.model}: cannot read the file: {e.strerror or e}") from None
    if args.threads:  # after loading: the CPU backend sets its thread count when it is created
        import torch

        torch.set_num_threads(args.threads)
    return model


def cmd_generate(args) -> int:
    from speculant.engine import Engine
    from speculant.gguf.tokenizer import StreamDecoder
    from speculant.sampling import SamplingParams

    t0 = time.perf_counter()
    model = load(args)
    load_s = time.perf_counter() - t0

    tok = model.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special=True, parse_special=True)
    else:
        prompt = tok.encode(args.prompt, add_special=True, parse_special=False)
    engine = Engine(model, *engine_setup(args, model))
    params = SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed)
    # add() rejects a prompt that leaves no room in the context, before anything is printed.
    seq = engine.add(prompt, min(args.n_predict, args.ctx_size - len(prompt)), params)

    stream = StreamDecoder(tok, skip_special=True)  # control tokens print as nothing, as in llama-cli
    if not args.chat:  # a raw prompt is the start of the text; a chat prompt is not shown
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    t_start = time.perf_counter()
    t_first = None
    n = 0
    while seq.finish_reason is None:
        for token in engine.step()[seq.seq_id]:
            t_first = t_first or time.perf_counter()
            n += 1
            if token not in engine.eog:
                sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    engine.release(seq)
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    t_end = time.perf_counter()

    # The first token comes out of the prompt's forward pass, so prompt speed is measured to it.
    prompt_s = (t_first or t_end) - t_start
    decode_s = t_end - t_first if t_first else 0.0
    decode_rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    spec = ""
    if engine.chain:
        d = seq.stats.drafts
        spec = f" | drafted {d.drafted}, accepted {d.accepted} ({100 * d.acceptance_rate:.0f}%), declined {seq.stats.n_declined}"
    print(f"load {load_s:.2f} s | prompt {len(prompt)} tok, {len(prompt) / max(prompt_s, 1e-9):.1f} tok/s"
          f" | decode {n} tok, {decode_rate:.2f} tok/s{spec}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from speculant.bench import run_bench

    return run_bench(args, load)


def cmd_serve(args) -> int:
    from speculant_server.cli import cmd_serve as serve

    return serve(args)


def cmd_plugins(args) -> int:
    import json

    from speculant.plugins import default_registry, describe, format_table

    rows = describe(default_registry(), include_disabled=args.all)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve, "plugins": cmd_plugins}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, already reported in one line)
        return e.code if isinstance(e.code, int) else 2
    except SpeculantError as e:  # the plugins' flags could not be collected (two plugins claim one name, ...)
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`speculant generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        return 141
    except KeyboardInterrupt:
        print("\nspeculant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
