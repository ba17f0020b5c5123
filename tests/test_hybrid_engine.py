"""Speculation on a hybrid target (HybridCache: attention rows plus recurrent state).

Two ways back after a partial acceptance: per-row rollback (the cache kept the state after each
verification row; the default) and checkpoint/replay (`spec_use_checkpoints`, llama.cpp's way).
Both must give plain decoding's tokens; the first must never replay.
"""
from __future__ import annotations

import pytest
import torch

from speculant import HybridCache, KVCache, hookimpl
from speculant.adaptive import Acceptance, DraftLengthController
from speculant.engine import Engine, EngineConfig
from speculant.sampling import SamplingParams

from test_engine import PROMPT, OracleSpeculator, plain
from toy_models import ToyHybridModel

SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=7)]


@pytest.mark.parametrize("params", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
def test_hybrid_speculation_gives_plain_tokens(params, use_checkpoints):
    truth = plain(ToyHybridModel(), params=params)
    spec = OracleSpeculator(truth, wrong_every=3, n=4)
    engine = Engine(ToyHybridModel(), EngineConfig(n_ctx=256, draft_n_max=4, adaptive=False, spec_use_checkpoints=use_checkpoints), [spec])
    assert list(engine.generate(PROMPT, 40, params)) == truth
    st = engine.recurrent_stats
    actions = [a for kind, a in spec.calls if kind == "checkpoint"]
    if use_checkpoints:
        assert st.replays > 0 and st.saves > 0 and st.rollbacks == 0
        # a step whose kept tokens ride again drafts nothing, so what one restore replays is at
        # most the pending token and the draft's accepted part (no pile-up)
        assert st.replayed_rows <= st.replays * 4
        assert "save" in actions and "restore" in actions
    else:  # cut back inside the verification rows: no checkpoint, no replayed row
        assert st.rollbacks > 0 and st.replays == 0 and st.saves == 0 and st.replayed_rows == 0
        assert actions == []


@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
def test_hybrid_concurrent_sequences(use_checkpoints):
    prompts = [PROMPT, [7, 3, 9], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 11]]
    truths = [plain(ToyHybridModel(), prompt=p, n=30) for p in prompts]

    class PerPrompt(OracleSpeculator):  # each sequence drafts its own truth, every third token wrong
        @hookimpl
        def begin(self, seq):
            pass

        @hookimpl
        def propose(self, seq, limits):
            truth = truths[next(i for i, p in enumerate(prompts) if list(seq.tokens[: len(p)]) == p and seq.n_prompt == len(p))]
            self.truth, self.n_prompt = truth, seq.n_prompt
            return super().propose(seq, limits)

    model = ToyHybridModel()
    engine = Engine(model, EngineConfig(n_ctx=256, draft_n_max=5, adaptive=False, spec_use_checkpoints=use_checkpoints),
                    [PerPrompt(truths[0], wrong_every=3, n=5)])
    seqs = [engine.add(p, 30) for p in prompts]
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    for seq, truth in zip(seqs, truths):
        assert seq.tokens[seq.n_prompt:] == truth
    st = engine.spec_stats["oracle"]
    assert st.accepted > 0 and st.accepted < st.drafted  # drafts paid, some were cut back
    assert model.forward_calls < max(len(t) for t in truths)  # the sequences shared forwards


def test_rows_are_kept_only_for_verification():
    """A prompt chunk or a plain step keeps no per-row states (their memory is the reason)."""
    model = ToyHybridModel()
    engine = Engine(model, EngineConfig(n_ctx=2048, adaptive=False))
    seq = engine.add(list(range(1, 30)) * 30, 3)  # 870 tokens: a whole chunk goes in alone
    engine.step()
    assert seq.n_cached == 512 and engine.context.rollback_floor(seq.seq_id) == 512
    while seq.finish_reason is None:
        engine.step()
    assert engine.context.rollback_floor(seq.seq_id) == engine.context.length(seq.seq_id)


def test_hybrid_cache_truncate_bounds():
    cache = HybridCache(KVCache(1, 1, 2, 64), {3: ((2, 2), (4,))})
    cache.reserve(0, 5)
    cache.write(0, 3, [torch.ones(2, 2), torch.ones(4)], [torch.arange(20.0).view(5, 2, 2), torch.arange(20.0).view(5, 4)])
    cache.commit(0, 0, 5)
    assert cache.rollback_floor(0) == 0 and cache.can_truncate(0, 2)
    cache.truncate(0, 2)  # the state after row 1
    assert torch.equal(cache.read(0, 3)[1], torch.arange(4.0, 8.0)) and cache.length(0) == cache.kv.length(0) == 2
    with pytest.raises(ValueError, match="restore a checkpoint"):  # one use: the rows are gone
        cache.truncate(0, 1)
    saved = cache.save(0)
    assert saved.nbytes == cache.state_nbytes() == (4 + 4) * 4
    cache.reserve(0, 3)
    cache.write(0, 3, [torch.zeros(2, 2), torch.zeros(4)])  # no per-row states
    cache.commit(0, 2, 3)
    assert not cache.can_truncate(0, 2)
    cache.restore(0, saved)
    assert cache.length(0) == 2 and torch.equal(cache.read(0, 3)[1], torch.arange(4.0, 8.0))
    with pytest.raises(RuntimeError, match="no state for recurrent layers"):
        cache.reserve(0, 3)
        cache.commit(0, 2, 3)


def test_nbytes_counts_overlapping_row_states_once():
    """Per-row states given as overlapping windows of one buffer (lfm2's conv states) count the
    buffer they span, not each window whole (the prompt cache's --cache-ram limit reads it)."""
    cache = HybridCache(KVCache(1, 1, 2, 64), {3: ((2, 4),)})
    buffer = torch.zeros(5 + 2, 4)  # [state | 5 rows]; row j's state is rows j+1 .. j+2
    cache.reserve(0, 5)
    cache.write(0, 3, [buffer[-2:].clone()], [buffer.as_strided((5, 2, 4), (4, 4, 1), 4)])
    cache.commit(0, 0, 5)
    kv = cache.kv.nbytes(0)
    assert cache.nbytes(0) - kv == 2 * 4 * 4 + 6 * 4 * 4  # the final state, and the 6 buffer rows the windows span


@pytest.mark.parametrize("n", [0, 2])
def test_ctx_checkpoints_bound(n):
    """--ctx-checkpoints: the prompt-end states a sequence keeps, the oldest dropped first."""
    engine = Engine(ToyHybridModel(), EngineConfig(n_ctx=256, ctx_checkpoints=n))
    entry = None
    history = list(PROMPT)
    for turn in range(4):
        prompt = history + [turn + 1, turn + 2]
        seq = engine.add(prompt, 4, cached=entry)
        while seq.finish_reason is None:
            engine.step()
        history = seq.tokens[: seq.n_cached]
        entry = engine.keep(seq)
        assert len(entry.checkpoints) == min(n, turn + 1)


def test_hybrid_prompt_cache_resumes_like_a_cold_start():
    engine = Engine(ToyHybridModel(), EngineConfig(n_ctx=256))
    seq = engine.add(list(PROMPT), 6)
    while seq.finish_reason is None:
        engine.step()
    gen = seq.tokens[seq.n_prompt:]
    entry = engine.keep(seq)
    second = list(PROMPT) + gen[:2] + [9, 9]  # inside turn 1's answer: back to the prompt-end checkpoint
    warm = engine.add(second, 8, cached=entry)
    while warm.finish_reason is None:
        engine.step()
    assert warm.n_reused == len(PROMPT) - 1
    assert warm.tokens[warm.n_prompt:] == plain(ToyHybridModel(), prompt=second, n=8)


def test_controller_counts_checkpoint_cost():
    """The same acceptance and forward costs: without per-row states, a checkpoint that costs as
    much as a forward makes a half-accepted draft not worth verifying."""
    def controller(replay: bool, checkpoint_seconds: float) -> DraftLengthController:
        c = DraftLengthController(replay=replay)
        for rows in range(1, 10):
            c.observe_forward(rows, 0.010 + 0.001 * rows)
        c.acceptance["x"] = Acceptance()
        for _ in range(50):
            c.observe_draft("x", 4, 2)
        c.observe_cost("x", 0.0, 4)  # the first call: catching up
        c.observe_cost("x", 0.0, 4)
        c.observe_checkpoint(checkpoint_seconds)
        return c

    assert controller(False, 0.0).plan("x", 8) > 0
    assert controller(True, 0.0001).plan("x", 8) > 0
    assert controller(True, 0.02).plan("x", 8) == 0
