"""Ray Serve pieces that need no cluster: a request's routing keys (affinity.py), /metrics put
together from the replicas' (ray_metrics.py), and `speculant serve --ray` without Ray."""
from __future__ import annotations

import json
import sys

from speculant_server.affinity import TEXT_BLOCK, TOKEN_BLOCK, affinity_keys


def keys(body, path="/v1/chat/completions", headers=None, method="POST"):
    return affinity_keys(method, path, headers or {}, json.dumps(body).encode())


def test_a_chat_turn_finds_the_previous_turn_by_its_longest_key():
    turn1 = [{"role": "system", "content": "be short"}, {"role": "user", "content": "write a loop"}]
    turn2 = turn1 + [{"role": "assistant", "content": "for i in range(3): pass"}, {"role": "user", "content": "again"}]
    k1, k2 = keys({"messages": turn1}), keys({"messages": turn2})
    assert len(k1) == 2 and len(k2) == 4  # one per message prefix, longest first
    assert k2[2] == k1[0]  # turn 2's prefix of turn 1's length is the key turn 1 recorded
    assert k2[3] == k1[1]
    other = keys({"messages": [turn1[0], {"role": "user", "content": "write a function"}]})
    assert other[-1] == k1[-1] and other[0] != k1[0]  # same system prompt, another conversation


def test_explicit_session_and_user_take_precedence():
    body = {"messages": [{"role": "user", "content": "hi"}], "user": "alice"}
    assert keys(body) == ["user:alice"]
    assert keys(body, headers={"X-Session-Id": "s1"}) == ["session:s1"]
    assert keys({}, path="/health", method="GET", headers={"x-session-id": "s2"}) == ["session:s2"]


def test_text_and_token_prompts_are_keyed_by_blocks():
    short = "x" * (TEXT_BLOCK - 1)
    assert keys({"prompt": short}, path="/v1/completions") == []  # shorter than a block: cheap anywhere
    long1 = "".join(chr(97 + i % 26) for i in range(3 * TEXT_BLOCK + 10))
    k1 = keys({"prompt": long1}, path="/completion")
    k2 = keys({"prompt": long1 + " and more text" * 40}, path="/completion")
    assert len(k1) == 3 and k1[0] in k2
    t = keys({"prompt": list(range(2 * TOKEN_BLOCK + 5))}, path="/v1/completions")
    assert len(t) == 2 and all(k.startswith("tokens:") for k in t)


def test_requests_without_a_conversation_have_no_keys():
    assert affinity_keys("GET", "/v1/models", {}, b"") == []
    assert affinity_keys("POST", "/v1/chat/completions", {}, b"{not json") == []
    assert affinity_keys("POST", "/tokenize", {}, json.dumps({"content": "x" * 999}).encode()) == []
    assert keys([1, 2]) == []


def replica_metrics(finished, prompt_tokens, prompt_seconds, n_tokens_max, drafts) -> str:
    """A replica's /metrics text, written as metrics.py writes it (prometheus_client's families)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    p = "speculant:"
    drafted = CounterMetricFamily(p + "spec_decode_num_drafts", "Drafts.", labels=["spec_type"])
    drafted.add_metric(["ngram-simple"], drafts)
    fams = [CounterMetricFamily(p + "requests_finished", "Finished.", value=finished),
            CounterMetricFamily(p + "prompt_tokens", "Prompt tokens.", value=prompt_tokens),
            CounterMetricFamily(p + "prompt_seconds", "Prompt time.", value=prompt_seconds),
            GaugeMetricFamily(p + "prompt_tokens_seconds", "Average.", value=prompt_tokens / prompt_seconds),
            GaugeMetricFamily(p + "n_tokens_max", "Largest.", value=n_tokens_max), drafted]

    class Fixed:
        def collect(self):
            return fams

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry).decode()


def test_metrics_add_up_and_averages_are_recomputed():
    from prometheus_client.parser import text_string_to_metric_families

    from speculant_server.ray_metrics import IngressStats, aggregate

    stats = IngressStats(replica_deaths=1)
    stats.observe_routing(0.003)
    texts = [replica_metrics(3, 100, 1.0, 50, 4), replica_metrics(5, 300, 1.0, 70, 6)]
    text = aggregate(texts, stats, None, 2).decode()
    got = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("speculant:requests_finished_total", ())] == 8
    assert got[("speculant:prompt_tokens_seconds", ())] == 200  # 400 tokens in 2 s, not a mean of the means
    assert got[("speculant:n_tokens_max", ())] == 70
    assert got[("speculant:spec_decode_num_drafts_total", (("spec_type", "ngram-simple"),))] == 10
    assert got[("speculant:ray_replicas", ())] == 2
    assert got[("speculant:ray_replica_deaths_total", ())] == 1
    assert got[("speculant:ray_first_answer_seconds_count", ())] == 1


def test_serve_ray_without_ray_is_one_line(capsys, monkeypatch, tmp_path):
    from speculant_server.cli import main as serve_main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as without the extra
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert serve_main(["-m", str(model), "--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculant[ray]" in err[0]


def test_slot_files_do_not_go_with_ray(capsys, tmp_path):
    from speculant_server.cli import main as serve_main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert serve_main(["-m", str(model), "--ray", "--slot-save-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slot-save-path" in err[0]


def test_serve_run_builder_takes_serve_flags(tmp_path):
    import pytest

    from speculant.errors import SpeculantError

    serve = pytest.importorskip("ray.serve", reason="the [ray] extra (in [dev]) is not installed")
    from speculant_server.ray_app import app_builder

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # binding does not load it: the replicas do
    assert isinstance(app_builder({"flags": f"-m {model} --ray-replicas 3 -np 2"}), serve.Application)
    with pytest.raises(SpeculantError, match="no such file"):
        app_builder({"flags": f"-m {tmp_path / 'absent.gguf'}"})
