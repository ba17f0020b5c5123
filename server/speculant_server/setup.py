"""How a server is built from `speculant serve`'s flags: the flags themselves, logging, and the
model, engine and app they describe. Shared by the single server (cli.py) and each Ray Serve
replica (ray_replica.py), which must build exactly the same thing."""
from __future__ import annotations

import argparse
import logging
import os

from speculant.errors import SpeculantError

__all__ = ["add_serve_args", "api_keys", "build_server", "configure_logging", "slot_folder"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from speculant.flags import add_model_args, add_sampling_args, add_spec_args
    from speculant.options import float_where, int_in

    seconds_flag = float_where("a number of seconds > 0", lambda v: 0 < v < float("inf"))
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int_in(0, 65535), default=8080, help="port to listen on (default 8080; 0: any free port)")
    g.add_argument("-np", "--parallel", type=int_in(1, 256), default=4,
                   help="slots: sequences generated together, their verification batched (default 4)")
    g.add_argument("--queue-size", type=int_in(0), default=256,
                   help="requests that may wait for a slot; more get 503 (default 256)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (comma list: several keys)")
    g.add_argument("--alias", default=None, help="model name in responses and /v1/models (default: the file name)")
    g.add_argument("-n", "--n-predict", type=int_in(-1), default=-1,
                   help="default max tokens per request, -1 = until the end of the context (default -1)")
    g.add_argument("--max-body-size", type=int_in(1), default=16 * 2**20, help="largest request body in bytes (default 16 MiB)")
    g.add_argument("--no-warmup", action="store_true",
                   help="start listening without first running a greedy row through the model and waiting for what "
                        "it prepares (the CPU backend's screened output head: about 0.5 s, 20 s the first time for "
                        "a 1.5B model)")
    g.add_argument("--metrics", action="store_true", help="accepted for llama-server compatibility; /metrics is always on")
    g.add_argument("--timeout-body", type=seconds_flag, default=60.0, metavar="SECONDS",
                   help="time to receive a request's whole body once its headers are in; a slower one gets 408 and "
                        "its connection is closed (default 60)")
    g.add_argument("--timeout-keep-alive", type=seconds_flag, default=15.0, metavar="SECONDS",
                   help="an idle connection, or one that has not sent a complete request head, is closed after "
                        "this long (default 15)")
    g.add_argument("--shutdown-timeout", type=float_where("a number of seconds >= 0", lambda v: 0 <= v < float("inf")),
                   default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: new and waiting requests get 503, running ones may finish for this "
                        "long, less a second to send the rest an error; then the server exits (default 10)")
    g = p.add_argument_group("request limits (checked before a prompt is tokenized)")
    g.add_argument("--max-prompt-bytes", type=int_in(-1), default=-1, metavar="BYTES",
                   help="largest prompt text (a chat prompt as rendered) in UTF-8 bytes; larger ones get 413 before "
                        "tokenizing (default -1: what the context could hold, ctx-size times the longest token's "
                        "bytes, at least 64 KiB; 0: no limit)")
    g.add_argument("--max-messages", type=int_in(1), default=2048, help="most messages in a chat request (default 2048)")
    g.add_argument("--max-stop-strings", type=int_in(0), default=64, help="most 'stop' strings in a request (default 64)")
    g.add_argument("--max-stop-length", type=int_in(1), default=512, metavar="CHARS",
                   help="longest 'stop' string, in characters (default 512)")
    g.add_argument("--max-n", type=int_in(1), default=8, metavar="N",
                   help="most choices a request may ask for with 'n' (default 8; also at most -np: the choices "
                        "run at the same time, one slot each)")
    g.add_argument("--special-in-content", action="store_true",
                   help="parse special-token texts inside chat messages as control tokens, as before: a message "
                        "could then open turns of other roles (default: they are text)")
    g = p.add_argument_group("prompt cache")
    g.add_argument("-cram", "--cache-ram", type=int_in(-1), default=8192, metavar="MiB",
                   help="memory for the states of finished prompts beyond the slots' own, reused when a later prompt "
                        "starts the same way (default 8192; -1: no limit; 0: off)")
    g.add_argument("-sps", "--slot-prompt-similarity", type=float_where("a number in [0, 1]", lambda v: 0 <= v <= 1), default=0.1,
                   help="a request goes to the idle slot whose kept state shares the longest prefix with its prompt, "
                        "if more than this fraction of it; else to the least recently used slot (default 0.1)")
    g.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder for /slots/ID?action=save|restore files (default: those actions are off)")
    g = p.add_argument_group("replicas on Ray Serve (pip install 'speculant[ray]'; docs/serving-ray.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve through N Ray Serve replicas of the engine behind one endpoint on --host:--port; a "
                        "conversation's requests go to the replica that holds its prompt cache")
    g.add_argument("--ray-replicas", type=int_in(1, 1024), default=2, metavar="N", help="replicas (default 2)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster on this machine)")
    g.add_argument("--ray-cpus-per-replica", type=float_where("a number > 0", lambda v: 0 < v < float("inf")), default=None,
                   metavar="N", help="Ray CPUs each replica reserves (default: -t, else this machine's cores / replicas, "
                                     "which is also each replica's -t then)")
    g.add_argument("--ray-max-ongoing", type=int_in(1), default=None, metavar="N",
                   help="requests a replica takes at once; beyond that the router sends even a known conversation to "
                        "the least loaded replica (default 2 x -np)")
    g.add_argument("--ray-retries", type=int_in(0, 10), default=1, metavar="N",
                   help="times a request whose replica died before answering is sent to another (default 1)")
    add_sampling_args(p)
    add_spec_args(p)


def configure_logging(fmt: str = "console") -> None:
    """The server logs a line per request: speculant's loggers from INFO on, others' warnings."""
    from speculant.logs import configure

    configure("json" if fmt == "json" else "console", level=logging.INFO)


def slot_folder(path: str) -> str:
    """--slot-save-path as an absolute path, the folder created if missing; SpeculantError if it
    cannot be, so that a typo fails at start-up rather than at the first save."""
    folder = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise SpeculantError(f"--slot-save-path {path} is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise SpeculantError(f"cannot create --slot-save-path {path}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpeculantError(f"--slot-save-path {path} is not writable")
    return folder


def build_server(args):
    """The model, engine and app that `args` (serve's flags) describe: what `speculant serve`
    listens with, and what each Ray Serve replica runs (ray_replica.py). Returns the app and the
    engine's config; a bad model, draft or spec type raises SpeculantError."""
    from speculant.flags import engine_setup, load
    from speculant.engine import Engine
    from speculant.sampling import SamplingParams

    from speculant_server.app import ServerConfig, create_app
    from speculant_server.protocol import Defaults, Limits

    slot_save_path = slot_folder(args.slot_save_path) if args.slot_save_path else None
    model = load(args)
    config, speculators = engine_setup(args, model)  # a missing or incompatible draft model fails here
    engine = Engine(model, config, speculators)
    warm_up = getattr(model, "warm_up", None)
    if warm_up is not None and not args.no_warmup:  # as llama-server: the first request runs at full speed
        warm_up()
    defaults = Defaults(SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed), args.n_predict)
    server_config = ServerConfig(n_slots=args.parallel, queue_size=args.queue_size, api_keys=api_keys(args), alias=args.alias,
                                 max_body_size=args.max_body_size, defaults=defaults, draft_model=args.spec_draft_model,
                                 cache_ram=None if args.cache_ram < 0 else args.cache_ram << 20,
                                 slot_similarity=args.slot_prompt_similarity, slot_save_path=slot_save_path,
                                 limits=Limits(args.max_prompt_bytes, args.max_messages, args.max_stop_strings,
                                               args.max_stop_length, args.max_n),
                                 special_in_content=args.special_in_content, body_timeout=args.timeout_body,
                                 keepalive_timeout=args.timeout_keep_alive, shutdown_timeout=args.shutdown_timeout)
    return create_app(engine, server_config), config


def api_keys(args) -> tuple[str, ...]:
    return tuple(k.strip() for k in (args.api_key or "").split(",") if k.strip())
