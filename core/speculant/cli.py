"""`speculant` command line: generate, bench and plugins here; more (serve, ...) from plugins
through the speculant_add_commands hook (their flags: speculant.flags), and `train METHOD` with
the methods plugins add through speculant_add_trainers. User errors: one line, exit 2."""
from __future__ import annotations

import argparse
import os
import sys
import time

from speculant.errors import SpeculantError
from speculant.flags import OneLineParser, add_model_args, add_sampling_args, add_spec_args, engine_setup, load
from speculant.options import int_in as _int


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="speculant", description="Speculative-decoding inference engine for GGUF models.")
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

    pl = sub.add_parser("plugins", help="list the installed plugins: kind, distribution, what they register, hooks")
    pl.add_argument("--all", action="store_true", help="also those SPECULANT_PLUGINS / SPECULANT_DISABLE_PLUGINS kept out")
    pl.add_argument("--json", action="store_true", help="JSON instead of the table")

    from speculant.plugins import default_registry

    registry = default_registry()
    commands = {**CORE_COMMANDS, **registry.add_commands(sub)}  # serve, ...: plugins'
    if registry.pm.hook.speculant_add_trainers.get_hookimpls():  # `train` once a plugin has a method
        t = sub.add_parser("train", help="train a drafter for a target model (methods come from plugins)")
        methods = t.add_subparsers(dest="method", required=True, metavar="METHOD")
        trainers = registry.add_trainers(methods)
        commands["train"] = lambda args: trainers[args.method](args)
    parser.set_defaults(_commands=commands)
    return parser


# --- commands ----------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from speculant.engine import Engine
    from speculant.gguf.tokenizer import StreamDecoder
    from speculant.sampling import SamplingParams

    t0 = time.perf_counter()
    model = load(args)
    load_s = time.perf_counter() - t0

    tok = model.tokenizer
    if args.chat:
        prompt = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
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


def cmd_plugins(args) -> int:
    import json

    from speculant.plugins import default_registry, describe, format_table

    rows = describe(default_registry(), include_disabled=args.all)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


CORE_COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "plugins": cmd_plugins}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, already reported in one line)
        return e.code if isinstance(e.code, int) else 2
    except SpeculantError as e:  # the plugins' flags could not be collected (two plugins claim one name, ...)
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    from speculant.logs import configure

    configure("json" if getattr(args, "log_format", None) == "json" else "console", level="WARNING")
    try:
        return args._commands[args.command](args)
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
