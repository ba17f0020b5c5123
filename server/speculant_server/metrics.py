"""/metrics: Prometheus text from prometheus_client, named after llama-server's (``llamacpp:`` becomes
``speculant:``), plus per-spec-type speculation counters with a ``spec_type`` label.

The speculation counters (drafts, drafted tokens, accepted tokens, accepted tokens per draft
position) are always exported for every spec type the server runs, zero until used; they follow
the engine's per-spec-type totals, updated after every engine step.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "speculant:"


class ServerCollector:
    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        w, t = self.worker, self.worker.totals
        p = PREFIX

        def counter(name, doc, value):
            return CounterMetricFamily(p + name, doc, value=value)

        def gauge(name, doc, value):
            return GaugeMetricFamily(p + name, doc, value=value)

        yield counter("prompt_tokens", "Number of prompt tokens processed.", t.prompt_tokens)
        yield counter("prompt_tokens_cached", "Number of prompt tokens taken from the prompt cache instead of processed.",
                      t.prompt_tokens_cached)
        yield counter("prompt_seconds", "Prompt process time.", t.prompt_seconds)
        yield counter("tokens_predicted", "Number of generation tokens processed.", t.predicted_tokens)
        yield counter("tokens_predicted_seconds", "Predict process time.", t.predicted_seconds)
        yield counter("n_decode", "Total number of engine steps (one batched target forward each).", t.n_decode)
        yield counter("requests_finished", "Requests that completed.", t.requests_finished)
        yield counter("requests_cancelled", "Requests cancelled because the client went away.", t.requests_cancelled)
        yield counter("requests_failed", "Requests that failed inside the engine.", t.requests_failed)
        yield gauge("n_busy_slots_per_decode", "Average number of busy slots per engine step.",
                    t.busy_slots / t.n_decode if t.n_decode else 0.0)
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0)
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                    t.predicted_tokens / t.predicted_seconds if t.predicted_seconds else 0.0)
        yield gauge("requests_processing", "Number of requests processing.", w.n_processing())
        yield gauge("requests_deferred", "Number of requests waiting for a slot.", w.n_waiting())
        yield gauge("n_tokens_max", "Largest observed n_tokens (prompt plus generated) of one sequence.", t.n_tokens_max)

        names = list(dict.fromkeys([*w.spec_types, *t.spec]))
        drafts = CounterMetricFamily(p + "spec_decode_num_drafts", "Number of drafts verified, by spec type.", labels=["spec_type"])
        drafted = CounterMetricFamily(p + "spec_decode_num_draft_tokens", "Number of draft tokens verified, by spec type.",
                                      labels=["spec_type"])
        accepted = CounterMetricFamily(p + "spec_decode_num_accepted_tokens", "Number of draft tokens accepted, by spec type.",
                                       labels=["spec_type"])
        declined = CounterMetricFamily(p + "spec_decode_num_declined_drafts",
                                       "Times the adaptive draft length let a spec type draft nothing (it would not pay), by spec type.",
                                       labels=["spec_type"])
        per_pos = CounterMetricFamily(p + "spec_decode_num_accepted_tokens_per_pos",
                                      "Number of drafts whose token at this position was accepted, by spec type.",
                                      labels=["spec_type", "position"])
        for name in names:
            s = t.spec.get(name)
            drafts.add_metric([name], s.drafts if s else 0)
            drafted.add_metric([name], s.drafted if s else 0)
            accepted.add_metric([name], s.accepted if s else 0)
            declined.add_metric([name], s.declined if s else 0)
            for i, n in enumerate(s.accepted_at if s else ()):
                per_pos.add_metric([name, str(i)], n)
        yield from (drafts, drafted, accepted, declined, per_pos)
        # A speculator whose call did not return in time is quarantined: worth an alert, since
        # its sequences decode without it until it is revived (--spec-revive) or the server restarts.
        quarantined = GaugeMetricFamily(p + "spec_quarantined", "1 for a spec type quarantined after a call that did "
                                        "not return within --spec-deadline (until revived or restarted), else 0.", labels=["spec_type"])
        gone = w.engine.chain.quarantined
        for name in w.spec_types:
            quarantined.add_metric([name], 1.0 if name in gone else 0.0)
        yield quarantined
        if w.engine.recurrent:  # a hybrid target: cut-backs to a verification row's state versus checkpoint replays
            r = w.engine.recurrent_stats
            yield counter("recurrent_rollbacks", "Partial acceptances cut back to a kept verification row's state.", r.rollbacks)
            yield counter("recurrent_replays", "Partial acceptances that restored a checkpoint and fed the kept tokens again.", r.replays)
            yield counter("recurrent_replayed_rows", "Rows computed again after checkpoint restores.", r.replayed_rows)
            yield counter("recurrent_checkpoint_seconds", "Seconds spent saving and restoring recurrent-state checkpoints.", r.checkpoint_seconds)


def make_registry(worker) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(worker))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
