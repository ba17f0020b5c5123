"""Speculation on the real 1.5B target: every spec type gives plain decoding's tokens at
temperature 0 on the public workloads (the first 48 tokens of each, to keep CI short)."""
import json

import pytest

from conftest import REFERENCE_DIR, TARGET, load_cached
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators

pytestmark = pytest.mark.realmodel

N_TOKENS = 48
SPEC_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-simple,ngram-mod", "copy-edits,ngram-simple"]
WORKLOADS = [r["name"] for r in json.loads((REFERENCE_DIR / "qwen2.5-coder-1.5b.public.json").read_text())["references"]]


def prompt(name):
    refs = json.loads((REFERENCE_DIR / "qwen2.5-coder-1.5b.public.json").read_text())["references"]
    return next(r["prompt_tokens"] for r in refs if r["name"] == name)


_plain: dict = {}
_prompt_rows: dict = {}  # workload -> the target's rows of its prompt but the last token, from plain decoding


def plain_tokens(model, name):
    """Plain decoding's first N_TOKENS for the workload (once per session); keeps its prompt's rows."""
    if name not in _plain:
        engine = Engine(model, EngineConfig(n_ctx=2048))
        seq = engine.add(prompt(name), N_TOKENS)
        while seq.finish_reason is None:
            engine.step()
        _plain[name] = seq.tokens[seq.n_prompt:]
        n = seq.n_prompt - 1
        _prompt_rows[name] = {k: v[:, :n].clone() for k, v in engine.context.get_state(seq.seq_id).items()}
        engine.release(seq)
    return _plain[name]


# The workload whose prompt the tests that decode several workloads together prefill (50 tokens),
# while the others start from their prompt rows and decode: the prefill path stays covered.
PREFILLED = "free-quicksort-c"


def add_from_prompt_rows(engine, model, name, hidden=None, n_tokens=N_TOKENS):
    """Start the workload's sequence in `engine` from plain decoding's rows of its prompt (and,
    for speculators on hidden states, `hidden`: the prompt's, as `Engine.adopt` takes them), to
    generate n_tokens."""
    plain_tokens(model, name)
    p = prompt(name)
    seq = engine.add(p, n_tokens, cached=engine.adopt(p[:-1], ((0, len(p)),), _prompt_rows[name], hidden))
    assert seq.n_reused == len(p) - 1
    return seq


def generate_from_prompt_rows(engine, model, name):
    """What `engine` generates for the workload, starting from plain decoding's rows of its prompt
    (the prompt cache's `adopt`, then `add(..., cached=)`) instead of prefilling it again. Those
    are the rows a cold start computes, bit for bit (the prompt cache's own tests), and the
    speculators still `begin` on the whole prompt; what is skipped is the prefill of up to 1280
    tokens, which was most of each of these tests' time on a slow CPU (CI's budget). The last
    prompt token's row, and everything after it, is computed by the engine under test."""
    seq = add_from_prompt_rows(engine, model, name)
    while seq.finish_reason is None:
        engine.step()
    engine.release(seq)
    return seq


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("spec_type", SPEC_TYPES)
def test_spec_type_reproduces_plain_decoding(spec_type, workload):
    model = load_cached(TARGET)
    # Small n-gram sizes so drafts happen within 48 tokens; the adaptive controller off so every
    # draft is verified in full (the hardest case for exactness).
    options = {"spec_ngram_simple_size_n": 3, "spec_ngram_map_k_size_n": 3, "spec_ngram_map_k4v_size_n": 3,
               "spec_ngram_mod_n_match": 4, "spec_ngram_mod_n_min": 1,
               "spec_copy_edits_copies": True}  # copy-edits drafts the copies too: few edits repeat in 48 tokens
    speculators = build_speculators(spec_type.split(","), options, target=model)
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=16, adaptive=False), speculators)
    seq = generate_from_prompt_rows(engine, model, workload)
    assert seq.tokens[seq.n_prompt:] == plain_tokens(model, workload)
    if workload == "code-edit-bisect":  # the output copies the input: drafts must have been accepted
        assert seq.stats.n_accepted > 0
        first = spec_type.split(",")[0]
        assert engine.spec_stats[first].drafts > 0, f"{first} drafted nothing"


def test_copy_edits_drafts_the_next_records_of_a_table():
    """extract-table's answer writes the prompt's JSON records as Markdown rows: from its third
    row copy-edits drafts the next rows, values from the prompt (speculant_edits.records), and the
    tokens are plain decoding's."""
    model = load_cached(TARGET)

    def generate(speculators):  # from the prompt's rows, as the tests above (no prefill twice)
        engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=16, adaptive=False), speculators)
        seq = add_from_prompt_rows(engine, model, "extract-table", n_tokens=96)
        while seq.finish_reason is None:
            engine.step()
        engine.release(seq)
        return engine, seq.tokens[seq.n_prompt:]

    _, plain = generate([])
    engine, spec = generate(build_speculators(["copy-edits"], {}, target=model))
    assert spec == plain
    stats = engine.spec_stats["copy-edits"]
    assert stats.drafts > 0 and stats.accepted >= 40, stats  # rows 2-4 (47 of 96 tokens here)
