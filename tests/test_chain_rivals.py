"""A cheap speculator's draft passed over for a later speculator of the chain.

The chain asks its speculators in order and the first draft wins, so a lookup placed first
(suffix, for its long copies) took every step it had a guess for, and a hidden-state head after it
drafted only where the lookup had nothing, even where the lookup's guess was then dropped as not
worth its rows. The engine now judges such a draft before the chain stops (`propose_batch`'s
judge): passed over where it would not be verified, or where a later costly speculator is
expected to emit more tokens a second (DraftLengthController.rival_rate, RIVAL_MARGIN).
"""
from __future__ import annotations

import math
import random
import time

from speculant import Draft, DraftLimits, DraftRequest, SequenceView, hookimpl
from speculant.adaptive import RIVAL_MARGIN, DraftLengthController
from speculant.chain import SpeculatorChain
from speculant.engine import Engine, EngineConfig
from speculant.sampling import SamplingParams

from toy_models import EOS, ToyModel

SEQ = SequenceView(0, (1, 2, 3), 3)
LIMITS = DraftLimits(n_max=8)


class Fixed:
    """Proposes fixed tokens; logs its calls."""

    def __init__(self, name, toks, log):
        self.spec_type, self.toks, self.log = name, toks, log

    @hookimpl
    def propose(self, seq, limits):
        self.log.append(self.spec_type)
        return Draft(tuple(self.toks), self.spec_type)


def test_a_judged_draft_is_passed_over_for_the_next_speculators():
    log, seen = [], []
    chain = SpeculatorChain([Fixed("x", [7], log), Fixed("y", [9, 9], log), Fixed("z", [5], log)])

    def judge(request, draft, later):
        seen.append((draft.spec_type, later))
        return draft.spec_type != "x"

    p = chain.propose_batch([DraftRequest(SEQ, LIMITS)], judge=judge)[0]
    assert p.draft == Draft((9, 9), "y") and p.passed == [Draft((7,), "x")]
    assert seen == [("x", ("y", "z")), ("y", ("z",))] and log == ["x", "y"]
    # the last speculator's draft is not judged: nothing is left to replace it
    p = chain.propose_batch([DraftRequest(SEQ, LIMITS)], judge=lambda r, d, later: False)[0]
    assert p.draft == Draft((5,), "z") and [d.spec_type for d in p.passed] == ["x", "y"]
    # later speculators are those the request may use
    seen.clear()
    p = chain.propose_batch([DraftRequest(SEQ, LIMITS)], [("x", "z")], judge=judge)[0]
    assert p.draft == Draft((5,), "z") and seen == [("x", ("z",))]
    p = chain.propose_batch([DraftRequest(SEQ, LIMITS)], [("x",)], judge=judge)[0]
    assert p.draft == Draft((7,), "x") and not p.passed  # no one after it: kept unjudged
    # without a judge the first draft wins, as before
    assert chain.propose_batch([DraftRequest(SEQ, LIMITS)])[0].draft == Draft((7,), "x")


def controller(head_accept: float, guess_accept: float = 0.4) -> DraftLengthController:
    """AVX2 without AVX-VNNI on a Zen 5 (free-quicksort-c's context, 2026-11-30): a second row costs
    1.42x a plain step. `guess` is a lookup (0.2 ms a call), `head` an MTP-like head (2 ms a
    drafted token) whose first token is right `head_accept` of the time."""
    c = DraftLengthController()
    for rows, ms in {1: 22.8, 2: 32.5, 3: 40.5, 48: 390.0}.items():
        for _ in range(3):
            c.observe_forward(rows, ms / 1000)
    for _ in range(3):  # the first call of each is the prompt's catch-up, not counted
        c.observe_cost("guess", 0.0002, 1)
        c.observe_cost("head", 0.002, 1)
    for i in range(60):  # accepted the given share of the time, spread evenly
        c.observe_draft("guess", 1, int((i + 1) * guess_accept) - int(i * guess_accept))
        c.observe_draft("head", 1, int((i + 1) * head_accept) - int(i * head_accept))
    return c


def test_a_guess_is_passed_over_for_a_head_expected_to_do_better():
    c = controller(head_accept=0.75)
    assert c.cheap("guess") and not c.cheap("head")
    rival = c.rival_rate(("head",), 47)
    assert rival is not None and rival > 1.1 / c.forward.cost(1)  # the head pays: >10% over plain
    assert c.best_length("guess", 1) == 1  # alone, near even with plain: verified (DROP_MARGIN)
    assert c.best_length("guess", 1, rival=rival) == 0  # the head's draft instead
    assert c.rival_rate(("guess",), 47) is None  # a lookup is worth only what its draft shows
    # a speculator not measured yet takes a guess's step, so that it gets measured
    assert c.rival_rate(("new-head", "head"), 47) == math.inf
    assert c.best_length("guess", 1, rival=math.inf) == 0


def test_a_head_that_does_not_pay_is_no_rival():
    c = controller(head_accept=0.3)
    rival = c.rival_rate(("head",), 47)
    assert rival == 1 / c.forward.cost(1)  # declined: its rate is plain decoding's
    assert c.best_length("guess", 1, rival=rival) == 1


def test_a_long_copy_is_kept_whatever_the_rival():
    c = controller(head_accept=0.95)
    for _ in range(20):
        c.observe_draft("guess", 47, 47, proposed=47)
    rival = c.rival_rate(("head",), 47)
    assert c.best_length("guess", 47, rival=rival) == 47
    assert c.best_length("guess", 47, rival=math.inf) == 47  # nor by one not measured yet
    # ... but a rival a margin above the copy's own rate takes the step
    copy_rate = (1 + 47 * c.by_length[("guess", 4)].share()) / c.forward.cost(48)
    assert c.best_length("guess", 47, rival=copy_rate * (1 + 2 * RIVAL_MARGIN)) == 0


class Timed(ToyModel):
    """ToyModel whose forward takes 10 ms and 4 ms more a row after the first: what the
    controller measures is the row cost of a slow CPU path."""

    def forward(self, batch, ctx, hidden_layers=()):
        time.sleep(0.010 + 0.004 * max(0, len(batch.tokens) - 1))
        return super().forward(batch, ctx, hidden_layers)


class Oracle:
    """Drafts the next token of `truth` (plain decoding's output), right with chance `p`
    (seeded), at `cost` seconds a call."""

    def __init__(self, name, truth, n_prompt, p, cost, abstain=0.0):
        self.spec_type, self.truth, self.n_prompt, self.p, self.cost = name, truth, n_prompt, p, cost
        self.abstain = abstain  # the share of positions with no draft (a head below its p_min there)
        self.rng, self.accepted, self.verified = random.Random(name), 0, 0

    @hookimpl
    def propose(self, seq, limits):
        time.sleep(self.cost)
        i = len(seq.tokens) - self.n_prompt
        if i >= len(self.truth) or random.Random(i).random() < self.abstain:
            return None
        right = self.truth[i]
        return Draft((right if self.rng.random() < self.p else (right + 1) % EOS,), self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        if draft is not None and draft.spec_type == self.spec_type:
            self.accepted += n_accepted
            self.verified += 1


def test_the_engine_lets_the_head_draft_where_the_lookup_only_guesses():
    prompt, params, n = [2, 7, 1, 8, 2, 8], SamplingParams(), 60
    truth = list(Engine(ToyModel(), EngineConfig(n_ctx=512)).generate(prompt, n, params))
    assert len(truth) == n and EOS not in truth
    guess = Oracle("guess", truth, len(prompt), 0.45, 0.0)
    head = Oracle("head", truth, len(prompt), 0.95, 0.0015)
    engine = Engine(Timed(), EngineConfig(n_ctx=512, draft_n_max=1, adaptive=True), [guess, head])
    assert list(engine.generate(prompt, n, params)) == truth
    # Before: the guess took every step (its drafts near even with plain were verified), the head
    # was never asked. Now most of the tokens come from the head's drafts.
    assert head.accepted > 2 * guess.accepted and head.accepted >= n // 3
    assert engine.spec_stats["guess"].declined > 0


def test_a_passed_over_guess_is_verified_where_the_head_drafts_nothing():
    prompt, params, n = [2, 7, 1, 8, 2, 8], SamplingParams(), 60
    truth = list(Engine(ToyModel(), EngineConfig(n_ctx=512)).generate(prompt, n, params))
    guess = Oracle("guess", truth, len(prompt), 0.45, 0.0)
    head = Oracle("head", truth, len(prompt), 0.95, 0.0005, abstain=0.4)
    engine = Engine(Timed(), EngineConfig(n_ctx=512, draft_n_max=1, adaptive=True), [guess, head])
    assert list(engine.generate(prompt, n, params)) == truth
    # where the head has no draft, the guess it was preferred to is verified (without that: the
    # guess verified 6-7 times, mostly before the head's cost is measured)
    assert head.accepted >= n // 4 and guess.verified >= 12
