"""Ray Serve request router with conversation affinity, for the engine replicas.

Each request of the engine deployment carries its routing keys (affinity.py) as its first
argument: its conversation so far, and each prefix of it. The router remembers which replica
each request's whole conversation went to, and sends a request to the replica of its longest
prefix that some earlier request sent whole: the one holding that conversation's prompt cache
and suffix history. A request with no known key, or whose replica is gone, goes to the least loaded
replica (Serve probes the queue lengths); so does one whose replica is full (max_ongoing
requests reached), rather than waiting behind it. Keys of the form ``replica:ID`` name a replica
outright: the ingress fans /metrics and /slots out with them.

It is a plain ``RequestRouter``, without the FIFO mixin: Serve's FIFO mixin may hand the replica
chosen for one request to an older pending request, which would break the affinity.

The table lives in the process of the handle's owner, the ingress: one ingress replica (what
ray_app.py deploys) routes every conversation consistently; it is lost with the ingress, and
conversations then start over on the least loaded replicas (a cache miss, not an error).
"""
from __future__ import annotations

from collections import OrderedDict

import attrs
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

REPLICA_KEY = "replica:"
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
    def initialize_state(self, max_keys: int = 200_000):
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()
        self._max_keys = max_keys
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
        owner = self.owner(keys)
        if owner is None:
            return [candidate_replicas]
        others = [r for r in candidate_replicas if r.replica_id != owner]
        mine = [r for r in candidate_replicas if r.replica_id == owner]
        return [mine, others] if others else [mine]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = request_keys(pending_request)
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
