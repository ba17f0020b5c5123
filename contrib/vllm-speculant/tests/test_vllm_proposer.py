"""The vLLM proposer driven as vLLM 0.33.0's model runner drives a custom_class proposer
(vllm_standin: rows that move, chunked prefill, drafts cut by the scheduler, requests that come
and go), against the same speculator driven standalone through its hooks."""
from __future__ import annotations

import random

import numpy as np
import pytest

from speculant import Draft, DraftLimits, SequenceView, SpeculantError, hookimpl
from speculant.speculator import build_speculators
from speculant.testing.driver import script, segment_pool

import vllm_speculant
from vllm_speculant import SpeculantProposer
from vllm_speculant.chain import Chain
from vllm_standin import Request, Runner, vllm_config

K = 6  # num_speculative_tokens
MAX_LEN = 256
# Options that make each type draft on these short, repetitive texts (see the contract suite's
# contract_options); passed exactly as a vLLM user passes them, in $SPECULANT_VLLM_ARGS.
ARGS = {
    "suffix": "",
    "ngram-simple": "--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8",
    "ngram-map-k": "--spec-ngram-map-k-size-n 2 --spec-ngram-map-k-size-m 8",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-n 2 --spec-ngram-map-k4v-size-m 8",
    "ngram-mod": "--spec-ngram-mod-n-match 4 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 8",
}
CLASSES = {"suffix": vllm_speculant.Suffix, "ngram-simple": vllm_speculant.NgramSimple,
           "ngram-map-k": vllm_speculant.NgramMapK, "ngram-map-k4v": vllm_speculant.NgramMapK4v,
           "ngram-mod": vllm_speculant.NgramMod}


class Standalone:
    """The reference: a speculator of the same type and options, its hooks called directly with
    one sequence per request, in the order of the engine's accept bookkeeping."""

    def __init__(self, spec_type: str):
        from vllm_speculant.options import parse

        self.spec = build_speculators([spec_type], parse((spec_type,), ARGS[spec_type]).values)[0]
        self.ids: dict[str, int] = {}
        self.next_id = 0  # never reused: ngram-map-k keeps a reused id's map, as llama.cpp a slot's
        self.drafts: dict[str, Draft | None] = {}

    def _call(self, name, **kw):
        fn = getattr(self.spec, name, None)
        if fn is not None and getattr(fn, "speculant_impl", None) is not None:
            import inspect

            return fn(**{k: v for k, v in kw.items() if k in inspect.signature(fn).parameters})
        return None

    def step(self, requests: list[Request], sampled: dict[str, list[int]], finished: list[str]) -> dict[str, list[int]]:
        views = {}
        for r in requests:
            s = sampled.get(r.req_id)
            if not s:
                continue
            tokens = tuple(r.tokens)
            if r.req_id not in self.ids:
                self.ids[r.req_id], self.next_id = self.next_id, self.next_id + 1
                self._call("begin", seq=SequenceView(self.ids[r.req_id], tokens[: len(tokens) - len(s)], len(r.prompt)))
                self.drafts[r.req_id] = None
            view = SequenceView(self.ids[r.req_id], tokens, len(r.prompt))
            d, k = self.drafts[r.req_id], len(s) - 1
            ok = d is not None and k <= len(d) and tuple(s[:k]) == d.tokens[:k]
            self._call("accept", seq=view, draft=d if ok else None, n_accepted=k if ok else 0, hidden={},
                       hidden_start=len(tokens))
            views[r.req_id] = view
        for req_id in finished:
            self._call("end", seq_id=self.ids.pop(req_id))
        out = {r.req_id: [] for r in requests}  # a row in prefill gets no draft
        for req_id, view in views.items():
            n_max = min(K, MAX_LEN - len(view.tokens) - 1)
            d = self._call("propose", seq=view, limits=DraftLimits(n_max=n_max))
            d = None if d is None or len(d) == 0 else Draft(tuple(d.tokens[:n_max]), d.spec_type)
            self.drafts[req_id] = d
            out[req_id] = [] if d is None else list(d.tokens)
        return out


def workload(seed: int, n: int = 10):
    """Requests over a shared pool of segments (so outputs repeat each other, which suffix's
    shared index learns from once a request ends), arriving over time, some with a prompt in two
    prefill chunks, two with the same prompt and script (n > 1 samples)."""
    rng = random.Random(seed)
    alphabet = list(range(3, 300))
    pool = segment_pool(rng, alphabet, n=6)
    reqs = []
    for i in range(n):
        text = script(rng, pool, 160, alphabet)
        p = rng.randint(12, 40)
        reqs.append((rng.randint(0, 12), Request(f"req-{i}", text[:p], text, rng.randint(20, 60), chunks=1 + (i % 3 == 0))))
    twin_text = script(rng, pool, 160, alphabet)
    for j in range(2):
        reqs.append((5, Request(f"twin-{j}", twin_text[:20], twin_text, 40)))
    return reqs


def run(spec_type: str, seed: int, cut=None, monkeypatch=None):
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", ARGS[spec_type])
    proposer = CLASSES[spec_type](vllm_config(K, MAX_LEN))
    runner = Runner(proposer, max_num_reqs=8, max_model_len=MAX_LEN, cut=cut)
    ref = Standalone(spec_type)
    arrivals = workload(seed)
    waiting = sorted(arrivals, key=lambda a: a[0])
    log = []
    step = 0
    while waiting or runner.active():
        ready = []
        while waiting and waiting[0][0] <= step and len([r for r in runner.rows if r and not r.finished]) + len(ready) < 8:
            ready.append(waiting.pop(0)[1])
        finished = [r.req_id for r in runner.rows if r is not None and r.finished]
        before = {r.req_id: len(r.output) for r in runner.rows if r is not None and not r.finished}
        before.update({r.req_id: 0 for r in ready})
        got = runner.step(ready)
        live = [r for r in runner.rows]
        sampled = {r.req_id: r.output[before[r.req_id]:] for r in live}
        want = ref.step(live, sampled, finished)
        assert got == want, f"step {step}: vLLM proposer {got} vs standalone {want}"
        # state follows the accepted tokens: one sequence per request in the batch, holding its history
        assert proposer.request_count() == sum(1 for r in live if sampled[r.req_id])
        held = sorted(s.tokens for s in proposer.rows.seqs.values())
        assert held == sorted(tuple(r.tokens) for r in live if sampled[r.req_id])
        log.extend(d for d in got.values() if d)
        step += 1
    runner.step([])  # the last requests leave the batch: the next propose frees them
    assert proposer.request_count() == 0
    return proposer, log


@pytest.mark.parametrize("spec_type", sorted(ARGS))
def test_drafts_equal_the_standalone_speculator(spec_type, monkeypatch):
    proposer, drafts = run(spec_type, seed=1, monkeypatch=monkeypatch)
    assert len(drafts) >= 10, "the workload must make it draft, or the comparison checks nothing"
    assert all(len(d) <= K for d in drafts)


@pytest.mark.parametrize("spec_type", ["suffix", "ngram-map-k"])
def test_drafts_cut_by_the_scheduler(spec_type, monkeypatch):
    """vLLM may schedule fewer spec tokens than proposed; acceptance is then within the cut."""
    run(spec_type, seed=2, cut=lambda r, d: len(d) // 2, monkeypatch=monkeypatch)


def test_finished_requests_are_freed_in_the_speculator(monkeypatch):
    proposer, _ = run("suffix", seed=3, monkeypatch=monkeypatch)
    suffix = proposer.chain.speculators[0]
    assert suffix.seqs == {}  # every request's own index ended
    assert len(suffix.global_index) > 0  # and its output joined the shared index, as on `end`


def test_warm_up_call_and_rows_without_samples(monkeypatch):
    """ngram_proposer.py:55-60 warms up with 1024 empty rows; a custom proposer must take the same."""
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", "")
    p = vllm_speculant.Suffix(vllm_config(K, MAX_LEN))
    out = p.propose([[]] * 1024, np.zeros(1024, dtype=np.int32), np.zeros((1024, MAX_LEN), dtype=np.int32))
    assert out == [[]] * 1024 and p.request_count() == 0
    p.load_model(object())  # gpu_model_runner.py:5011 hands it the target model


def test_context_end_caps_the_draft(monkeypatch):
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", "")
    p = vllm_speculant.Suffix(vllm_config(K, 24))
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    tok = np.zeros((1, 24), dtype=np.int32)
    for n, cap in ((20, 3), (23, 0)):  # max_model_len - n - 1 tokens fit
        tok[0, :n] = text[:n]
        out = p.propose([[text[n - 1]]], np.array([n], dtype=np.int32), tok)
        assert len(out[0]) == cap


def test_generic_class_takes_the_types_from_the_flags(monkeypatch):
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", "--spec-type suffix,ngram-simple --spec-suffix-max-depth 16")
    p = SpeculantProposer(vllm_config(K, MAX_LEN))
    assert [s.spec_type for s in p.chain.speculators] == ["suffix", "ngram-simple"]
    assert p.chain.speculators[0].max_depth == 16


@pytest.mark.parametrize("args, cls, match", [
    ("", SpeculantProposer, "no spec type"),
    ("--spec-type nosuch", SpeculantProposer, "unknown spec type 'nosuch'"),
    ("--spec-suffix-max-depht 3", vllm_speculant.Suffix, "unrecognized arguments"),
    ("--spec-type ngram-simple", vllm_speculant.Suffix, "stands for suffix"),
    ("--spec-type eagle3", SpeculantProposer, "token-only"),
    ("--spec-type draft-simple", SpeculantProposer, "token-only"),
])
def test_bad_configuration_is_an_error_at_construction(args, cls, match, monkeypatch):
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", args)
    with pytest.raises(SpeculantError, match=match):
        cls(vllm_config(K, MAX_LEN))


def test_vllm_plugin_hook_checks_the_flags_at_start_up(monkeypatch):
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_speculant")]
    register = ep.load()
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", "--spec-suffix-max-depth 16")
    register()  # options without a type: a named class supplies it
    monkeypatch.setenv("SPECULANT_VLLM_ARGS", "--spec-suffix-max-depth x")
    with pytest.raises(SpeculantError, match="max-depth"):
        register()


def test_a_failing_speculator_costs_only_its_sequences():
    class Flaky:
        spec_type = "flaky"

        @hookimpl
        def propose(self, seq, limits):
            if seq.seq_id == 1:
                raise RuntimeError("boom")
            return Draft((1, 2, 3), self.spec_type)

    class Backup:
        spec_type = "backup"

        @hookimpl
        def propose(self, seq, limits):
            return Draft((9,), self.spec_type)

    from speculant import DraftRequest

    chain = Chain([Flaky(), Backup()])
    reqs = [DraftRequest(SequenceView(i, (4, 5), 2), DraftLimits(n_max=2)) for i in range(3)]
    out = chain.propose(reqs)
    assert [None if d is None else d.tokens for d in out] == [(1, 2), None, (1, 2)]
    assert chain.off == {1}
    assert chain.propose(reqs)[1] is None  # off for good, until the sequence ends
    chain.end(1)
    assert chain.off == set()


def test_imports_without_vllm():
    """vLLM is an optional extra: the package, the proposer and the exporter never import it."""
    import subprocess
    import sys

    code = ("import sys, vllm_speculant, vllm_speculant.plugin, vllm_speculant.export, vllm_speculant.eagle3_export, "
            "vllm_speculant.dflash_export, vllm_speculant.command; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rows_with_the_same_length_and_tail_are_told_apart():
    """Rows are looked up by (length, last tokens) and verified whole: two histories that share
    both still go to their own sequences, and a row that only shares them starts a new one."""
    from vllm_speculant.rows import Rows

    rows = Rows()
    a = np.array([1, 2, 3, 7, 8, 9, 10], dtype=np.int32)
    b = np.array([4, 5, 6, 7, 8, 9, 10], dtype=np.int32)
    sa, _ = rows.match(a[:6], 1)
    sb, _ = rows.match(b[:6], 1)
    assert rows.finish() == []
    # next step, in the other order: each row continues its own history
    assert rows.match(np.append(b[:6], 11), 1) == (sb, False)
    assert rows.match(np.append(a[:6], 12), 1) == (sa, False)
    rows.finish()
    c = np.array([0, 2, 3, 7, 8, 9, 11, 13], dtype=np.int32)  # length and tail of b's history, not b
    sc, new = rows.match(c, 1)
    assert new and sc.tokens == tuple(c.tolist()) and sc.n_prompt == 7
    assert sorted(rows.finish()) == sorted([sa.seq_id, sb.seq_id])
