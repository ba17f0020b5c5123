"""/metrics through Ray Serve: every replica's metrics put together, plus the ingress's own.

Each replica exports metrics.py's families; the ingress fetches them all and writes one set, so
a dashboard reads the deployment as it reads one server. Counters and counts add up; the
largest-value gauges take the largest; the averages are computed again from the summed counters
(a mean of means would weigh an idle replica as much as a busy one). The ingress adds its
routing counters (``speculant:ray_*``): how many keyed requests found their conversation's
replica, and how many died under a request.
"""
from __future__ import annotations

from collections import defaultdict

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

P = "speculant:"
LARGEST = {P + "n_tokens_max", P + "spec_quarantined"}
# gauge -> (numerator counter, denominator counter), each summed over the replicas
RATIOS = {P + "prompt_tokens_seconds": (P + "prompt_tokens", P + "prompt_seconds"),
          P + "predicted_tokens_seconds": (P + "tokens_predicted", P + "tokens_predicted_seconds")}
WEIGHTED = {P + "n_busy_slots_per_decode": P + "n_decode"}  # gauge -> the counter that weighs each replica's value
ROUTING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.define
class IngressStats:
    replica_deaths: int = 0  # requests whose replica died under them (each retry counts again)
    failed: int = 0  # requests that got an error for it (retries ran out, a stream was cut) or a broken relay
    rejected: int = 0  # requests refused because every replica's queue was full
    # time from a request's arrival at the ingress to its replica's first answer (status and headers):
    # routing, the hop to the replica, and for a non-streamed request the whole generation
    routing_counts: list[int] = attrs.field(factory=lambda: [0] * (len(ROUTING_BUCKETS) + 1))
    routing_sum: float = 0.0

    def observe_routing(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(ROUTING_BUCKETS) if seconds <= b), len(ROUTING_BUCKETS))
        self.routing_counts[i] += 1
        self.routing_sum += seconds


def aggregate(texts: list[str], ingress: IngressStats | None = None, routing=None, n_replicas: int | None = None,
              load: dict[str, int] | None = None) -> bytes:
    """Prometheus text for the replicas' `texts` together, with the ingress's counters."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), in first-seen order
    values: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for text in texts:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, (fam.type, fam.documentation))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                values[fam.name][tuple(sorted(s.labels.items()))].append(s.value)

    def total(name: str) -> float:
        return sum(sum(v) for v in values.get(name, {}).values())

    def weighted(name: str, weight: str) -> float:
        # each replica's value by its weight, in the order the texts came (one sample each)
        per_replica = values[name].get((), [])
        weights = values.get(weight, {}).get((), [])
        if len(weights) != len(per_replica) or not sum(weights):
            return sum(per_replica) / len(per_replica) if per_replica else 0.0
        return sum(v * w for v, w in zip(per_replica, weights)) / sum(weights)

    out = []
    for name, (kind, doc) in families.items():
        labels = sorted({k for key in values[name] for k, _ in key})
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
        for key, vs in values[name].items():
            if name in LARGEST:
                v = max(vs)
            elif name in RATIOS:
                num, den = (total(n) for n in RATIOS[name])
                v = num / den if den else 0.0
            elif name in WEIGHTED:
                v = weighted(name, WEIGHTED[name])
            else:
                v = sum(vs)
            fam.add_metric([dict(key).get(k, "") for k in labels], v)
        out.append(fam)
    out.extend(_ingress_families(ingress, routing, n_replicas, load))

    class Fixed:
        def collect(self):
            return out

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry)


def _ingress_families(ingress: IngressStats | None, routing, n_replicas: int | None, load: dict[str, int] | None):
    if n_replicas is not None:
        yield GaugeMetricFamily(P + "ray_replicas", "Engine replicas that answered this scrape.", value=n_replicas)
    if routing is not None and load is not None:
        gauge = GaugeMetricFamily(P + "ray_replica_load", "Requests the router sent to a replica that have not "
                                  "completed (what it balances new conversations by).", labels=["replica"])
        for replica, n in sorted(load.items()):
            gauge.add_metric([replica], n)
        yield gauge
    if routing is not None:
        fam = CounterMetricFamily(P + "ray_routed", "Requests routed, by how their conversation's replica was found: hit "
                                  "(the replica that served it before), spill (that one was full), moved (that one is gone), "
                                  "new (no turn seen before), unkeyed (no conversation).", labels=["outcome"])
        for label, field in (("hit", "hits"), ("spill", "spills"), ("moved", "moved"), ("new", "new"), ("unkeyed", "unkeyed")):
            fam.add_metric([label], getattr(routing, field))
        yield fam
    if ingress is not None:
        yield CounterMetricFamily(P + "ray_replica_deaths", "Requests whose replica died under them (each attempt).",
                                  value=ingress.replica_deaths)
        yield CounterMetricFamily(P + "ray_requests_failed", "Requests the ingress answered with an error: their "
                                  "replica died (retries spent, or a stream cut) or could not relay.", value=ingress.failed)
        yield CounterMetricFamily(P + "ray_requests_rejected", "Requests refused: every replica's queue was full.",
                                  value=ingress.rejected)
        buckets, acc = [], 0
        for bound, n in zip([*map(str, ROUTING_BUCKETS), "+Inf"], ingress.routing_counts):
            acc += n
            buckets.append((bound, acc))
        yield HistogramMetricFamily(P + "ray_first_answer_seconds", "Seconds from a request's arrival at the ingress to "
                                    "its replica's status line (a streamed request: routing and the first chunk; "
                                    "a whole answer: its generation too).", buckets=buckets, sum_value=ingress.routing_sum)
