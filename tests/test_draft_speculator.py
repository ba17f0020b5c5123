"""draft-simple on tiny models: vocabulary checks, llama.cpp's draft semantics (greedy, p_min over
the full softmax, n_max, n_min), the unified draft context (one batched forward per draft step for
all sequences, no drift from the target after many rejections), exactness for concurrent
sequences, the CLI, and the batched propose hook of the chain."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from speculant import Batch, Draft, DraftLimits, DraftRequest, SequenceView, SpeculantError, hookimpl
from speculant.adaptive import PROBE_EVERY, PROBE_EVERY_MAX, DraftLengthController
from speculant.chain import SpeculatorChain
from speculant.engine import Engine, EngineConfig, SpecOverride
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model, write_tiny_pair
from speculant_draft import DraftSimple, vocab_mismatch

from toy_models import ToyModel

PROMPTS = [[1, 2, 3, 4, 5], [300, 301, 302], [7] * 12, [100, 200, 250, 120, 90, 80]]
SAMPLED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-pair")
    target_path, draft_path = write_tiny_pair(d, "qwen2")
    torch.set_num_threads(1)
    target = load_model(target_path, progress=False)
    torch.set_num_threads(1)
    return SimpleNamespace(target=target, target_path=target_path, draft_path=draft_path, dir=d)


def make(pair, **options) -> DraftSimple:
    return build_speculators(["draft-simple"], options, target=pair.target, draft_model=pair.draft_path)[0]


def plain(model, prompt, n, params=SamplingParams()):
    return list(Engine(model, EngineConfig(n_ctx=512)).generate(prompt, n, params))


def run_together(model, prompts, n, speculators, params=SamplingParams(), **config):
    engine = Engine(model, EngineConfig(n_ctx=512, **{"draft_n_max": 6, "adaptive": False, **config}), speculators)
    seqs = [engine.add(p, n, params) for p in prompts]
    while engine.active():
        engine.step()
    return engine, seqs


def fresh_logits(model, tokens):
    """The draft model's logits after `tokens`, computed from scratch (in chunks that keep the
    per-row attention path, so the arithmetic matches incremental decoding exactly)."""
    ctx = model.new_context(4096)
    out = None
    for start in range(0, len(tokens), 64):
        chunk = tokens[start : start + 64]
        out = model.forward(Batch.for_sequence(0, start, chunk, logits="last"), ctx).logits
    return out[0]


class Recorder:
    """Wraps a model to record every forward's batch."""

    def __init__(self, model):
        self.model, self.batches = model, []
        self.info, self.tokenizer = model.info, model.tokenizer

    def new_context(self, n):
        return self.model.new_context(n)

    def forward(self, batch, ctx, hidden_layers=()):
        self.batches.append(batch)
        return self.model.forward(batch, ctx, hidden_layers)


# --- vocabulary compatibility (llama.cpp's rules) -------------------------------------------------
def tok(n=300, vocab_type="bpe", add_bos=False, bos=11, add_eos=False, eos=12, texts=None):
    texts = texts or {}
    return SimpleNamespace(vocab_type=vocab_type, add_bos=add_bos, bos_id=bos, add_eos=add_eos, eos_id=eos, n_vocab=n,
                           token_text=lambda i: texts.get(i, f"t{i}"))


def test_vocab_rules():
    assert vocab_mismatch(tok(), tok()) is None
    assert "vocabulary types differ" in vocab_mismatch(tok(), tok(vocab_type="spm"))
    assert "BOS" in vocab_mismatch(tok(add_bos=True), tok(add_bos=False))
    assert "BOS" in vocab_mismatch(tok(add_bos=True, bos=1), tok(add_bos=True, bos=2))
    assert vocab_mismatch(tok(bos=1), tok(bos=2)) is None  # BOS not added: its id does not matter
    assert "EOS" in vocab_mismatch(tok(add_eos=True, eos=1), tok(add_eos=True, eos=2))
    assert vocab_mismatch(tok(eos=1), tok(eos=2)) is None
    assert vocab_mismatch(tok(n=300), tok(n=428)) is None  # sizes may differ by up to 128
    assert "differ by 129" in vocab_mismatch(tok(n=300), tok(n=429))
    assert vocab_mismatch(tok(texts={4: "x"}), tok()) is None  # ids below 5 are not compared
    assert "token 5 differs" in vocab_mismatch(tok(texts={5: "x"}), tok())
    assert "token 299 differs" in vocab_mismatch(tok(texts={299: "x"}), tok(n=400))


def test_draft_model_is_required_and_must_match(pair, tmp_path):
    with pytest.raises(SpeculantError, match="needs a draft model: pass -md"):
        build_speculators(["draft-simple"], {}, target=pair.target)
    spm = write_tiny_model(tmp_path / "spm.gguf", "qwen2", tokenizer="llama")
    with pytest.raises(SpeculantError, match="cannot draft for .*vocabulary types differ"):
        build_speculators(["draft-simple"], {}, target=pair.target, draft_model=spm)
    bigger = write_tiny_model(tmp_path / "big.gguf", "qwen2", n_vocab=700)
    with pytest.raises(SpeculantError, match="vocabulary sizes differ by 188"):
        build_speculators(["draft-simple"], {}, target=pair.target, draft_model=bigger)
    with pytest.raises(SpeculantError, match="absent.gguf"):
        build_speculators(["draft-simple"], {}, target=pair.target, draft_model=str(tmp_path / "absent.gguf"))


def test_draft_model_is_loaded_once(pair):
    assert make(pair).model is make(pair).model


# --- draft semantics -------------------------------------------------------------------------------
def greedy_path(model, prompt, n):
    """The draft model's own greedy continuation and, per token, its full-softmax probability and
    its probability renormalised over the top 10 (llama.cpp's measure)."""
    toks, full, top10 = [], [], []
    history = list(prompt)
    for _ in range(n):
        logits = fresh_logits(model, history)
        p = torch.softmax(logits.double(), -1)
        t = int(torch.argmax(logits))
        toks.append(t)
        full.append(float(p[t]))
        top10.append(float(p[t] / p.topk(10).values.sum()))
        history.append(t)
    return toks, full, top10


def test_greedy_n_max_p_min_n_min(pair):
    spec = make(pair)
    prompt = PROMPTS[3]
    toks, full, top10 = greedy_path(spec.model, prompt, 6)
    view = SequenceView(0, tuple(prompt), len(prompt))
    spec.begin(view)
    assert spec.propose(view, DraftLimits(n_max=6)).tokens == tuple(toks)  # greedy, p_min 0: the full n_max
    assert spec.propose(view, DraftLimits(n_max=2)).tokens == tuple(toks[:2])
    assert spec.propose(view, DraftLimits(n_max=3, n_min=3)).tokens == tuple(toks[:3])
    assert spec.propose(view, DraftLimits(n_max=3, n_min=4)) is None  # shorter than n_min: dropped
    # p_min stops at the first token below it, which is not kept; the measure is the full softmax
    j = min(range(1, 6), key=lambda i: full[i])
    p_min = full[j] * (1 + 1e-4)
    assert all(f >= p_min for f in full[:j])
    assert top10[j] > p_min  # a top-10 measure would have kept drafting: the test tells them apart
    assert spec.propose(view, DraftLimits(n_max=6, p_min=p_min)).tokens == tuple(toks[:j])
    assert spec.propose(view, DraftLimits(n_max=6, p_min=full[j] * (1 - 1e-4))).tokens[: j + 1] == tuple(toks[: j + 1])
    assert spec.propose(view, DraftLimits(n_max=6, p_min=p_min, n_min=j + 1)) is None
    assert spec.propose(view, DraftLimits(n_max=6, p_min=1.0)) is None
    assert spec.propose(view, DraftLimits(n_max=0)) is None


def test_sequence_not_begun_is_fed_whole(pair):
    spec = make(pair)
    prompt = PROMPTS[0]
    toks, _, _ = greedy_path(spec.model, prompt, 3)
    assert spec.propose(SequenceView(3, tuple(prompt), len(prompt)), DraftLimits(n_max=3)).tokens == tuple(toks)
    spec.end(3)
    assert 3 not in spec.seqs and spec.context.length(3) == 0


def test_one_batched_forward_per_draft_step(pair):
    spec = make(pair)
    rec = spec.model = Recorder(spec.model)
    views = [SequenceView(i, tuple(p), len(p)) for i, p in enumerate(PROMPTS)]
    for v in views:
        spec.begin(v)
    rec.batches.clear()
    n_max = [4, 2, 4, 3]
    drafts = spec.propose_batch([DraftRequest(v, DraftLimits(n_max=n)) for v, n in zip(views, n_max)])
    assert [len(d) for d in drafts] == n_max
    # 4 forwards (the longest draft), not 13; each holds the next row of every sequence still drafting
    assert [sorted(set(b.seq_ids)) for b in rec.batches] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 2]]
    assert all(len(b) == len(set(b.seq_ids)) for b in rec.batches)  # one row each: the prompts were fed by begin
    for v, d in zip(views, drafts):  # batching changes nothing: each equals its own greedy path
        assert list(d.tokens) == greedy_path(rec.model, v.tokens, len(d))[0]


# --- the unified draft context ------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_four_concurrent_sequences_equal_each_alone(pair, params):
    alone = [plain(pair.target, p, 40, params) for p in PROMPTS]
    alone_spec = [[*run_together(pair.target, [p], 40, [make(pair)], params)[1][0].tokens[len(p):]] for p in PROMPTS]
    engine, seqs = run_together(pair.target, PROMPTS, 40, [make(pair)], params)
    assert [s.tokens[s.n_prompt:] for s in seqs] == alone == alone_spec
    st = engine.spec_stats["draft-simple"]
    assert st.drafts > 0 and 0 < st.accepted < st.drafted and all(s.spec_error is None for s in seqs)


def test_no_drift_after_many_rejections(pair):
    spec = make(pair)
    rec = spec.model = Recorder(spec.model)
    prompts = [p * 3 for p in PROMPTS]
    engine, seqs = run_together(pair.target, prompts, 150, [spec], SAMPLED, draft_n_max=5)
    st = engine.spec_stats["draft-simple"]
    assert st.drafts > 100 and st.drafted - st.accepted > 200  # many rejected draft tokens
    assert [s.tokens[s.n_prompt:] for s in seqs] == [plain(pair.target, p, 150, SAMPLED) for p in prompts]
    # No re-prefill: the draft model saw each history token about once, plus its own draft tokens.
    fed = sum(len(b) for b in rec.batches)
    assert fed <= sum(len(s.tokens) for s in seqs) + st.produced
    for s in seqs:
        state = spec.seqs[s.seq_id]
        history = tuple(s.tokens)
        assert spec.context.length(s.seq_id) == len(state.fed)
        rows = spec._sync(s.seq_id, state, history)  # what the next draft step would feed
        assert len(rows) <= 3 and list(state.fed) == list(history[: len(state.fed)])
        got = rec.model.forward(Batch.for_sequence(s.seq_id, len(state.fed), list(rows), logits="last"), spec.context).logits[0]
        assert torch.equal(got, fresh_logits(rec.model, list(history)))


def test_chain_with_ngram_and_draft(pair):
    prompts = [p * 4 for p in PROMPTS]  # repetitive prompts: ngram-simple finds matches
    specs = build_speculators(["ngram-simple", "draft-simple"], {"spec_ngram_simple_size_n": 2}, target=pair.target,
                              draft_model=pair.draft_path)
    engine, seqs = run_together(pair.target, prompts, 60, specs)
    assert [s.tokens[s.n_prompt:] for s in seqs] == [plain(pair.target, p, 60) for p in prompts]
    assert engine.spec_stats["ngram-simple"].drafts > 0 and engine.spec_stats["draft-simple"].drafts > 0
    # per-request spec types: draft-simple alone, or nothing
    engine = Engine(pair.target, EngineConfig(n_ctx=512, adaptive=False), specs)
    only_draft = engine.add(prompts[0], 20, spec=SpecOverride(types=("draft-simple",)))
    none = engine.add(prompts[1], 20, spec=SpecOverride(types=()))
    while engine.active():
        engine.step()
    assert only_draft.stats.n_drafts > 0 and none.stats.n_drafts == 0
    assert only_draft.tokens[only_draft.n_prompt:] == plain(pair.target, prompts[0], 20)


def test_end_frees_the_sequence(pair):
    spec = make(pair)
    engine = Engine(pair.target, EngineConfig(n_ctx=512, adaptive=False), [spec])
    assert list(engine.generate(PROMPTS[0], 10)) == plain(pair.target, PROMPTS[0], 10)
    assert spec.seqs == {} and spec.context.seqs == {}


# --- command line -------------------------------------------------------------------------------------
def test_cli_generate_with_draft_model(pair, capsys):
    from speculant.cli import main

    base = ["generate", "--threads", "1", "-m", pair.target_path, "-p", "def add", "-n", "12"]
    assert main(base) == 0
    want = capsys.readouterr().out
    assert main([*base, "-md", pair.draft_path, "--spec-type", "draft-simple", "--draft-max", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == want and "drafted" in err
    assert main([*base, "--model-draft", pair.draft_path, "--spec-type", "ngram-simple,draft-simple"]) == 0
    assert capsys.readouterr().out == want


def test_cli_incompatible_draft_is_one_line_exit_2(pair, capsys, tmp_path):
    from speculant.cli import main

    spm = write_tiny_model(tmp_path / "spm.gguf", "qwen2", tokenizer="llama")
    base = ["--threads", "1", "-m", pair.target_path, "--spec-type", "draft-simple"]
    for argv in (["generate", *base, "-p", "x", "-md", spm], ["generate", *base, "-p", "x"],
                 ["generate", *base, "-p", "x", "-md", str(tmp_path / "absent.gguf")],
                 ["serve", *base, "--port", "0", "-md", spm]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("speculant: error:"), err


# --- the chain's batched proposals ------------------------------------------------------------------------
class Batched:
    """propose_batch: drafts [seq_id + 1] * k for sequences whose id is in `serves` (None otherwise)."""

    def __init__(self, name, serves, log, k=2, boom=False):
        self.spec_type, self.serves, self.log, self.k, self.boom = name, serves, log, k, boom

    @hookimpl
    def propose_batch(self, requests):
        self.log.append((self.spec_type, [r.seq.seq_id for r in requests]))
        if self.boom:
            raise RuntimeError("boom")
        return [Draft((r.seq.seq_id + 1,) * self.k, self.spec_type) if r.seq.seq_id in self.serves else None
                for r in requests]


class Single:
    def __init__(self, name, serves, log, empty=()):
        self.spec_type, self.serves, self.log, self.empty = name, serves, log, empty

    @hookimpl
    def propose(self, seq, limits):
        self.log.append((self.spec_type, seq.seq_id))
        if seq.seq_id in self.empty:
            return Draft((), self.spec_type)
        return Draft((9,) * 5, self.spec_type) if seq.seq_id in self.serves else None


def requests(n, n_max=4):
    return [DraftRequest(SequenceView(i, (1, 2, 3), 3), DraftLimits(n_max=n_max)) for i in range(n)]


def test_chain_batches_and_falls_through_per_sequence():
    log = []
    chain = SpeculatorChain([Batched("a", {0, 2}, log), Single("b", {1, 4}, log, empty={3}), Batched("c", {3, 4, 5}, log)])
    out = chain.propose_batch(requests(6, n_max=3))
    assert [p.draft.spec_type if p.draft else None for p in out] == ["a", "b", "a", None, "b", "c"]
    assert out[1].draft.tokens == (9, 9, 9)  # trimmed to n_max
    # each speculator is asked once for all sequences still without a draft, in chain order;
    # an empty draft (sequence 3 from b) ends the search for that sequence
    assert log == [("a", [0, 1, 2, 3, 4, 5]), ("b", 1), ("b", 3), ("b", 4), ("b", 5), ("c", [5])]
    assert [name for name, _, _ in out[5].costs] == ["a", "b", "c"] and out[0].costs[0][2] == 2
    assert chain.propose(SequenceView(4, (1,), 1), DraftLimits(n_max=2)).spec_type == "b"


def test_chain_batch_respects_only_plan_and_errors():
    log = []
    chain = SpeculatorChain([Batched("a", {0, 1, 2}, log, boom=True), Batched("b", {0, 1, 2}, log)])
    out = chain.propose_batch(requests(3), only=[("b",), None, ("b",)])
    assert log == [("a", [1]), ("b", [0, 2])]
    assert out[0].draft.spec_type == out[2].draft.spec_type == "b" and out[0].error is None
    assert out[1].draft is None and str(out[1].error) == "boom"  # only the failed call's sequences
    with pytest.raises(RuntimeError, match="boom"):
        chain.propose(SequenceView(1, (1,), 1), DraftLimits(n_max=2))
    log.clear()
    good = SpeculatorChain([Batched("a", {0, 1}, log), Batched("b", {0, 1}, log, k=3)])
    plan = lambda r, name: DraftLimits(n_max=0 if (name, r.seq.seq_id) == ("a", 1) else 2)
    out = good.propose_batch(requests(2), plan=plan)
    assert log == [("a", [0]), ("b", [1])] and [p.draft.tokens for p in out] == [(1, 1), (2, 2)]
    assert all(p.draft is None and not p.costs for p in good.propose_batch(requests(2, n_max=0)))  # none asked


# --- the cost model ------------------------------------------------------------------------------------
def test_controller_counts_draft_cost_of_calls_without_tokens():
    c = DraftLengthController()
    assert c.plan("x", 8) == 0  # nothing measured: one plain step first
    c.observe_forward(1, 0.010)
    c.observe_forward(5, 0.012)
    c.observe_forward(9, 0.014)
    for _ in range(20):
        c.observe_draft("x", 8, 8)
    assert c.plan("x", 8) == 4  # its cost is not known yet: a short first draft
    c.observe_cost("x", 9.0, 4)  # the sequence's first call fed its prompt: not what drafting costs
    assert "x" not in c.costs and c.plan("x", 8) == 4
    c.observe_cost("x", 0.004, 8)
    assert c.draft_cost("x") == pytest.approx(0.0005)
    assert c.plan("x", 8) == 8  # all accepted, cheap drafting: all of it
    c.observe_cost("x", 0.004, 0)  # a call that stopped before its first token still cost
    assert c.draft_cost("x") > 0.0005
    for _ in range(30):
        c.observe_cost("x", 0.050, 0)
    assert c.plan("x", 8) == 0 and c.best_length("x", 8) == 8  # too costly to draft; once drafted, verify
    # a costly speculator is probed more seldom than a cheap one: the probe's cost is budgeted
    interval = c.probe_interval("x")
    assert PROBE_EVERY < interval <= PROBE_EVERY_MAX
    declined = []
    while declined.count(2) < 4 and len(declined) < 3 * PROBE_EVERY_MAX:
        declined.append(c.plan("x", 8))
        if declined[-1]:
            before = c.costs["x"].seconds
            c.observe_cost("x", 5.0 if declined.count(2) % 2 == 1 else 0.05, 2)
            first_probe_call = declined.count(2) % 2 == 1
            assert (c.costs["x"].seconds == before) == first_probe_call
    # probed now and then: two drafts in a row, the first one's cost (catching up) not counted
    assert declined.index(2) == interval - 2 and declined[interval - 1] == 2  # (one declined above)
    assert declined.count(2) == 4 and set(declined) == {0, 2}
    assert c.catch_up["x"] == 5.0 and c.probe_interval("x") == PROBE_EVERY_MAX  # a 5 s catch-up: seldom


def test_controller_does_not_price_a_prompt_catch_up_as_drafting():
    """A hidden-state head writes a row per prompt token at its first call for a sequence: 0.4 s
    for a long prompt, then 2 ms a drafted token. Served, one request after another on one slot
    (the same sequence id), it must keep drafting: counted as drafting, the first call priced it
    at 0.1 s a token and it was declined for the rest of the session."""
    c = DraftLengthController()
    for rows in range(1, 6):
        c.observe_forward(rows, 0.050 + 0.004 * rows)
    drafted = []
    for request in range(3):
        first = True
        for _ in range(100):
            k = c.plan("head", 4, seq_id=0)
            drafted.append(k)
            if k:
                c.observe_cost("head", 0.4 if first else 0.002 * k, k, seq_id=0)
                first = False
                c.observe_draft("head", k, min(k, 2))  # the first two of every draft accepted
        c.forget(0)  # the request ended; the slot's next request is a new sequence
    assert drafted.count(0) <= 1 and min(drafted[1:]) >= 2
    assert c.draft_cost("head") == pytest.approx(0.002)


def test_controller_lengthens_drafts_that_are_always_accepted():
    """A speculator held to one-token drafts that are always accepted must be let to draft more:
    an untried position is estimated like the one before it, not like the pessimistic prior
    (which kept a 97%-accepted draft model at one token per step)."""
    c = DraftLengthController()
    c.observe_forward(1, 0.060)
    c.observe_forward(2, 0.070)
    c.observe_forward(4, 0.080)
    c.observe_cost("d", 1.0, 1)  # the first call catches up on the prompt (not counted)
    c.observe_cost("d", 0.030, 1)  # a draft model: half a target forward per token
    for _ in range(40):
        c.observe_draft("d", 1, 1)
    assert c.acceptance["d"].alpha(3) > 0.9
    assert c.plan("d", 8) >= 3
    for _ in range(60):  # now it is tried at length and fails after its first token: back to short
        c.observe_draft("d", 4, 1)
    assert c.plan("d", 8) <= 1


class SlowDrafter:
    """A costly speculator (`seconds` per call) whose drafts are the true continuation (or None)."""

    spec_type = "slow"

    def __init__(self, truth, seconds, none=False):
        self.truth, self.seconds, self.none, self.calls = truth, seconds, none, 0

    @hookimpl
    def begin(self, seq):
        self.n_prompt = seq.n_prompt

    @hookimpl
    def propose_batch(self, requests):
        self.calls += 1
        time.sleep(self.seconds)
        out = []
        for r in requests:
            done = len(r.seq) - self.n_prompt
            toks = tuple(self.truth[done : done + r.limits.n_max])
            out.append(None if self.none or not toks else Draft(toks, self.spec_type))
        return out


@pytest.mark.parametrize("none", [False, True], ids=["right-but-slow", "slow-and-empty"])
def test_costly_speculator_is_not_asked(none):
    prompt = [1, 2, 3]
    truth = plain(ToyModel(), prompt, 120)
    engine = Engine(ToyModel(), EngineConfig(n_ctx=512, draft_n_max=4), [spec := SlowDrafter(truth, 0.02, none)])
    steps = 0
    seq = engine.add(prompt, 120)
    while seq.finish_reason is None:
        engine.step()
        steps += 1
    assert seq.tokens[seq.n_prompt:] == truth[: seq.n_generated]
    # a toy forward takes well under a millisecond: 20 ms of drafting never pays, so after the
    # first measurements the speculator is only probed now and then
    assert spec.calls <= 4 + 2 * (steps // PROBE_EVERY) + 1
    assert engine.spec_stats["slow"].declined > steps // 2


# --- the server ------------------------------------------------------------------------------------------
def test_server_slots_share_the_draft_context(pair):
    import asyncio

    from test_server_util import aiotest, post, serve

    words = ["def add", "class Model", "hello world", "return total", "print(values)", "import os", "for i in", "x = 1"]
    bodies = [{"prompt": w, "n_predict": 12 + i, "temperature": 0} for i, w in enumerate(words)]
    spec = make(pair)

    @aiotest
    async def run():
        engine = Engine(pair.target, EngineConfig(n_ctx=256, adaptive=False), [spec])
        async with serve(engine, n_slots=4, draft_model=pair.draft_path) as c:
            alone = [await post(c, "/completion", b) for b in bodies]
            together = await asyncio.gather(*(post(c, "/completion", b) for b in bodies))
            props = await (await c.get("/props")).json()
            from speculant_server.app import STATE
            cache = c.server.app[STATE].worker.cache
            kept = {e.seq_id for e in cache.slots if e is not None} | set(cache.ram)
        return alone, together, props, kept

    alone, together, props, kept = run()
    assert [r[1]["content"] for r in together] == [r[1]["content"] for r in alone]
    assert all(r[0] == 200 and r[1]["timings"]["draft_n"] > 0 for r in together)
    want = [pair.target.tokenizer.decode(plain(pair.target, pair.target.tokenizer.encode(b["prompt"]), b["n_predict"]),
                                         skip_special=True) for b in bodies]
    assert [r[1]["content"] for r in alone] == want
    # a finished request's draft rows stay only while the server keeps its state (the prompt cache)
    assert set(spec.seqs) <= kept and set(spec.context.seqs) <= kept and len(kept) <= len(bodies)
    assert "draft_model" in str(props)
