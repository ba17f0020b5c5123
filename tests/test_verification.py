"""Verification modes: rejection sampling keeps the target's distribution; sample-and-match keeps
plain decoding's tokens. Statistical checks run on the toy model, whose exact distribution is known."""
import torch

from speculant import Draft, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.sampling import Sampler, SamplingParams
from speculant.verify import verify

from toy_models import EOS, N_VOCAB, ToyModel, _logits, _next_hash

PROMPT = [3, 1, 4]
PARAMS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
CHI2_CRIT_31_DF = 61.1  # chi-square critical value, 31 degrees of freedom, p = 0.001


def prompt_hash(tokens):
    h = 0
    for t in tokens:
        h = _next_hash(h, t)
    return h


class BiasedDrafter:
    """Samples drafts from a fixed distribution q unlike the target's, and says so (probs)."""

    spec_type = "biased"

    def __init__(self, n=2, seed=0):
        g = torch.Generator().manual_seed(1234)
        self.q = torch.softmax(torch.randn(N_VOCAB, generator=g) * 2, -1)
        self.q[EOS] = 0
        self.q /= self.q.sum()
        self.n, self.gen = n, torch.Generator().manual_seed(seed)

    @hookimpl
    def propose(self, seq, limits):
        k = min(self.n, limits.n_max)
        toks = torch.multinomial(self.q, k, replacement=True, generator=self.gen).tolist()
        return Draft(tuple(toks), self.spec_type, self.q.expand(k, -1).clone())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 5  # the usual validity rule; merge the rest into one bin
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    rest_c, rest_e = counts[~keep].sum(), expected[~keep].sum()
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
    return float(stat)


def test_rejection_sampling_gives_the_target_distribution():
    target = torch.softmax(_logits(prompt_hash(PROMPT)), -1)
    drafter = BiasedDrafter()
    assert (target - drafter.q).abs().sum() > 0.5  # the draft distribution is really different
    counts = torch.zeros(N_VOCAB)
    n_accepted = 0
    model = ToyModel()
    for seed in range(3000):
        engine = Engine(model, EngineConfig(n_ctx=64, adaptive=False), [drafter])
        first = list(engine.generate(PROMPT, 3, SamplingParams(**PARAMS, seed=seed)))[0]
        counts[first] += 1
        n_accepted += engine.last_sequence.stats.n_accepted
    assert n_accepted > 100  # drafts were accepted, so acceptance, not only resampling, was exercised
    assert chi_square(counts, target) < CHI2_CRIT_31_DF
    assert chi_square(counts, drafter.q) > 10 * CHI2_CRIT_31_DF  # the test can tell the two apart


def test_rejection_sampling_is_not_sample_and_match():
    """Rejection sampling does not reproduce seeded plain decoding token for token (it uses the
    random stream differently), yet its distribution is right: (a) is not what makes (b) correct."""
    differ = 0
    for seed in range(50):
        params = SamplingParams(**PARAMS, seed=seed)
        plain = list(Engine(ToyModel(), EngineConfig(n_ctx=64)).generate(PROMPT, 6, params))
        spec = list(Engine(ToyModel(), EngineConfig(n_ctx=64, adaptive=False), [BiasedDrafter(seed=seed)]).generate(PROMPT, 6, params))
        differ += plain != spec
    assert differ > 10


def test_greedy_with_probabilities_uses_exact_match():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 9.0], [7.0, 0.0, 0.0]])
    sampler = Sampler(SamplingParams())
    draft = Draft((1, 0), "x", torch.full((2, 3), 1 / 3))
    assert verify(sampler, logits, draft, frozenset()) == ([1, 2], 1)


def test_no_token_after_end_of_generation_in_rejection_mode():
    logits = torch.full((3, 4), -30.0)
    logits[:, 3] = 10.0  # the target is sure the next token is 3 (end of generation)
    draft = Draft((3, 1), "x", torch.full((2, 4), 0.25))
    for seed in range(20):
        emitted, n = verify(Sampler(SamplingParams(**PARAMS, seed=seed)), logits, draft, frozenset({3}))
        assert emitted == [3] and n == 1


def test_sampler_chain_matches_reference_filters():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.5, -1.0, -4.0])
    p = Sampler(SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1, seed=0)).probs(logits)
    # by hand: top-k keeps 4; softmax(top 4) cum: 0.462, 0.880, 0.944 -> top-p 0.9 keeps 3;
    # min-p 0.1 * 0.462 keeps all 3; temperature 0.7 over the survivors.
    ref = torch.zeros(6)
    ref[:3] = torch.softmax(logits[:3] / 0.7, -1)
    assert torch.allclose(p, ref, atol=1e-6)
    assert int(torch.argmax(Sampler(SamplingParams()).probs(logits))) == 0
