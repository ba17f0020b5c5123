"""The flags every `speculant` command shares, and what they build (public: command plugins use it).

    from speculant.flags import OneLineParser, add_model_args, add_spec_args, load, engine_setup
"""
from __future__ import annotations

import argparse
import sys

from speculant.errors import ModelFileError
from speculant.options import float_where as _float, int_in as _int


class OneLineParser(argparse.ArgumentParser):
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
    g.add_argument("--spec-deadline", type=_float("a number of seconds >= 0", lambda v: v >= 0 and v < float("inf")),
                   default=5.0, metavar="SECONDS",
                   help="a speculator hook call not returning within this is abandoned and the speculator "
                        "quarantined (not called until --spec-revive; the rest of the chain goes on), logged; its "
                        "calls run on a thread of its own for this (default 5; 0: no deadline, calls run inline)")
    g.add_argument("--spec-revive", type=_float("a number of seconds >= 0", lambda v: v >= 0 and v < float("inf")),
                   default=60.0, metavar="SECONDS",
                   help="a quarantined speculator is tried again this long after, once its stuck call has returned, "
                        "starting over for every sequence; the third quarantine is for good (default 60; 0: never)")
    g.add_argument("--spec-grace", type=_float("a number of seconds > 0", lambda v: v > 0 and v < float("inf")),
                   default=None, metavar="SECONDS",
                   help="the deadline instead where a speculator may catch up on a prompt (begin, truncate, "
                        "prefill, its first propose and accept for a request), plus 20 ms per token of the "
                        "request (default: max(60, 10 x --spec-deadline))")
    g.add_argument("--spec-use-checkpoints", action="store_true",
                   help="recurrent/hybrid targets: save the state before each verification and, when a draft is "
                        "cut, restore it and feed the kept tokens again (llama.cpp's way) instead of going back "
                        "to the last kept verification row's state (the default, no re-decode)")
    g.add_argument("-ctxcp", "--ctx-checkpoints", dest="ctx_checkpoints", type=_int(0), default=32, metavar="N",
                   help="recurrent/hybrid targets: prompt-end states kept per sequence, the points a later request "
                        "can resume from (default 32, as llama.cpp)")
    default_registry().add_options(g)


def engine_setup(args, model):
    """EngineConfig and speculators from the flags (one place for generate, bench and serve)."""
    from speculant.engine import EngineConfig
    from speculant.speculator import build_speculators, parse_spec_types

    config = EngineConfig(n_ctx=args.ctx_size, draft_n_max=args.spec_draft_n_max, draft_n_min=args.spec_draft_n_min,
                          draft_p_min=args.spec_draft_p_min, adaptive=args.spec_adaptive,
                          spec_deadline=getattr(args, "spec_deadline", 5.0) or None,
                          spec_grace=getattr(args, "spec_grace", None),
                          spec_revive=getattr(args, "spec_revive", 60.0) or None,
                          spec_use_checkpoints=getattr(args, "spec_use_checkpoints", False),
                          ctx_checkpoints=getattr(args, "ctx_checkpoints", 32))
    names = parse_spec_types(args.spec_type)
    return config, build_speculators(names, vars(args), target=model, draft_model=args.spec_draft_model, backend=args.device)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="target model, a .gguf file")
    p.add_argument("-c", "--ctx-size", type=_int(2), default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--device", default="cpu", help="backend plugin (default cpu)")
    p.add_argument("-t", "--threads", type=_int(1), default=None,
                   help="CPU threads (default: $SPECULANT_THREADS, else all cores)")
    p.add_argument("--log-format", choices=("console", "json", "text"), default="console",
                   help="log lines on stderr: key=value (console; text is the same) or one JSON object each (default console)")


def load(args):
    """The model named by -m, with a progress bar on a terminal; OS errors name the file."""
    from speculant.loader import load_model

    try:
        model = load_model(args.model, backend=args.device, progress=sys.stderr.isatty(), threads=args.threads)
    except OSError as e:  # permission denied, I/O error, ... while reading the file
        raise ModelFileError(f"{args.model}: cannot read the file: {e.strerror or e}") from None
    return model
