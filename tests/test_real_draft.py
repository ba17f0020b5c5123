"""draft-simple on the real models: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B gives plain
decoding's tokens at temperature 0 on the public workloads (the first 48 tokens of each), alone,
chained after ngram-simple, and for all workloads decoded together on the one draft context."""
import pytest

from conftest import DRAFT, GEMMA, TARGET, load_cached, model_path
from speculant import SpeculantError
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators
from test_real_speculation import (N_TOKENS, PREFILLED, WORKLOADS, add_from_prompt_rows, generate_from_prompt_rows,
                                  plain_tokens, prompt)

pytestmark = pytest.mark.realmodel


def speculators(model, spec_type):
    return build_speculators(spec_type.split(","), {"spec_ngram_simple_size_n": 3}, target=model,
                             draft_model=str(model_path(DRAFT)))


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("spec_type", ["draft-simple", "ngram-simple,draft-simple"])
def test_draft_model_reproduces_plain_decoding(spec_type, workload):
    model = load_cached(TARGET)
    # The adaptive controller off so every draft is verified in full (the hardest case for exactness).
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=8, adaptive=False), speculators(model, spec_type))
    seq = generate_from_prompt_rows(engine, model, workload)
    assert seq.tokens[seq.n_prompt:] == plain_tokens(model, workload)
    stats = engine.spec_stats["draft-simple"]
    assert stats.drafts > 0 and stats.accepted_at[0] > stats.drafts // 2  # the 0.5B mostly agrees with the 1.5B


def test_draft_model_all_workloads_together():
    model = load_cached(TARGET)
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=4, adaptive=False), speculators(model, "draft-simple"))
    seqs = [engine.add(prompt(w), N_TOKENS) if w == PREFILLED else add_from_prompt_rows(engine, model, w) for w in WORKLOADS]
    while engine.active():
        engine.step()
    for w, seq in zip(WORKLOADS, seqs):
        assert seq.spec_error is None and seq.tokens[seq.n_prompt:] == plain_tokens(model, w), w


def test_incompatible_draft_model_is_refused():
    model = load_cached(TARGET)
    with pytest.raises(SpeculantError, match="cannot draft for .*vocabulary types differ"):
        build_speculators(["draft-simple"], {}, target=model, draft_model=str(model_path(GEMMA)))
