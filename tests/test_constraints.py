"""Logits constraints in the engine (speculant.constraint): constrained speculation equals
constrained plain decoding at temperature 0 and is distributed as constrained sampling above it;
forced tokens are drafted by the grammar drafter; speculators' drafts are cut at the first token
the constraint rejects. On the toy model, with a toy grammar whose masks are known exactly."""
import pytest
import torch

from speculant import Draft, hookimpl
from speculant.constraint import Constraint
from speculant.engine import Engine, EngineConfig, SpecOverride
from speculant.sampling import SamplingParams

from test_verification import CHI2_CRIT_31_DF, BiasedDrafter, chi_square, prompt_hash
from toy_models import EOS, N_VOCAB, ToyModel, ToyRecurrentModel, _logits, _next_hash

PROMPT = [3, 1, 4]
NO_SPEC = SpecOverride(n_max=0)  # plain decoding: no drafts at all, the grammar drafter's neither


class ToyGrammar:
    """Free state: even tokens, 5 and EOS. After 5 come 6 then 7, forced; then free again."""

    FREE = torch.tensor([t % 2 == 0 or t in (5, EOS) for t in range(N_VOCAB)])

    def __init__(self):
        self.history: list[int] = []
        self.masks = self.advances = 0

    def _allowed(self, history) -> set[int]:
        if history and history[-1] == 5:
            return {6}
        if len(history) >= 2 and history[-2:] == [5, 6]:
            return {7}
        return {t for t in range(N_VOCAB) if bool(self.FREE[t])}

    def mask(self):
        self.masks += 1
        m = torch.zeros(N_VOCAB, dtype=torch.bool)
        m[list(self._allowed(self.history))] = True
        return m

    def advance(self, token):
        assert token in self._allowed(self.history), (self.history, token)
        self.advances += 1
        self.history.append(token)

    def rollback(self, n):
        del self.history[len(self.history) - n:]

    def forced(self):
        out, h = [], list(self.history)
        while True:
            allowed = self._allowed(h)
            if len(allowed) != 1:
                return out
            out.append(next(iter(allowed)))
            h.append(out[-1])

    def valid_prefix(self, tokens):
        h = list(self.history)
        for i, t in enumerate(tokens):
            if t not in self._allowed(h):
                return i
            h.append(t)
        return len(tokens)


def valid(tokens) -> bool:
    g = ToyGrammar()
    return g.valid_prefix(tokens) == len(tokens)


class Echo:
    """Drafts the generated tokens so far again, from the start, and checks at `accept` that
    every draft it is told about passes the grammar (it was cut before verification)."""

    spec_type = "echo"

    def __init__(self, n=4):
        self.n, self.asked, self.told = n, [], []

    @hookimpl
    def propose(self, seq, limits):
        gen = list(seq.tokens[seq.n_prompt:]) or [2]
        toks = tuple((gen * 8)[: min(self.n, limits.n_max)])
        self.asked.append(tuple(seq.tokens[seq.n_prompt:]))
        return Draft(toks, self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden, hidden_start):
        if draft is not None:
            self.told.append((tuple(seq.tokens[seq.n_prompt:]), draft.tokens, n_accepted))


class Garbage:
    """Drafts 5, 8, then tokens the grammar rejects (odd ones other than 5)."""

    spec_type = "garbage"

    @hookimpl
    def propose(self, seq, limits):
        return Draft((5, 6, 7, 2, 9, 11, 13)[: limits.n_max], self.spec_type)


def run(model, speculators, params, n, constraint_cls=ToyGrammar, spec=None, config=None):
    engine = Engine(model, config or EngineConfig(n_ctx=128, adaptive=False), speculators)
    g = constraint_cls()
    out = list(engine.generate(PROMPT, n, params, spec=spec, constraint=g))
    return out, g, engine


@pytest.mark.parametrize("model_cls", [ToyModel, ToyRecurrentModel])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 7)])
def test_speculation_equals_constrained_plain_decoding(model_cls, temperature, seed):
    params = SamplingParams(temperature=temperature, seed=seed)
    plain, g_plain, engine = run(model_cls(), [], params, 40, spec=NO_SPEC)
    assert valid(plain) and g_plain.history == plain
    assert "grammar" not in engine.spec_stats  # plain decoding: no grammar drafts either
    unconstrained = list(Engine(model_cls(), EngineConfig(n_ctx=128), []).generate(PROMPT, 40, params))
    assert not valid(unconstrained)  # the grammar changes the output here
    for speculators in ([], [Echo()], [Garbage()], [Garbage(), Echo()]):
        out, g, engine = run(model_cls(), speculators, params, 40)
        assert out == plain, speculators
        assert g.history == out  # the constraint followed exactly the emitted tokens
    out, _, engine = run(model_cls(), [Echo()], params, 40, spec=SpecOverride(types=()))
    assert out == plain and "echo" not in engine.spec_stats  # no speculator; the grammar drafter still drafts


def test_forced_tokens_are_drafted_by_the_grammar_drafter():
    echo = Echo()
    out, g, engine = run(ToyModel(), [echo], SamplingParams(), 60)
    assert valid(out) and out.count(5) >= 2
    st = engine.spec_stats["grammar"]
    # every 5 forces 6, 7: one grammar draft of two tokens each time (unless the budget cut it)
    assert st.drafts == out[:-2].count(5) and st.drafted == 2 * st.drafts and st.accepted == st.drafted
    # no speculator is asked where the grammar forces the next tokens
    assert echo.asked and not any(h[-1:] == (5,) or h[-2:] == (5, 6) for h in echo.asked)


def test_drafts_are_cut_before_the_first_rejected_token():
    echo = Echo(n=6)
    out, g, engine = run(ToyModel(), [Garbage(), echo], SamplingParams(), 30)
    st = engine.spec_stats["garbage"]
    assert st.drafts > 0
    # Garbage drafts 5, 6, 7, 2 then rejected tokens: never more than 4 tokens reach verification,
    # and only where 5 is allowed (the free state); the grammar drafter takes the forced steps
    assert st.drafted <= 4 * st.drafts and st.accepted <= st.drafted
    told = echo.told
    assert told == [] or all(valid(list(h) + list(d)) for h, d, _ in told)


def test_budget_cut_rolls_the_constraint_back():
    for n in range(1, 20):
        out, g, _ = run(ToyModel(), [Garbage()], SamplingParams(), n)
        assert len(out) <= n and g.history == out


def test_constraint_in_an_error_state_ends_the_sequence():
    class Nothing(ToyGrammar):
        def mask(self):
            return torch.zeros(N_VOCAB, dtype=torch.bool)

        def advance(self, token):
            self.history.append(token)

        def valid_prefix(self, tokens):
            return 0

    out, g, engine = run(ToyModel(), [], SamplingParams(), 10, constraint_cls=Nothing)
    assert out == [EOS] and engine.last_sequence.finish_reason == "stop"


def test_logprobs_are_the_model_s_before_the_mask():
    engine = Engine(ToyModel(), EngineConfig(n_ctx=64), [])
    seq = engine.add(PROMPT, 3, SamplingParams(), logprobs=3, constraint=ToyGrammar())
    while seq.finish_reason is None:
        engine.step()
    raw = torch.log_softmax(_logits(prompt_hash(PROMPT)), -1)
    first = seq.logprobs[0]
    assert first.logprob == pytest.approx(float(raw[seq.tokens[len(PROMPT)]]))
    assert [t for t, _ in first.top] == torch.topk(raw, 3).indices.tolist()  # odd tokens may be listed


# --- temperature > 0: distributed as constrained sampling ---------------------------------------------
PARAMS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def masked(logits, allowed) -> torch.Tensor:
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)


def test_rejection_sampling_under_a_constraint_gives_constrained_sampling():
    """First and second tokens, drafted by a drafter with probabilities unlike the target's (and
    unaware of the grammar: about half its draws are rejected tokens, cut before verification):
    each is distributed as constrained sampling's, chi-square at p = 0.001."""
    h0 = prompt_hash(PROMPT)
    free = ToyGrammar.FREE
    p1 = masked(_logits(h0), free)
    # the second token: after 5 it is forced (6); otherwise the free mask again
    p2 = torch.zeros(N_VOCAB)
    for x in range(N_VOCAB):
        if p1[x] > 0 and x != EOS:
            p2 += p1[x] * (torch.nn.functional.one_hot(torch.tensor(6), N_VOCAB).float() if x == 5
                           else masked(_logits(_next_hash(h0, x)), free))
    drafter = BiasedDrafter(n=3)
    counts1, counts2 = torch.zeros(N_VOCAB), torch.zeros(N_VOCAB)
    n_accepted = n_drafted = 0
    model = ToyModel()
    for seed in range(2500):
        engine = Engine(model, EngineConfig(n_ctx=64, adaptive=False), [drafter])
        out = list(engine.generate(PROMPT, 2, SamplingParams(**PARAMS, seed=seed), constraint=ToyGrammar()))
        counts1[out[0]] += 1
        if out[0] != EOS:
            counts2[out[1]] += 1
        st = engine.spec_stats.get("biased")
        if st is not None:
            n_accepted, n_drafted = n_accepted + st.accepted, n_drafted + st.drafted
    assert n_accepted > 100 and n_drafted > n_accepted  # acceptance and rejection both exercised
    assert counts1[p1 == 0].sum() == 0 and counts2[p2 == 0].sum() == 0  # never a token the grammar rejects
    assert chi_square(counts1, p1) < CHI2_CRIT_31_DF
    assert chi_square(counts2, p2 / p2.sum()) < CHI2_CRIT_31_DF
    unmasked = torch.softmax(_logits(h0), -1)
    assert chi_square(counts1, unmasked) > 10 * CHI2_CRIT_31_DF  # the test tells masked from unmasked


def test_the_toy_grammar_is_a_constraint():
    assert isinstance(ToyGrammar(), Constraint)


def test_greedy_shortcut_is_the_masked_argmax():
    """Greedy verification takes the raw argmax when the constraint allows it, without a mask:
    the same token as the argmax of the masked logits, ties included (the first maximum)."""
    from speculant.constraint import apply_mask
    from speculant.sampling import Sampler
    from speculant.verify import verify

    g = torch.Generator().manual_seed(5)
    sampler = Sampler(SamplingParams())
    for trial in range(300):
        logits = torch.randn(1, N_VOCAB, generator=g).round(decimals=0)  # many equal maxima
        c = ToyGrammar()
        if trial % 3 == 1:
            c.history = [5]  # only 6 allowed
        want = int(torch.argmax(apply_mask(logits[0], c.mask())))
        masks_before = c.masks
        emitted, _ = verify(sampler, logits, None, frozenset({EOS}), c)
        assert emitted == [want]
        if c.FREE[int(torch.argmax(logits[0]))] and trial % 3 != 1:
            assert c.masks == masks_before  # allowed: no mask was built
