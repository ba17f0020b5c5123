"""The decode loop on toy models: exactness with speculation, recurrent checkpoints, limits, hooks."""
import pytest

from speculant import Draft, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.sampling import SamplingParams

from toy_models import EOS, N_VOCAB, ToyModel, ToyRecurrentModel

PROMPT = [1, 2, 3, 4, 5]


def plain(model, n=40, params=SamplingParams(), prompt=PROMPT):
    return list(Engine(model, EngineConfig(n_ctx=256)).generate(prompt, n, params))


class OracleSpeculator:
    """Drafts the true continuation with every `wrong_every`-th token corrupted; records hook calls."""

    spec_type = "oracle"

    def __init__(self, truth, wrong_every=3, n=4, hidden_layers=()):
        self.truth, self.wrong_every, self.n = truth, wrong_every, n
        self.hidden_layers = hidden_layers
        self.calls = []
        self.hidden_seen = []

    @hookimpl
    def begin(self, seq):
        self.calls.append(("begin", len(seq)))
        self.n_prompt = seq.n_prompt

    @hookimpl
    def propose(self, seq, limits):
        done = len(seq) - self.n_prompt
        toks = list(self.truth[done : done + min(self.n, limits.n_max)])
        for i in range(len(toks)):
            if (done + i) % self.wrong_every == self.wrong_every - 1:
                toks[i] = (toks[i] + 1) % N_VOCAB
        return Draft(tuple(toks), self.spec_type) if toks else None

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        self.calls.append(("accept", n_accepted))
        self.hidden_seen.append((len(draft) if draft else 0, hidden))

    @hookimpl
    def checkpoint(self, seq, action):
        self.calls.append(("checkpoint", action))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=7),
                                    SamplingParams(temperature=1.3, top_k=10, top_p=0.9, min_p=0.05, seed=3)])
@pytest.mark.parametrize("model_cls", [ToyModel, ToyRecurrentModel])
def test_speculation_gives_plain_tokens(params, model_cls):
    truth = plain(model_cls(), params=params)
    assert len(truth) > 5
    spec = OracleSpeculator(truth)
    model = model_cls()
    # (adaptive off: on a toy whose forward takes microseconds, what pays is timing noise)
    engine = Engine(model, EngineConfig(n_ctx=256, draft_n_max=4, adaptive=False), [spec])
    got = list(engine.generate(PROMPT, 40, params))
    assert got == truth
    accepted = [n for kind, n in spec.calls if kind == "accept"]
    assert sum(accepted) > 0 and 0 in accepted or min(accepted) < 4  # some drafts partly rejected
    assert model.forward_calls < len(truth)  # speculation saved forward passes


def test_recurrent_target_runs_checkpoint_path():
    truth = plain(ToyRecurrentModel())
    # Two-token drafts, every fourth token wrong: drafts kept whole (discard) alternate with cut ones (restore).
    spec = OracleSpeculator(truth, wrong_every=4, n=2)
    model = ToyRecurrentModel()
    engine = Engine(model, EngineConfig(n_ctx=256, adaptive=False), [spec])
    assert list(engine.generate(PROMPT, 40)) == truth
    actions = [a for kind, a in spec.calls if kind == "checkpoint"]
    assert "save" in actions and "restore" in actions and "discard" in actions
    assert engine.context.restores == actions.count("restore") > 0


def test_hidden_states_reach_accept():
    truth = plain(ToyModel())
    spec = OracleSpeculator(truth, hidden_layers=(1,))
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256), [spec])
    list(engine.generate(PROMPT, 10))
    assert spec.hidden_seen
    (n_draft, hidden), *later = spec.hidden_seen
    assert hidden[1].shape == (len(PROMPT) + n_draft, 8)  # the first step carries the (short) prompt
    for n_draft, hidden in later:  # the step's rows: the last token plus the draft
        assert hidden[1].shape == (1 + n_draft, 8)
    assert any(n_draft > 0 for n_draft, _ in spec.hidden_seen)


def test_budget_and_context_limits():
    truth = plain(ToyModel(), n=60)
    for n in (1, 2, 7):
        engine = Engine(ToyModel(), EngineConfig(n_ctx=256, draft_n_max=8), [OracleSpeculator(truth, wrong_every=100, n=8)])
        assert list(engine.generate(PROMPT, n)) == truth[:n]
        assert engine.last_sequence.finish_reason in ("length", "stop")
    engine = Engine(ToyModel(), EngineConfig(n_ctx=12, draft_n_max=8), [OracleSpeculator(truth, wrong_every=100, n=8)])
    out = list(engine.generate(PROMPT, 100))
    assert out == truth[: len(out)] and len(PROMPT) + len(out) <= 12
    assert engine.last_sequence.finish_reason == "length"


def test_no_draft_token_after_end_of_generation():
    prompt = next(p for p in ([i, i + 1] for i in range(100)) if EOS in plain(ToyModel(), n=60, prompt=p))
    truth = plain(ToyModel(), n=60, prompt=prompt)
    cut = truth.index(EOS)
    assert len(truth) == cut + 1  # plain decoding stops at EOS
    # The oracle keeps drafting past EOS; none of that may be accepted.
    spec = OracleSpeculator(truth + [5, 5, 5], wrong_every=1000, n=8)
    out = list(Engine(ToyModel(), EngineConfig(n_ctx=512, draft_n_max=8), [spec]).generate(prompt, 60))
    assert out == truth[: cut + 1] and out[-1] == EOS


def test_chain_order_and_fallthrough():
    class Fixed:
        def __init__(self, name, toks):
            self.spec_type, self.toks, self.asked = name, toks, 0

        @hookimpl
        def propose(self, seq, limits):
            self.asked += 1
            return Draft(tuple(self.toks), self.spec_type) if self.toks else None

    empty, a, b = Fixed("empty", []), Fixed("a", [1]), Fixed("b", [2])
    engine = Engine(ToyModel(), EngineConfig(n_ctx=64, adaptive=False), [empty, a, b])
    seq = engine.add(PROMPT, 5)
    draft = engine._propose_all([seq])[seq.seq_id]
    assert draft.spec_type == "a" and empty.asked == 1 and b.asked == 0


def test_prompt_limits():
    from speculant import LimitError

    engine = Engine(ToyModel(), EngineConfig(n_ctx=8))
    with pytest.raises(LimitError, match="8"):
        engine.add(list(range(8)), 4)
    with pytest.raises(LimitError):
        engine.add([], 4)


def test_many_sequences_match_single():
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]
    singles = [plain(ToyModel(), n=20, params=params, prompt=p) for p in prompts]
    engine = Engine(ToyModel(), EngineConfig(n_ctx=128))
    seqs = [engine.add(p, 20, params) for p in prompts]
    while engine.active():
        engine.step()
    assert [s.tokens[s.n_prompt :] for s in seqs] == singles


def test_draft_outside_the_vocabulary_turns_speculation_off_for_that_sequence():
    """A broken speculator proposing an id the model does not have must not crash the step
    (the embedding would raise for every sequence in the batch): its sequence goes on plain."""
    truth = plain(ToyModel())

    class OutOfVocab:
        spec_type = "broken"

        @hookimpl
        def propose(self, seq, limits):
            return Draft([N_VOCAB + 5], self.spec_type)

    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False), [OutOfVocab()])
    seq = engine.add(PROMPT, 40)
    out = []
    while seq.finish_reason is None:
        out += engine.step()[seq.seq_id]
    assert out == truth
    assert "outside the vocabulary" in seq.spec_error


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(monkeypatch):
    """A new long prompt goes in one chunk per step; the sequences already decoding get a token
    in each of those steps instead of waiting for the whole prompt, and every output is still
    what the sequence gives alone."""
    import speculant.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 4)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    long_prompt = [(7 * i + 3) % 50 + 1 for i in range(30)]
    alone = [plain(ToyModel(), n=20, params=params, prompt=p) for p in (PROMPT, long_prompt)]
    engine = Engine(ToyModel(), EngineConfig(n_ctx=128))
    a = engine.add(PROMPT, 20, params)
    engine.step()  # a's prompt (4 rows) goes in
    assert engine.step()[a.seq_id]  # a decodes
    b = engine.add(long_prompt, 20, params)
    chunks = 0
    while not b.prefilled or len(b.tokens) == len(long_prompt):
        new = engine.step()
        if len(b.tokens) == len(long_prompt) and not new[b.seq_id]:
            chunks += 1
            assert new[a.seq_id] or a.finish_reason, "a waited for b's prompt"
    assert chunks >= (len(long_prompt) - 1) // 4  # 29 rows in chunks of 4: one step each
    while engine.active():
        engine.step()
    assert [a.tokens[a.n_prompt :], b.tokens[b.n_prompt :]] == alone
