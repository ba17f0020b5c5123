"""What a hidden-state drafter did during an engine run, for the MTP, EAGLE3 and DFlash tests (and
what their trainers' losses should be).

A spy replaces the speculator's `propose_batch` before the engine registers its hooks, keeping the
hook marker of the method it wraps (the registry finds hook methods by it).
"""
from __future__ import annotations

import importlib


def record_drafts(spec, what=lambda request, draft: (request.seq.tokens, draft)) -> list:
    """`what(request, draft)` for every draft `spec` proposes from now on (no draft, or `what`
    giving None: nothing kept). Default: (the history it was drafted from, the draft)."""
    seen, original = [], spec.propose_batch

    def spy(requests):
        out = original(requests)
        for request, draft in zip(requests, out):
            if draft is not None and (item := what(request, draft)) is not None:
                seen.append(item)
        return out
    spy.speculant_impl = original.speculant_impl
    spec.propose_batch = spy
    return seen


def draft_tokens(request, draft) -> tuple[int, ...]:
    return draft.tokens


def windowed_run(spec, run_engine, skip=True):
    """(drafts, head rows computed, output) of `run_engine(spec)` (one greedy request, its output
    tokens) with a hidden-state speculator whose plugin catches up through skip_unread_rows
    (MTP, EAGLE3); `skip` False: every prompt row written, as without a window."""
    module = importlib.import_module(type(spec).__module__)
    rows = []
    decode = spec.head.decode
    spec.head.decode = lambda batch, *a, **k: rows.append(len(batch)) or decode(batch, *a, **k)
    seen = record_drafts(spec, draft_tokens)
    saved = module.skip_unread_rows
    if not skip:
        module.skip_unread_rows = lambda context, seq_id, first_read, state: context.length(seq_id)
    try:
        out = run_engine(spec)
    finally:
        module.skip_unread_rows = saved
        spec.head.decode = decode  # the head is loaded once per process
    return seen, sum(rows), out


def assert_top1_mixed(outs, top1, soft, mixed, weight: float) -> None:
    """An unrolled trainer's `--top1-weight`: each step j's mixed loss is (1 - weight) * its soft
    loss + weight * the cross-entropy of its logits `outs[j]` against the target's top-1 (the
    window's labels top1[:, j : j + T]), over the rows that have one (top-1 >= 0); and the hard
    term differs from the soft one, so the check can fail."""
    import torch
    import torch.nn.functional as F

    for j, logits in enumerate(outs):
        t1 = top1[:, j : j + logits.shape[1]]
        ok = t1 >= 0
        hard = -F.log_softmax(logits.float(), -1).gather(-1, t1.clamp_min(0).unsqueeze(-1)).squeeze(-1)[ok].mean()
        assert torch.allclose(mixed[j], (1 - weight) * soft[j] + weight * hard, atol=1e-5)
        assert not torch.allclose(soft[j], hard)
