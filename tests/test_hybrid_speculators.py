"""Every speculator on the hybrid targets (lfm2, qwen35), several sequences at once: greedy output
identical to plain decoding, with per-row rollback and with checkpoint/replay, and draft-simple
with a hybrid draft model as well as a plain one."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.plugins import default_registry
from speculant.speculator import build_speculators
from speculant.testing.speculators import plugin_options
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_eagle3.testing import write_random_head

ARCHS = ("lfm2", "qwen35")
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "suffix", "draft-simple", "draft-simple:qwen2", "eagle3")


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    torch.set_num_threads(1)
    target_path = write_tiny_model(d / "target.gguf", arch, n_layers=4, n_ctx=2048, seed=1)
    draft_path = write_tiny_model(d / "draft.gguf", arch, n_layers=2, n_ctx=2048, seed=1)  # the target's first layers
    plain_draft = write_tiny_model(d / "plain-draft.gguf", "qwen2", n_layers=1, n_ctx=2048, seed=1)
    target = load_model(target_path, progress=False)
    head_path, _, _ = write_random_head(d / "head.gguf", target_path, n_draft_vocab=300)
    return SimpleNamespace(arch=arch, target=target, draft=draft_path, plain_draft=plain_draft, head=head_path)


def prompts(n=3, length=60, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):  # a repeated phrase: the n-gram speculators find drafts in it
        phrase = rng.integers(0, 256, 6).tolist()
        out.append((phrase * (length // 6 + 1))[:length])
    return out


def run(model, n, speculators=(), **config):
    engine = Engine(model, EngineConfig(n_ctx=2048, **{"draft_n_max": 5, "adaptive": False, **config}), list(speculators))
    seqs = [engine.add(p, n) for p in prompts()]
    while engine.active():
        engine.step()
    return engine, [s.tokens[s.n_prompt:] for s in seqs]


def speculators(hybrid, spec_type):
    """Built as the contract suite builds them: with the options that make each draft on short
    repeated segments (`contract_options`)."""
    name, _, which = spec_type.partition(":")
    draft = {"draft-simple": hybrid.plain_draft if which == "qwen2" else hybrid.draft, "eagle3": hybrid.head}.get(name)
    registry = default_registry()
    options = {**plugin_options(registry), "seed": 3,
               **getattr(registry.get("speculator", name), "contract_options", {})}
    return build_speculators([name], options, target=hybrid.target, draft_model=draft, registry=registry)


@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
@pytest.mark.parametrize("spec_type", SPEC_TYPES)
def test_speculator_on_hybrid_target_gives_plain_tokens(hybrid, spec_type, use_checkpoints):
    _, truth = run(hybrid.target, 24)
    engine, got = run(hybrid.target, 24, speculators(hybrid, spec_type), spec_use_checkpoints=use_checkpoints)
    assert got == truth
    st = next(iter(engine.spec_stats.values()), None)
    assert st is not None and st.drafted > 0, f"{spec_type} never drafted: the test proves nothing"
    r = engine.recurrent_stats
    if st.accepted < st.drafted:  # some draft was cut: the way back is the one asked for
        assert (r.replays > 0) == use_checkpoints and (r.rollbacks > 0) != use_checkpoints


def test_hybrid_rollback_paths_were_taken(hybrid):
    """The parametrized test above checks the way back only where a draft was cut: make sure
    one was, for each mode, on this target."""
    for use_checkpoints in (False, True):
        engine, _ = run(hybrid.target, 24, speculators(hybrid, "draft-simple"), spec_use_checkpoints=use_checkpoints)
        r = engine.recurrent_stats
        assert (r.replays if use_checkpoints else r.rollbacks) > 0, r
