"""Speculation on the real 1.5B target: every spec type gives plain decoding's tokens at
temperature 0 on the public workloads (the first 48 tokens of each, to keep CI short)."""
import json

import pytest

from conftest import REFERENCE_DIR, TARGET, load_cached
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators

pytestmark = pytest.mark.realmodel

N_TOKENS = 48
SPEC_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-simple,ngram-mod"]
WORKLOADS = [r["name"] for r in json.loads((REFERENCE_DIR / "qwen2.5-coder-1.5b.public.json").read_text())["references"]]


def prompt(name):
    refs = json.loads((REFERENCE_DIR / "qwen2.5-coder-1.5b.public.json").read_text())["references"]
    return next(r["prompt_tokens"] for r in refs if r["name"] == name)


_plain: dict = {}


def plain_tokens(model, name):
    if name not in _plain:
        _plain[name] = list(Engine(model, EngineConfig(n_ctx=2048)).generate(prompt(name), N_TOKENS))
    return _plain[name]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("spec_type", SPEC_TYPES)
def test_spec_type_reproduces_plain_decoding(spec_type, workload):
    model = load_cached(TARGET)
    # Small n-gram sizes so drafts happen within 48 tokens; the adaptive controller off so every
    # draft is verified in full (the hardest case for exactness).
    options = {"spec_ngram_simple_size_n": 3, "spec_ngram_map_k_size_n": 3, "spec_ngram_map_k4v_size_n": 3,
               "spec_ngram_mod_n_match": 4, "spec_ngram_mod_n_min": 1}
    speculators = build_speculators(spec_type.split(","), options, target=model)
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=16, adaptive=False), speculators)
    got = list(engine.generate(prompt(workload), N_TOKENS))
    assert got == plain_tokens(model, workload)
    if workload == "code-edit-bisect":  # the output copies the input: drafts must have been accepted
        assert engine.last_sequence.stats.n_accepted > 0
