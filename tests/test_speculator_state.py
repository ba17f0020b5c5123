"""Speculators' own states saved beside the target's (the ``export_state`` / ``import_state``
hooks): a conversation restored from a slot file drafts as it would have in the process that
saved it, for every drafter on hidden states, and a state that is not a speculator's own is
refused."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import structlog
import torch

from speculant import SpeculatorState, load_model
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model

from speculant_dflash.testing import write_random_head as write_dflash_head
from speculant_eagle3.testing import write_random_head as write_eagle3_head
from speculant_mtp.testing import write_random_sidecar


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-state")
    torch.set_num_threads(1)
    target_path = write_tiny_model(d / "target.gguf", "qwen2", n_layers=4, n_embd=64, n_ctx=2048)
    heads = {"eagle3": write_eagle3_head(d / "eagle3.gguf", target_path, n_draft_vocab=300)[0],
             "eagle3-other": write_eagle3_head(d / "eagle3-other.gguf", target_path, n_draft_vocab=300, seed=5)[0],
             "mtp": write_random_sidecar(d / "mtp.gguf", target_path, seed=1, n_ff=96)[0],
             "dflash": write_dflash_head(d / "dflash.gguf", target_path, n_draft_vocab=300, block_size=4)[0]}
    return SimpleNamespace(target=load_model(target_path, progress=False), heads=heads)


def engine_with(tiny, spec_type: str, head: str) -> Engine:
    speculators = build_speculators([spec_type], {"seed": 3}, target=tiny.target, draft_model=tiny.heads[head])
    return Engine(tiny.target, EngineConfig(n_ctx=1024, draft_n_max=4, adaptive=False, spec_deadline=None), speculators)


def finish(engine: Engine, seq):
    while engine.active():
        engine.step()
    return seq.tokens[seq.n_prompt:], seq.stats.drafts


def first_turn(engine: Engine, prompt: list[int]):
    seq = engine.add(prompt, 12)
    finish(engine, seq)
    return engine.keep(seq)


@pytest.mark.parametrize("spec_type", ["eagle3", "mtp", "dflash"])
def test_a_restored_conversation_drafts_as_the_saving_process_would(tiny, spec_type):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, 150).tolist()
    saving = engine_with(tiny, spec_type, spec_type)
    entry = first_turn(saving, prompt)
    states = saving.speculator_states(entry)
    assert set(states) == {spec_type} and isinstance(states[spec_type], SpeculatorState)
    kv = {k: v[:, : len(entry.tokens)].clone() for k, v in saving.context.get_state(entry.seq_id).items()}
    follow = list(entry.tokens) + rng.integers(0, 256, 20).tolist()
    # The saving process continues the conversation from its own cache ...
    kept_tokens, kept_drafts = finish(saving, saving.add(follow, 16, cached=entry))
    assert kept_drafts.drafted > 0
    # ... a fresh one from the file's parts, with the speculator's state, exactly alike ...
    restored = engine_with(tiny, spec_type, spec_type)
    adopted = restored.adopt(list(entry.tokens), entry.row_prompts, kv, spec_states=states)
    assert restored.speculator_states(adopted) == states  # saved again before use: the same
    with structlog.testing.capture_logs() as logs:
        tokens, drafts = finish(restored, restored.add(follow, 16, cached=adopted))
    assert not [e for e in logs if e["event"] == "adopted_without_hidden_states"]
    assert tokens == kept_tokens and (drafts.drafts, drafts.drafted, drafts.accepted) == \
        (kept_drafts.drafts, kept_drafts.drafted, kept_drafts.accepted)
    # ... and without it, the same tokens but no drafts (the drafter waits for states it lacks).
    bare = engine_with(tiny, spec_type, spec_type)
    with structlog.testing.capture_logs() as logs:
        tokens, drafts = finish(bare, bare.add(follow, 16, cached=bare.adopt(list(entry.tokens), entry.row_prompts, kv)))
    assert tokens == kept_tokens and drafts.drafted == 0
    assert [e["spec_types"] for e in logs if e["event"] == "adopted_without_hidden_states"] == [[spec_type]]


def test_a_state_is_taken_back_only_by_its_own_kind_of_speculator(tiny):
    prompt = np.random.default_rng(8).integers(0, 256, 90).tolist()
    saving = engine_with(tiny, "eagle3", "eagle3")
    entry = first_turn(saving, prompt)
    states = saving.speculator_states(entry)
    kv = {k: v[:, : len(entry.tokens)].clone() for k, v in saving.context.get_state(entry.seq_id).items()}
    follow = list(entry.tokens) + [5, 6, 7]
    cases = {"another head's encoding": ("eagle3", "eagle3-other", states),
             "a truncated tensor": ("eagle3", "eagle3", {"eagle3": SpeculatorState(
                 states["eagle3"].key, {"states": states["eagle3"].tensors["states"][:10]})}),
             "no tensor": ("eagle3", "eagle3", {"eagle3": SpeculatorState(states["eagle3"].key, {})})}
    for why, (spec_type, head, given) in cases.items():
        engine = engine_with(tiny, spec_type, head)
        with structlog.testing.capture_logs() as logs:
            tokens, drafts = finish(engine, engine.add(follow, 6, cached=engine.adopt(list(entry.tokens), entry.row_prompts,
                                                                                       kv, spec_states=given)))
        assert drafts.drafted == 0, why
        assert [e["spec_types"] for e in logs if e["event"] == "adopted_without_hidden_states"] == [["eagle3"]], why
    # Saved under an alias (draft-mtp for mtp): the state's key decides, not the name.
    saving = engine_with(tiny, "mtp", "mtp")
    mtp_entry = first_turn(saving, prompt)
    aliased = {"draft-mtp": saving.speculator_states(mtp_entry)["mtp"]}
    mtp_kv = {k: v[:, : len(mtp_entry.tokens)].clone() for k, v in saving.context.get_state(mtp_entry.seq_id).items()}
    mtp_follow = list(mtp_entry.tokens) + [5, 6, 7]
    kept = finish(saving, saving.add(mtp_follow, 6, cached=mtp_entry))
    engine = engine_with(tiny, "mtp", "mtp")
    restored = finish(engine, engine.add(mtp_follow, 6, cached=engine.adopt(list(mtp_entry.tokens), mtp_entry.row_prompts,
                                                                            mtp_kv, spec_states=aliased)))
    assert restored[0] == kept[0] and restored[1].drafted == kept[1].drafted > 0
    # A request that shares only part of the saved rows takes that part.
    engine = engine_with(tiny, "eagle3", "eagle3")
    short = list(entry.tokens[:60]) + [9, 9, 9, 9]
    adopted = engine.adopt(list(entry.tokens), entry.row_prompts, kv, spec_states=states)
    with structlog.testing.capture_logs() as logs:
        _, drafts = finish(engine, engine.add(short, 8, cached=adopted))
    assert not [e for e in logs if e["event"] == "adopted_without_hidden_states"] and drafts.drafted > 0
