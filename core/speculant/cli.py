"""`speculant` command line: generate (and, through plugins, more). User errors: one line, exit 2."""
from __future__ import annotations

import argparse
import sys
import time

from speculant.errors import SpeculantError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=40, help="top-k filter, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p filter, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p filter, 0 = off (default 0.05)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="target model, a .gguf file")
    p.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--device", default="cpu", help="backend plugin (default cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Speculative-decoding inference engine for GGUF models.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_model_args(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text")
    g.add_argument("-n", "--n-predict", type=_positive_int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    add_sampling_args(g)
    return parser


def cmd_generate(args) -> int:
    from speculant.engine import Engine, EngineConfig
    from speculant.gguf.tokenizer import StreamDecoder
    from speculant.loader import load_model
    from speculant.sampling import SamplingParams

    t0 = time.perf_counter()
    model = load_model(args.model, backend=args.device)
    load_s = time.perf_counter() - t0
    tok = model.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special=True, parse_special=True)
    else:
        prompt = tok.encode(args.prompt, add_special=True, parse_special=False)
    engine = Engine(model, EngineConfig(n_ctx=args.ctx_size))
    params = SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed)
    n_predict = min(args.n_predict, args.ctx_size - len(prompt))

    stream = StreamDecoder(tok)
    if not args.chat:
        sys.stdout.write(args.prompt)
    t_start = time.perf_counter()
    t_first = None
    n = 0
    for token in engine.generate(prompt, max(1, n_predict), params):
        t_first = t_first or time.perf_counter()
        n += 1
        if token not in engine.eog:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    t_end = time.perf_counter()
    # The first token comes out of the prompt's forward pass, so prompt speed is measured to it.
    prompt_s = (t_first or t_end) - t_start
    decode_s = t_end - t_first if t_first else 0.0
    decode_rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    print(f"\nload {load_s:.2f} s | prompt {len(prompt)} tok, {len(prompt) / max(prompt_s, 1e-9):.1f} tok/s"
          f" | decode {n} tok, {decode_rate:.2f} tok/s", file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspeculant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
