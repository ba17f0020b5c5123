"""Engine support the server relies on: per-sequence speculation overrides and speculator failures
that turn speculation off for one sequence only (toy models, no GGUF)."""
import pytest

from speculant import Draft, hookimpl
from speculant.engine import Engine, EngineConfig, SpecOverride

from toy_models import N_VOCAB, ToyHybridModel, ToyModel, ToyRecurrentModel

PROMPT = [1, 2, 3, 4, 5]


def plain(model_cls=ToyModel, n=30, prompt=PROMPT):
    return list(Engine(model_cls(), EngineConfig(n_ctx=256)).generate(prompt, n))


class Oracle:
    """Drafts the true continuation (every 3rd token wrong); records the limits it was given."""

    def __init__(self, spec_type, truth, n=8):
        self.spec_type, self.truth, self.n = spec_type, truth, n
        self.limits = []

    @hookimpl
    def begin(self, seq):
        self.n_prompt = seq.n_prompt

    @hookimpl
    def propose(self, seq, limits):
        self.limits.append(limits)
        done = len(seq) - self.n_prompt
        toks = list(self.truth[done : done + min(self.n, limits.n_max)])
        for i in range(len(toks)):
            if (done + i) % 3 == 2:
                toks[i] = (toks[i] + 1) % N_VOCAB
        return Draft(tuple(toks), self.spec_type) if toks else None


class Boom:
    """Raises in the hook named `where` for sequences whose prompt starts with `bad_first`."""

    spec_type = "boom"

    def __init__(self, where="propose", bad_first=9, draft_token=0):
        self.where, self.bad_first, self.draft_token = where, bad_first, draft_token

    def _maybe(self, name, seq):
        if name == self.where and seq.tokens[0] == self.bad_first:
            raise RuntimeError(f"boom in {name}")

    @hookimpl
    def begin(self, seq):
        self._maybe("begin", seq)

    @hookimpl
    def propose(self, seq, limits):
        self._maybe("propose", seq)
        return Draft((self.draft_token,), self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        self._maybe("accept", seq)


def run(engine, prompt, n=30, spec=None):
    seq = engine.add(prompt, n, spec=spec)
    out = []
    while seq.finish_reason is None:
        out += engine.step()[seq.seq_id]
    engine.release(seq)
    return out, seq


def test_override_limits_reach_the_speculator():
    truth = plain()
    spec = Oracle("oracle", truth)
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, draft_n_max=16, adaptive=False), [spec])
    out, seq = run(engine, PROMPT, spec=SpecOverride(n_max=3, n_min=2, p_min=0.5))
    assert out == truth
    assert spec.limits and all(l.n_max <= 3 and l.n_min == 2 and l.p_min == 0.5 for l in spec.limits)
    assert max(l.n_max for l in spec.limits) == 3
    spec.limits.clear()
    out, _ = run(engine, PROMPT)  # no override: the engine's settings
    assert out == truth and max(l.n_max for l in spec.limits) == 16


def test_override_n_max_zero_and_empty_types_mean_plain_decoding():
    truth = plain()
    spec = Oracle("oracle", truth)
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False), [spec])
    for override in (SpecOverride(n_max=0), SpecOverride(types=())):
        out, seq = run(engine, PROMPT, spec=override)
        assert out == truth and seq.stats.n_drafts == 0


def test_override_types_pick_speculators_of_the_chain():
    truth = plain()
    a, b = Oracle("a", truth), Oracle("b", truth)
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False), [a, b])
    out, _ = run(engine, PROMPT, spec=SpecOverride(types=("b",)))
    assert out == truth and not a.limits and b.limits
    b.limits.clear()
    out, _ = run(engine, PROMPT)  # whole chain: a comes first and always has a draft
    assert out == truth and a.limits and not b.limits
    assert set(engine.spec_stats) == {"a", "b"}


@pytest.mark.parametrize("where", ["begin", "propose", "accept"])
@pytest.mark.parametrize("model_cls", [ToyModel, ToyRecurrentModel, ToyHybridModel])
def test_raising_speculator_fails_over_to_plain_decoding_for_its_sequence_only(where, model_cls):
    bad_prompt = [9, 2, 3, 4, 5]
    truth_bad, truth_good = plain(model_cls, prompt=bad_prompt), plain(model_cls)
    engine = Engine(model_cls(), EngineConfig(n_ctx=256, adaptive=False), [Boom(where)])
    bad = engine.add(bad_prompt, 30)
    good = engine.add(PROMPT, 30)
    outs = {bad.seq_id: [], good.seq_id: []}
    while engine.active():
        for sid, toks in engine.step().items():
            outs[sid] += toks
    assert outs[bad.seq_id] == truth_bad and outs[good.seq_id] == truth_good
    assert bad.spec_error == f"RuntimeError: boom in {where}"
    assert good.spec_error is None and good.stats.n_drafts > 0
    engine.release(bad)
    engine.release(good)
    assert not engine.sequences
