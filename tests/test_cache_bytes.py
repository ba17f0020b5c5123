"""What a kept conversation costs (``CachedPrompt.n_bytes``, what the server's ``--cache-ram``
counts): the target's rows and everything the speculators hold for it (``state_nbytes``), and
for an entry read from a slot file the hidden and speculator states it carries until it is
continued."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import structlog
import torch

from speculant import hookimpl, load_model
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_pair

from speculant_dflash.testing import write_random_head as write_dflash_head
from speculant_eagle3.testing import write_random_head as write_eagle3_head
from speculant_mtp.testing import write_random_sidecar


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache-bytes")
    torch.set_num_threads(1)
    target_path, draft_path = write_tiny_pair(d, "qwen2", target_layers=4, n_embd=64, n_ctx=2048)
    heads = {"draft-simple": draft_path,
             "eagle3": write_eagle3_head(d / "eagle3.gguf", target_path, n_draft_vocab=300)[0],
             "mtp": write_random_sidecar(d / "mtp.gguf", target_path, seed=1, n_ff=96)[0],
             "dflash": write_dflash_head(d / "dflash.gguf", target_path, n_draft_vocab=300, block_size=4)[0]}
    return SimpleNamespace(target=load_model(target_path, progress=False), heads=heads)


def engine_with(tiny, speculators) -> Engine:
    return Engine(tiny.target, EngineConfig(n_ctx=1024, draft_n_max=4, adaptive=False, spec_deadline=None), speculators)


def kept(engine: Engine, prompt: list[int]):
    seq = engine.add(prompt, 12)
    while engine.active():
        engine.step()
    return engine.keep(seq)


PROMPT = np.random.default_rng(3).integers(0, 256, 150).tolist()


@pytest.mark.parametrize("spec_type", ["draft-simple", "eagle3", "mtp", "dflash"])
def test_a_kept_conversation_counts_what_its_drafter_holds(tiny, spec_type):
    (spec,) = build_speculators([spec_type], {"seed": 3}, target=tiny.target, draft_model=tiny.heads[spec_type])
    engine = engine_with(tiny, [spec])
    entry = kept(engine, PROMPT)
    target_bytes = engine.context.nbytes(entry.seq_id)
    held = spec.state_nbytes(entry.seq_id)
    # the drafter's own rows: its context's KV buffers (and a head's position states)
    assert held >= spec.context.nbytes(entry.seq_id) > 0
    assert entry.n_bytes == target_bytes + held
    engine.drop_cached(entry)
    assert spec.state_nbytes(entry.seq_id) == 0


def test_an_adopted_entry_counts_the_states_it_carries(tiny):
    (spec,) = build_speculators(["eagle3"], {"seed": 3}, target=tiny.target, draft_model=tiny.heads["eagle3"])
    saving = engine_with(tiny, [spec])
    entry = kept(saving, PROMPT)
    states = saving.speculator_states(entry)
    kv = {k: v[:, : len(entry.tokens)].clone() for k, v in saving.context.get_state(entry.seq_id).items()}
    (other,) = build_speculators(["eagle3"], {"seed": 3}, target=tiny.target, draft_model=tiny.heads["eagle3"])
    restored = engine_with(tiny, [other])
    bare = restored.adopt(list(entry.tokens), entry.row_prompts, kv)
    carrying = restored.adopt(list(entry.tokens), entry.row_prompts, kv, spec_states=states)
    state_bytes = sum(t.nbytes for s in states.values() for t in s.tensors.values())
    assert state_bytes > 0 and carrying.n_bytes == bare.n_bytes + state_bytes
    hidden = {2: torch.zeros(len(entry.tokens), 64)}
    with_hidden = restored.adopt(list(entry.tokens), entry.row_prompts, kv, hidden=hidden)
    assert with_hidden.n_bytes == bare.n_bytes + hidden[2].nbytes


class _Holder:
    """A speculator that says it holds a fixed amount for every sequence, or fails to say."""

    spec_type = "holder"

    def __init__(self, nbytes):
        self.nbytes = nbytes

    @hookimpl
    def propose(self, seq, limits):
        return None

    @hookimpl
    def state_nbytes(self, seq_id):
        if isinstance(self.nbytes, Exception):
            raise self.nbytes
        return self.nbytes


def test_speculators_sum_and_a_failing_one_counts_nothing(tiny):
    prompt = PROMPT[:40]
    alone = kept(engine_with(tiny, []), prompt).n_bytes
    assert kept(engine_with(tiny, [_Holder(1000), _Holder(None), _Holder(234)]), prompt).n_bytes == alone + 1234
    with structlog.testing.capture_logs() as logs:
        entry = kept(engine_with(tiny, [_Holder(RuntimeError("broken")), _Holder(7)]), prompt)
    assert entry.n_bytes == alone + 7
    assert [e["spec_type"] for e in logs if e["event"] == "state_nbytes_failed"] == ["holder"]

