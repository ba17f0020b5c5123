"""The hidden-state drafters on the real target with the heads shipped in heads/ (EAGLE3, MTP,
DFlash): plain decoding's tokens at temperature 0 on the public workloads (the first 48 tokens of
each), alone, chained after suffix, and for all workloads decoded together; each head drafts
tokens the target accepts. A head not in heads/ skips its cases with the reason.

Most cases start from a prompt state (`Engine.adopt` with plain decoding's rows of the prompt and
its hidden states, computed once per workload, as a cold start's prefill computes and hands them
out) instead of prefilling up to 1280 tokens each; the free-quicksort-c prompt is prefilled by the
engine under test in every case, so the prefill path stays covered."""
from pathlib import Path

import pytest

from conftest import TARGET, load_cached
from speculant.engine import Engine, EngineConfig
from speculant.speculator import build_speculators
from test_prompt_cache import HiddenLog
from test_real_speculation import N_TOKENS, PREFILLED, WORKLOADS, add_from_prompt_rows, plain_tokens, prompt

pytestmark = pytest.mark.realmodel

HEADS = Path(__file__).parent.parent / "heads"
HEAD_FILES = {
    "eagle3": HEADS / "qwen2.5-coder-1.5b-instruct-eagle3.gguf",
    "mtp": HEADS / "mtp-qwen2.5-coder-1.5b-instruct.gguf",
    "dflash": HEADS / "dflash-qwen2.5-coder-1.5b-instruct.gguf",
}


def speculators(model, spec_type):
    head = HEAD_FILES[spec_type.split(",")[-1]]
    if not head.exists():
        pytest.skip(f"the head {head} is absent")
    return build_speculators(spec_type.split(","), {}, target=model, draft_model=str(head))


_prompt_hidden: dict = {}  # workload -> the hidden states of its prompt but the last token


def prompt_hidden(model, name):
    """The hidden states of every layer any shipped head taps, of the workload's prompt but its
    last token, as a cold start's prefill hands them out (once a session)."""
    if name not in _prompt_hidden:
        layers = sorted({l for h in HEAD_FILES if HEAD_FILES[h].exists() for l in speculators(model, h)[-1].hidden_layers})
        log = HiddenLog(layers)
        engine = Engine(model, EngineConfig(n_ctx=2048), [log])
        seq = engine.add(prompt(name), 1)
        while seq.finish_reason is None:
            engine.step()
        engine.release(seq)
        _prompt_hidden[name] = {l: log.rows(l, seq.n_prompt - 1) for l in layers}
    return _prompt_hidden[name]


def add_workload(engine, model, name):
    """Start the workload's sequence: from plain decoding's prompt rows and the prompt's hidden
    states (`adopt`), or cold for PREFILLED."""
    if name == PREFILLED:
        return engine.add(prompt(name), N_TOKENS)
    return add_from_prompt_rows(engine, model, name, prompt_hidden(model, name))


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("spec_type", ["eagle3", "suffix,eagle3", "mtp", "suffix,mtp", "dflash", "suffix,dflash"])
def test_head_reproduces_plain_decoding(spec_type, workload):
    model = load_cached(TARGET)
    # The adaptive controller off so every draft is verified in full (the hardest case for exactness).
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=4, adaptive=False), speculators(model, spec_type))
    seq = add_workload(engine, model, workload)
    while seq.finish_reason is None:
        engine.step()
    assert seq.tokens[seq.n_prompt:] == plain_tokens(model, workload)
    if "," not in spec_type:
        stats = engine.spec_stats[spec_type]
        # The head predicts the target: a random head's first tokens are (almost) never accepted,
        # the shipped ones' 12-45% of the time in these 48 tokens (docs/benchmarks.md).
        assert stats.drafts > 0 and stats.accepted_at[0] > stats.drafts // 10


@pytest.mark.parametrize("spec_type", ["eagle3", "mtp", "dflash"])
def test_head_all_workloads_together(spec_type):
    model = load_cached(TARGET)
    engine = Engine(model, EngineConfig(n_ctx=2048, draft_n_max=4, adaptive=False), speculators(model, spec_type))
    seqs = [add_workload(engine, model, w) for w in WORKLOADS]  # PREFILLED's prompt goes in while the others decode
    while engine.active():
        engine.step()
    for w, seq in zip(WORKLOADS, seqs):
        assert seq.spec_error is None and seq.tokens[seq.n_prompt:] == plain_tokens(model, w), w
