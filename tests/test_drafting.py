"""speculant.drafting: the per-sequence bookkeeping hidden-state speculators share."""
from __future__ import annotations

import pytest
import torch

from speculant.context import KVCache
from speculant import drafting
from speculant.drafting import (TRAINING_KEY, DraftChain, PositionStates, committed_rows, pick_token, skip_unread_rows,
                                store_encoded_taps, trained_window)
from speculant.types import Draft, DraftLimits, SequenceView


def rows(start, end, width=4):
    return torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, width)


@pytest.mark.parametrize("state_offset,token_offset,cut_to,put_from", [(0, 1, 9, 10), (-1, 0, 10, 11), (0, None, 10, 10)])
def test_written_follows_what_each_row_reads(state_offset, token_offset, cut_to, put_from):
    """EAGLE3 (row q: g_q and t_{q+1}), MTP (x_q, h_{q-1}), DFlash (g_q): cutting the history to 10
    tokens keeps rows that read only positions < 10; replacing states from 10 keeps rows before
    10 - state_offset."""
    s = PositionStates(4, state_offset, token_offset)
    assert s.put(0, rows(0, 300)) and s.n == 300 and len(s.data) >= 300  # grows
    s.written = 299
    s.cut(10)
    assert s.n == 10 and s.written == cut_to
    s.written = 10
    assert s.put(10, rows(10, 12)) and s.written == min(10, put_from)
    assert not s.put(20, rows(20, 21)) and s.n == 12  # a gap: nothing stored


def test_rows_read_the_offset_states_and_zeros_before_zero():
    s = PositionStates(4, state_offset=-1, token_offset=0)
    s.put(0, rows(0, 5))
    got = s.rows(0, 3)
    assert got.dtype == torch.float32 and got[:, 0].tolist() == [0.0, 0.0, 1.0]  # h_{-1} = 0, h_0, h_1
    assert PositionStates(4).rows(0, 0).shape == (0, 4)


def test_committed_rows_drop_rejected_draft_rows():
    seq = SequenceView(1, tuple(range(13)), 5, 0.0)
    hidden = {0: torch.zeros(5, 4)}  # 1 pending token + a draft of 4
    assert committed_rows(seq, Draft((1, 2, 3, 4), "x"), 2, hidden, 9) == 3
    assert committed_rows(seq, None, 0, {}, 9) == 0


def test_chain_stops_at_p_min_and_n_max_and_keeps_probabilities():
    chain = DraftChain(0, 1, DraftLimits(n_max=2, n_min=0, p_min=0.3), 1.0, None)
    assert chain.add(5, 0.9, torch.ones(3))
    assert not chain.add(6, 0.8, torch.ones(3))  # n_max
    draft = chain.draft("x")
    assert draft.tokens == (5, 6) and draft.spec_type == "x" and torch.equal(draft.probs, torch.ones(2, 3))
    low = DraftChain(0, 1, DraftLimits(n_max=4, n_min=2, p_min=0.3), 0.0, None)
    assert low.add(5, 0.9, None) and not low.add(6, 0.1, None)
    assert low.tokens == [5] and low.draft("x") is None  # below n_min


def test_pick_token_maps_columns_and_returns_the_sampled_distribution():
    logits = torch.tensor([0.0, 3.0, 1.0])
    columns = torch.tensor([7, 2, 9])
    token, p, probs = pick_token(logits, 0.0, None, columns, 10)
    assert token == 2 and p == pytest.approx(float(torch.softmax(logits, -1)[1])) and probs is None
    token, p, probs = pick_token(logits, 1.0, torch.Generator().manual_seed(0), columns, 10)
    assert token in (7, 2, 9) and probs.shape == (10,) and float(probs.sum()) == pytest.approx(1.0)
    assert probs[[0, 1, 3, 4, 5, 6, 8]].abs().sum() == 0 and float(probs[token]) == pytest.approx(p)
    token, _, probs = pick_token(torch.tensor([0.0, 1.0, 9.0, 9.5]), 0.0, None, None, 3)  # padded head rows never picked
    assert token == 2


@pytest.mark.parametrize("raw, window", [('{"window": 256, "steps": 10}', 256), ('{"steps": 10}', 0), (None, 0),
                                         ("not json", 0), ('[1, 2]', 0), ('{"window": -5}', 0)])
def test_trained_window_reads_what_speculant_train_records(raw, window):
    assert trained_window({} if raw is None else {TRAINING_KEY: raw}) == window


def test_skip_unread_rows_moves_the_cache_up_without_writing():
    cache, state = KVCache(1, 2, 8, 1024, dtype=torch.float16), PositionStates(4)
    cache.reserve(0, 10)
    cache.write(0, 0, 0, torch.ones(2, 10, 8, dtype=torch.float16), torch.ones(2, 10, 8, dtype=torch.float16))
    cache.commit(0, 10)
    assert skip_unread_rows(cache, 0, 5, state) == 10 and state.computed_from == 0  # rows already there are kept
    assert skip_unread_rows(cache, 0, 300, state) == 300 and cache.length(0) == 300 and state.computed_from == 300
    k, _ = cache.buffers(0, 0)
    assert bool((k[:, :10] == 1).all()) and bool((k[:, 10:300] == 0).all())  # nothing written past the old rows
    cache.commit(0, 340)  # rows 300..339 computed
    assert skip_unread_rows(cache, 0, 320, state) == 340  # the window reads computed rows only
    cache.truncate(0, 310)  # the history is cut back: a window from 200 reads rows the skip left out
    assert skip_unread_rows(cache, 0, 200, state) == 200 and cache.length(0) == 200 and state.computed_from == 200


def test_taps_are_encoded_a_piece_at_a_time_into_the_states():
    """store_encoded_taps: the taps side by side in tap order, ENCODE_ROWS rows a call at most, the
    first n_valid rows only; nothing where a tap is missing or the rows start past the states."""
    n = 2 * drafting.ENCODE_ROWS + 7
    hidden = {layer: torch.randn(n + 3, 4) for layer in (1, 5, 9)}
    calls = []

    def encode(x):
        calls.append(len(x))
        return x[:, :6] * 2  # row by row, so any split gives the same rows

    state = PositionStates(6, state_offset=0, token_offset=1)
    store_encoded_taps(state, 0, hidden, (9, 1), n, encode)
    assert state.n == n and max(calls) <= drafting.ENCODE_ROWS and sum(calls) == n
    want = torch.cat([hidden[9][:n], hidden[1][:n]], dim=-1)[:, :6] * 2
    assert torch.equal(state.data[:n].float(), want.to(state.data.dtype).float())
    calls.clear()
    store_encoded_taps(state, 0, {1: hidden[1]}, (9, 1), n, encode)  # tap 9 missing
    store_encoded_taps(state, n + 1, hidden, (9, 1), 5, encode)  # a gap after position n
    assert calls == [] and state.n == n
