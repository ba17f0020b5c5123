"""Ray Serve request router with conversation affinity, for the engine replicas.

Each request of the engine deployment carries its routing keys (affinity.py) as its first
argument: its conversation so far, and each prefix of it. The router remembers which replica
each request's whole conversation went to, and sends a request to the replica of its longest
prefix that some earlier request sent whole: the one holding that conversation's prompt cache
and suffix history. A request with no known key, or whose replica is gone, goes to the least loaded
replica (the requests in flight the router counts itself); so does one whose replica is full
(--ray-max-ongoing requests in flight), rather than waiting behind it. Keys of the form ``replica:ID`` name a replica
outright: the ingress fans /metrics and /slots out with them.

It is a plain ``RequestRouter``, without the FIFO mixin: Serve's FIFO mixin may hand the replica
chosen for one request to an older pending request, which would break the affinity.

The table lives in the process of the handle's owner, the ingress: one ingress replica (what
ray_app.py deploys) routes every conversation consistently; it is lost with the ingress, and
conversations then start over on the least loaded replicas (a cache miss, not an error).
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict

import attrs
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

REPLICA_KEY = "replica:"
RESERVATION_S = 30.0  # a choice not routed by then (the request went elsewhere) stops counting
ROUTERS: dict[str, "AffinityRouter"] = {}  # deployment name -> its router in this process (the ingress reads them)


@attrs.define
class RoutingStats:
    """What the router did with keyed requests (the ingress exports them on /metrics)."""

    hits: int = 0  # sent to the replica that served the conversation before
    spills: int = 0  # that replica was alive but full: sent to the least loaded one instead
    moved: int = 0  # that replica is gone (died, scaled down): started over on the least loaded one
    new: int = 0  # no key seen before: the least loaded replica
    unkeyed: int = 0  # no keys at all (GETs, short prompts): the least loaded replica


def request_keys(pending_request: PendingRequest | None) -> list[str]:
    args = pending_request.args if pending_request is not None else None
    keys = args[0] if args else None
    return keys if isinstance(keys, list) else []


class AffinityRouter(RequestRouter):
    def initialize_state(self, max_ongoing: int = 8, max_keys: int = 200_000):
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()
        self._reserved: dict[int, tuple] = {}  # id(request) -> (it, its first choice, when)
        self._sent: dict[tuple[ReplicaID, str], int] = {}  # (replica, internal request id) -> requests not completed
        self._load: dict[ReplicaID, int] = {}  # replica -> requests sent to it, not completed
        self._max_keys = max_keys
        self._max_ongoing = max_ongoing  # --ray-max-ongoing: requests a replica takes at once (fan-outs aside)
        self.stats = RoutingStats()
        # Through the imported module, not this module's globals: Serve ships the router class
        # by value (cloudpickle), and the copy's globals are a dict of its own.
        import speculant_server.ray_router as home

        home.ROUTERS[self._deployment_id.name] = self

    def owner(self, keys: list[str]) -> ReplicaID | None:
        """The live replica of the longest key that has one."""
        for key in keys:
            replica = self._owner.get(key)
            if replica is not None and replica in self._replicas:
                return replica
        return None

    def replica_ids(self) -> list[str]:
        return [r.unique_id for r in list(self._replicas)]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Sleep between rounds when every rank is full, instead of spinning on the probes.
        pending_request.routing_context.should_backoff = True
        keys = request_keys(pending_request)
        if keys and keys[0].startswith(REPLICA_KEY):  # a fan-out: that replica or none (the ingress times out)
            wanted = keys[0][len(REPLICA_KEY):]
            return [[r for r in candidate_replicas if r.replica_id.unique_id == wanted]]
        self._reserved.pop(id(pending_request), None)  # this request's own earlier choice is not load
        owner = self.owner(keys)
        # Full replicas are left out (none left: Serve waits and asks again). The limit is ours,
        # not Serve's max_ongoing_requests, which ray_app.py sets higher: Serve's would also
        # refuse the /metrics and /slots fan-outs to a busy replica, until a request ended.
        order = [r for r, load in self.least_loaded(candidate_replicas) if load < self._max_ongoing]
        if owner is not None:
            order = [r for r in order if r.replica_id == owner] + [r for r in order if r.replica_id != owner]
        if order:  # counted against that replica until Serve's own count has the request (on_request_routed)
            self._reserved[id(pending_request)] = (pending_request, order[0].replica_id, time.monotonic())
        return [[r] for r in order]

    def least_loaded(self, candidates: list[RunningReplica]) -> list[tuple[RunningReplica, int]]:
        """The candidates and their loads, least first, ties in random order. Load is the requests this
        router sent to the replica that have not completed, plus those it chose the replica for
        and has not sent yet: many requests arriving together would otherwise all see the same
        loads and pick the same replica. Counted here rather than read from Serve's cached queue
        lengths, which lag (and miss a replica not probed yet); with the one ingress, every
        request of the deployment passes through this router."""
        # Kept until on_request_routed, not until the request's future is set: between the two
        # Serve sends it, and only then counts it in its queue lengths. Keyed by the request, not
        # its future: Serve gives a request it routes again a new one. A request cancelled while
        # waiting is never routed; one that is not heard of again is dropped after a while.
        now = time.monotonic()
        for key in [k for k, (pr, _, t) in self._reserved.items() if pr.future.cancelled() or now - t > RESERVATION_S]:
            self._reserved.pop(key, None)
        reserved: dict[ReplicaID, int] = {}
        for _, replica, _ in self._reserved.values():
            reserved[replica] = reserved.get(replica, 0) + 1
        loads = [(r, self._load.get(r.replica_id, 0) + reserved.get(r.replica_id, 0), random.random()) for r in candidates]
        return [(r, load) for r, load, _ in sorted(loads, key=lambda x: (x[1], x[2]))]

    def load(self) -> dict[str, int]:
        """Requests sent and not completed, by replica id (the ingress exports them)."""
        return {r.unique_id: self._load.get(r, 0) for r in list(self._replicas)}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._reserved.pop(id(pending_request), None)
        keys = request_keys(pending_request)
        if not (keys and keys[0].startswith(REPLICA_KEY)):  # fan-outs are not load
            sent = (replica_id, pending_request.metadata.internal_request_id)
            self._sent[sent] = self._sent.get(sent, 0) + 1
            self._load[replica_id] = self._load.get(replica_id, 0) + 1
        if not keys:
            self.stats.unkeyed += 1
            return
        if keys[0].startswith(REPLICA_KEY):
            return
        live = self.owner(keys)
        if live is not None:
            if live == replica_id:
                self.stats.hits += 1
            else:
                self.stats.spills += 1
        elif any(k in self._owner for k in keys):
            self.stats.moved += 1
        else:
            self.stats.new += 1
        # Only the request's whole conversation is recorded, not each of its prefixes: the next
        # turn finds it among its own prefixes, while a new conversation that merely shares a
        # system prompt finds nothing and goes to the least loaded replica (recording the
        # prefixes would send every conversation with that system prompt to one replica).
        self._owner[keys[0]] = replica_id
        self._owner.move_to_end(keys[0])
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Serve also calls this for a request the replica rejected (never counted: only
        # on_request_routed counts), so only what was counted is taken off.
        sent = (replica_id, internal_request_id)
        n = self._sent.get(sent, 0)
        if n <= 0:
            return
        if n == 1:
            del self._sent[sent]
        else:
            self._sent[sent] = n - 1
        self._load[replica_id] = max(0, self._load.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._load.pop(replica_id, None)
        for sent in [k for k in self._sent if k[0] == replica_id]:
            del self._sent[sent]
