"""The conversation-affinity router (ray_router.py) on its own, driven as Serve drives it: no
cluster, fake replicas. A conversation's request goes to its replica, or to the least loaded
one when it is full or gone; requests arriving together spread; fan-outs hit one replica."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="the [ray] extra (in [dev]) is not installed")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from speculant_server.ray_router import REPLICA_KEY, AffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="TestEngine", app_name="test")


class Replica:
    """What the router reads of Serve's RunningReplica."""

    def __init__(self, name: str):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 100


def make_router(names=("a", "b"), max_ongoing=2) -> tuple[AffinityRouter, list[Replica]]:
    router = AffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(max_ongoing=max_ongoing)
    replicas = [Replica(n) for n in names]
    router._replicas = {r.replica_id: r for r in replicas}
    return router, replicas


def pending(keys, request_id="r"):
    async def make():  # PendingRequest's future wants a running loop
        return PendingRequest(args=[keys], kwargs={}, metadata=RequestMetadata(request_id=request_id,
                                                                               internal_request_id=request_id))
    return asyncio.run(make())


def choose(router, replicas, pr) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, pr))
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def route(router, replicas, keys, request_id) -> str:
    """Choose and route one request to its first choice, as Serve does when that one accepts."""
    pr = pending(keys, request_id)
    first = choose(router, replicas, pr)[0]
    router.on_request_routed(pr, ReplicaID(unique_id=first, deployment_id=DEPLOYMENT), None)
    return first


def done(router, replica: str, request_id: str) -> None:
    router.on_request_completed(ReplicaID(unique_id=replica, deployment_id=DEPLOYMENT), request_id)


def test_a_conversation_goes_back_to_its_replica():
    router, replicas = make_router()
    first = route(router, replicas, ["chat:t1", "chat:sys"], "1")  # still running: load on `first`
    other = route(router, replicas, ["chat:x"], "2")  # another conversation: the other replica
    assert other != first
    # turn 2: its prefix chat:t1 is turn 1's whole conversation
    assert route(router, replicas, ["chat:t2", "chat:t1x", "chat:t1", "chat:sys"], "3") == first
    assert (router.stats.new, router.stats.hits) == (2, 1)


def test_a_shared_system_prompt_alone_is_no_match():
    router, replicas = make_router()
    first = route(router, replicas, ["chat:a-user", "chat:sys"], "1")
    # the other conversation with the same system prompt goes to the least loaded replica
    assert route(router, replicas, ["chat:b-user", "chat:sys"], "2") != first


def test_requests_arriving_together_spread():
    router, replicas = make_router(("a", "b", "c", "d"), max_ongoing=100)
    prs = [pending([f"chat:{i}"], str(i)) for i in range(8)]
    firsts = [choose(router, replicas, pr)[0] for pr in prs]  # all chosen before any is sent
    assert sorted(firsts.count(n) for n in "abcd") == [2, 2, 2, 2]


def test_a_full_replica_spills_and_a_gone_one_moves():
    router, replicas = make_router(max_ongoing=2)
    owner = route(router, replicas, ["chat:c"], "1")
    route(router, replicas, ["chat:c"], "2")  # the owner has 2 in flight: full
    assert route(router, replicas, ["chat:c"], "3") != owner
    assert router.stats.spills == 1
    router, replicas = make_router()
    owner = route(router, replicas, ["chat:c"], "1")
    router.on_replica_actor_died(ReplicaID(unique_id=owner, deployment_id=DEPLOYMENT))
    alive = [r for r in replicas if r.replica_id.unique_id != owner]
    assert route(router, alive, ["chat:c2", "chat:c"], "2") != owner
    assert router.stats.moved == 1


def test_every_replica_full_waits():
    router, replicas = make_router(max_ongoing=1)
    first = route(router, replicas, ["chat:a"], "1")
    route(router, replicas, ["chat:b"], "2")
    assert choose(router, replicas, pending(["chat:c"], "3")) == []  # Serve backs off and asks again
    done(router, first, "1")
    assert choose(router, replicas, pending(["chat:c"], "3")) == [first]


def test_loads_count_what_was_routed_and_not_completed():
    router, replicas = make_router(max_ongoing=10)
    first = route(router, replicas, ["chat:a"], "1")
    done(router, first, "1")
    done(router, first, "1")  # Serve calls it for rejected requests too: never below what was routed
    done(router, first, "never-routed")
    assert router.load() == {"a": 0, "b": 0}
    route(router, replicas, [], "2")
    assert sum(router.load().values()) == 1 and router.stats.unkeyed == 1


def test_a_fan_out_goes_to_its_replica_only():
    router, replicas = make_router(max_ongoing=1)
    route(router, replicas, ["chat:a"], "1")
    route(router, replicas, ["chat:b"], "2")  # both full
    assert router.load() == {"a": 1, "b": 1}
    assert choose(router, replicas, pending([REPLICA_KEY + "b"], "3")) == ["b"]  # full does not apply
    assert choose(router, replicas, pending([REPLICA_KEY + "gone"], "4")) == []
