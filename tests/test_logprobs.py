"""Log-probabilities with speculation equal plain decoding's, and n sequences sharing one prompt.

A token's logprob is the log-softmax of the target's raw logits at the row that produced it: the
verification forward's row for a drafted token or the correction/bonus token, the one decode row
otherwise. Rows compute alike whatever their batch (docs/architecture.md, "Exactness"), so the
values are equal bit for bit, not within a tolerance.
"""
from types import SimpleNamespace

import pytest
import torch

from speculant import Batch, Draft, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_pair

from toy_models import N_VOCAB, ToyModel

SAMPLED = SamplingParams(temperature=0.3, top_k=20, top_p=0.95, min_p=0.02, seed=11)
PARAMS = [SamplingParams(), SAMPLED]


def run(model, prompts, n, params, speculators=(), logprobs=5, **config):
    engine = Engine(model, EngineConfig(**{"n_ctx": 512, "draft_n_max": 6, "adaptive": False, **config}), list(speculators))
    seqs = [engine.add(p, n, params, logprobs=logprobs) for p in prompts]
    while engine.active():
        engine.step()
    return engine, seqs


def assert_same(got, want):
    """Tokens, logprobs and top-k (ids and values) equal, bit for bit."""
    assert got.tokens == want.tokens
    assert len(got.logprobs) == len(want.logprobs) == got.n_generated
    for a, b in zip(got.logprobs, want.logprobs):
        assert a == b, (a, b)


# --- toy model ------------------------------------------------------------------------------------
class Oracle:
    """Drafts the true continuation with every third token wrong."""

    spec_type = "oracle"

    def __init__(self, truth, probs=False):
        self.truth, self.probs = truth, probs

    @hookimpl
    def begin(self, seq):
        self.n_prompt = seq.n_prompt

    @hookimpl
    def propose(self, seq, limits):
        done = len(seq) - self.n_prompt
        toks = list(self.truth[done : done + min(4, limits.n_max)])
        for i in range(len(toks)):
            if (done + i) % 3 == 2:
                toks[i] = (toks[i] + 1) % N_VOCAB
        if not toks:
            return None
        probs = None
        if self.probs:  # a flat-ish draft distribution, so rejection sampling runs
            probs = torch.full((len(toks), N_VOCAB), 0.5 / (N_VOCAB - 1))
            for i, t in enumerate(toks):
                probs[i, t] = 0.5
        return Draft(tuple(toks), self.spec_type, probs)


def teacher_forced(model, prompt, tokens, k):
    """log-softmax of the target's logits before each of `tokens`, one row at a time."""
    ctx = model.new_context(512)
    out = model.forward(Batch.for_sequence(0, 0, prompt, logits="last"), ctx).logits[0]
    rows = [out]
    for i, t in enumerate(tokens[:-1]):
        rows.append(model.forward(Batch.for_sequence(0, len(prompt) + i, [t], logits="last"), ctx).logits[0])
    lps = [torch.log_softmax(r, -1) for r in rows]
    return [(float(lp[t]), torch.topk(lp, k).indices.tolist()) for lp, t in zip(lps, tokens)]


@pytest.mark.parametrize("params", PARAMS)
def test_toy_speculation_gives_plain_logprobs(params):
    prompt = [1, 2, 3, 4, 5]
    _, (want,) = run(ToyModel(), [prompt], 40, params)
    truth = want.tokens[want.n_prompt:]
    engine, (got,) = run(ToyModel(), [prompt], 40, params, [Oracle(truth)])
    assert got.stats.n_drafts > 0 and got.stats.n_accepted > 0
    assert_same(got, want)
    assert [t.token for t in got.logprobs] == truth
    assert all(len(t.top) == 5 and t.top[0][1] >= t.top[-1][1] for t in got.logprobs)


def test_rejection_sampling_logprobs_are_the_targets():
    """Drafts with probabilities (rejection sampling): other tokens than plain decoding's, but
    each one's logprob is the target's at its row, accepted or resampled."""
    prompt = [3, 1, 4, 1, 5]
    _, (want,) = run(ToyModel(), [prompt], 40, SAMPLED)
    model = ToyModel()
    _, (got,) = run(model, [prompt], 40, SAMPLED, [Oracle(want.tokens[want.n_prompt:], probs=True)])
    assert got.stats.n_drafts > 0
    generated = got.tokens[got.n_prompt:]
    assert [t.token for t in got.logprobs] == generated
    for t, (lp, top) in zip(got.logprobs, teacher_forced(ToyModel(), prompt, generated, 5)):
        assert t.logprob == lp and sorted(i for i, _ in t.top) == sorted(top)


def test_no_logprobs_unless_asked():
    _, (seq,) = run(ToyModel(), [[1, 2, 3]], 10, SamplingParams(), logprobs=None)
    assert seq.logprobs == []
    _, (seq,) = run(ToyModel(), [[1, 2, 3]], 10, SamplingParams(), logprobs=0)
    assert len(seq.logprobs) == 10 and all(t.top == () for t in seq.logprobs)


# --- the tiny GGUF model on the CPU backend, with ngram-simple and draft-simple -----------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs-pair")
    target_path, draft_path = write_tiny_pair(d, "qwen2")
    target = load_model(target_path, progress=False)
    torch.set_num_threads(1)
    return SimpleNamespace(target=target, draft_path=draft_path)


PROMPTS = [[1, 2, 3, 4, 5] * 4, [300, 301, 302] * 5, [7] * 12, list(range(100, 180))]  # the last over 64 tokens


@pytest.mark.parametrize("spec_types", [["ngram-simple"], ["ngram-simple", "draft-simple"]])
@pytest.mark.parametrize("params", PARAMS)
def test_tiny_gguf_speculation_gives_plain_logprobs(pair, spec_types, params):
    _, want = run(pair.target, PROMPTS, 40, params)
    specs = build_speculators(spec_types, {"spec_ngram_simple_size_n": 2}, target=pair.target, draft_model=pair.draft_path)
    engine, got = run(pair.target, PROMPTS, 40, params, specs)
    assert sum(s.stats.n_accepted for s in got) > 0
    for g, w in zip(got, want):
        assert_same(g, w)
    for t in got[0].logprobs:  # the top list is sorted and holds the greedy choice first
        assert [v for _, v in t.top] == sorted((v for _, v in t.top), reverse=True)
    if params.greedy:
        assert all(t.top[0][0] == t.token for s in got for t in s.logprobs)


# --- n sequences sharing one prompt ---------------------------------------------------------------------
def test_forked_sequences_prefill_once_and_equal_cold_starts(pair):
    prompt = list(range(100, 180))
    params = [SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=20 + i) for i in range(3)]
    engine = Engine(pair.target, EngineConfig(n_ctx=512))
    first = engine.add(prompt, 16, params[0], logprobs=2)
    others = [engine.add(prompt, 16, p, logprobs=2, fork_of=first) for p in params[1:]]
    rows = []
    real_forward = pair.target.forward

    def counting(batch, ctx, hidden_layers=()):
        rows.append(len(batch))
        return real_forward(batch, ctx, hidden_layers)

    pair.target.forward = counting
    try:
        while engine.active():
            engine.step()
    finally:
        del pair.target.forward
    assert rows[0] == len(prompt)  # only the first sequence's prompt; the others wait for it
    assert sum(rows) == len(prompt) + 2 + sum(s.n_generated - 1 for s in [first, *others])
    assert all(s.n_reused == len(prompt) - 1 for s in others)
    for seq, p in zip([first, *others], params):
        _, (cold,) = run(pair.target, [prompt], 16, p, logprobs=2)
        assert_same(seq, cold)
    assert len({tuple(s.tokens) for s in [first, *others]}) > 1  # different seeds, different choices


def test_a_fork_outlives_its_parent(pair):
    """The first sequence is released before its prompt is in: the waiting one prefills itself."""
    prompt = [5] * 600  # two prefill chunks
    engine = Engine(pair.target, EngineConfig(n_ctx=1024))
    first = engine.add(prompt, 4, SamplingParams())
    second = engine.add(prompt, 4, SamplingParams(), fork_of=first)
    engine.step()  # the first chunk of the first sequence
    assert second.parent is first and second.n_cached == 0
    engine.release(first)
    while engine.active():
        engine.step()
    _, (cold,) = run(pair.target, [prompt], 4, SamplingParams(), logprobs=None, n_ctx=1024)
    assert second.tokens == cold.tokens and second.n_reused == 0


def test_no_fork_for_a_hidden_state_speculator():
    """A speculator on hidden states gets the prompt's in `prefill`: each sequence prefills itself."""

    class Tap:
        spec_type = "tap"
        hidden_layers = (0,)

        @hookimpl
        def propose(self, seq, limits):
            return None

    engine = Engine(ToyModel(), EngineConfig(n_ctx=256), [Tap()])
    first = engine.add([1, 2, 3, 4], 4)
    second = engine.add([1, 2, 3, 4], 4, fork_of=first)
    assert second.parent is None and first.forks == []
    while engine.active():
        engine.step()
    assert second.n_reused == 0 and second.tokens == first.tokens
