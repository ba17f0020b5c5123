"""`speculant serve --ray`: the engine as N Ray Serve replicas behind one OpenAI-compatible endpoint.

Two deployments make the application: ``SpeculantIngress`` (ray_ingress.py, one replica, no CPU
reserved: it only relays bytes) owns the HTTP route, and ``SpeculantEngine`` (ray_replica.py,
--ray-replicas of them, each with its own model, slots, prompt cache and speculators) is called
through a handle whose router keeps a conversation on one replica (ray_router.py). Ray is
imported here and in those modules only; without it, --ray is a one-line error.

Also `serve run speculant_server.ray_app:app_builder flags="-m /abs/model.gguf -np 2 --ray-replicas 2"`
on an existing cluster (`serve run`'s key=value arguments; ``flags`` are `speculant serve`'s).
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import signal
import socket
import threading

from speculant.errors import SpeculantError

APP_NAME = "speculant"
ENGINE = "SpeculantEngine"
INGRESS = "SpeculantIngress"
ROUTER_CLASS = "speculant_server.ray_router.AffinityRouter"
FANOUT_HEADROOM = 16  # Serve's per-replica limit above the router's: room for /metrics and /slots calls


def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpeculantError("--ray needs Ray Serve, which is not installed: pip install 'speculant[ray]'") from None
    return ray, serve


def replica_resources(args) -> tuple[float, int]:
    """(Ray CPUs a replica reserves, its engine's threads): -t and --ray-cpus-per-replica, each the
    other's default, else this machine's cores shared among the replicas."""
    cpus, threads = args.ray_cpus_per_replica, args.threads
    if cpus is None:
        cpus = float(threads) if threads else max(1.0, float((os.cpu_count() or 1) // args.ray_replicas))
    return cpus, threads or max(1, int(cpus))


def prepared(args) -> argparse.Namespace:
    """The flags as the replicas take them: files by absolute path (a replica's working folder is
    Ray's, not ours) and the threads of one replica."""
    args = argparse.Namespace(**vars(args))
    args.model = os.path.abspath(os.path.expanduser(args.model))
    if args.spec_draft_model:
        args.spec_draft_model = os.path.abspath(os.path.expanduser(args.spec_draft_model))
    args.threads = replica_resources(args)[1]
    args.ray = False
    return args


def build_app(args):
    """The bound Serve application for serve's flags `args`."""
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from speculant_server.ray_ingress import Ingress, IngressSettings
    from speculant_server.ray_replica import EngineReplica

    cpus, _ = replica_resources(args)
    # Requests a replica takes at once: its slots and as many waiting; more go to the least loaded
    # replica, even for a known conversation, instead of queueing behind it. The router enforces
    # it; Serve's own limit is above it, so that /metrics and /slots still reach a full replica.
    max_ongoing = args.ray_max_ongoing or 2 * args.parallel
    engine = serve.deployment(EngineReplica, name=ENGINE).options(
        num_replicas=args.ray_replicas,
        ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=max_ongoing + FANOUT_HEADROOM,
        max_queued_requests=args.queue_size or -1,  # waiting in the ingress for a replica; beyond it: 503
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=args.shutdown_timeout + 1,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                                  request_router_kwargs={"max_ongoing": max_ongoing}),
    )
    ingress = serve.deployment(Ingress, name=INGRESS).options(
        num_replicas=1,  # one routing table: see ray_router.py
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # it only waits on the engine replicas, which bound the work
    )
    settings = IngressSettings(engine=ENGINE, max_body_size=args.max_body_size, retries=args.ray_retries,
                               log_format=args.log_format)
    return ingress.bind(engine.bind(prepared(args)), settings)


def app_builder(config: dict):
    """For `serve run speculant_server.ray_app:app_builder flags="..."`."""
    from speculant.flags import OneLineParser

    from speculant_server.setup import add_serve_args

    parser = OneLineParser(prog="speculant_server.ray_app:app_builder", description="flags of speculant serve")
    add_serve_args(parser)
    return build_app(check(parser.parse_args(shlex.split(config.get("flags", "")))))


def check(args):
    """What can fail before a cluster starts, in one line."""
    from speculant.speculator import parse_spec_types

    parse_spec_types(args.spec_type)
    if args.slot_save_path:
        raise SpeculantError("--slot-save-path does not go with --ray: slot files are per replica, and /slots actions "
                             "are not available through the ingress")
    for flag, path in (("-m", args.model), ("-md", args.spec_draft_model)):
        if path and not os.path.isfile(os.path.expanduser(path)):
            raise SpeculantError(f"{flag} {path}: no such file")
    return args


def free_port(host: str, port: int) -> int:
    """`port`, checked free; for 0, a free one (Serve's proxy cannot take 0). It is drawn from
    20000-32767, below Linux's ephemeral ports and above Ray's worker ports (10002-19999): the
    processes Ray starts before the proxy binds take theirs from those ranges, so cannot take it
    in between."""
    candidates = [port] if port else random.sample(range(20000, 32768), 64)
    for candidate in candidates:
        try:
            with socket.create_server((host, candidate)):
                return candidate
        except OSError as e:
            error = e
    raise SpeculantError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def deploy(args, after_init=None) -> tuple[str, bool]:
    """Start (or join) Ray, start Serve's proxy on --host:--port and run the application; returns
    the endpoint's URL and whether a local cluster was started here. Blocks until every replica
    has loaded its model. `after_init` runs once Ray is up."""
    ray, serve = require_ray()
    check(args)
    port = free_port(args.host, args.port)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # serving a model phones nowhere unless asked to
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized() and not address
    if not ray.is_initialized():
        cpus, _ = replica_resources(args)
        kwargs = {"address": address} if address else {
            # a local cluster: enough logical CPUs for the replicas even on a smaller machine
            "num_cpus": max(os.cpu_count() or 1, int(cpus * args.ray_replicas + 0.999)),
            "include_dashboard": False}
        ray.init(namespace="speculant", **kwargs)
    if after_init is not None:
        after_init()
    serve.start(http_options={"host": args.host, "port": port})
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:  # a replica failed to start: say why, in the replica's own words
        why = replica_error(serve) or str(e).splitlines()[0]
        shutdown(started)
        raise SpeculantError(f"the replicas did not start: {why}") from None
    return f"http://{args.host}:{port}", started


def replica_error(serve) -> str | None:
    """The last line of the traceback a failed replica left in Serve's status: for a bad model or
    draft, speculant's own one-line error."""
    try:
        message = serve.status().applications[APP_NAME].deployments[ENGINE].message
    except Exception:  # noqa: BLE001 - the status is a nicety on top of the error
        return None
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    name, _, text = last.partition(": ")
    return text if text and name.rsplit(".", 1)[-1].endswith("Error") else last


def shutdown(started: bool) -> None:
    """Take the application down: with the whole local cluster if it was started here."""
    ray, serve = require_ray()
    if started:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)


def cmd_serve_ray(args) -> int:
    from speculant.logs import get_logger

    from speculant_server.setup import configure_logging

    check(args)
    require_ray()
    free_port(args.host, args.port)
    configure_logging(args.log_format)
    log = get_logger("speculant.server.ray")
    stop = threading.Event()

    def on_signals():  # after ray.init, which installs a SIGTERM handler of its own that aborts
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    url, started = deploy(args, on_signals)
    cpus, threads = replica_resources(args)
    log.info("listening", url=url, model=args.model, replicas=args.ray_replicas, cpus_per_replica=cpus,
             threads_per_replica=threads, slots_per_replica=args.parallel, spec_types=args.spec_type or "none")
    try:
        stop.wait()
    finally:
        log.info("shutting down", replicas=args.ray_replicas)
        shutdown(started)
    return 0
