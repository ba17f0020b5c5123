"""The real models against llama.cpp's reference outputs (tests/data/llamacpp-outputs).

Teacher-forced on llama.cpp's greedy completion, our top-1 token must equal llama.cpp's at >= 99%
of the positions where llama.cpp's top-1 log-probability beats its top-2 by more than 0.5; greedy
generation gives llama.cpp's first 32 tokens for each raw prompt; fed the way llama-server feeds
a model, the log-probabilities are llama.cpp's to the decimals its files keep.
"""
import json

import pytest
import torch

from conftest import DRAFT, GEMMA, REFERENCE_DIR, TARGET, load_cached
from speculant.engine import Engine, EngineConfig
from speculant.types import Batch

pytestmark = pytest.mark.realmodel

CASES = [
    (TARGET, "qwen2.5-coder-1.5b.raw.json"),
    (TARGET, "qwen2.5-coder-1.5b.public.json"),
    (DRAFT, "qwen2.5-coder-0.5b.raw.json"),
    (GEMMA, "gemma-3-270m.raw.json"),
]


def references(ref_file):
    return json.loads((REFERENCE_DIR / ref_file).read_text())["references"]


@pytest.mark.parametrize("model_name,ref_file", CASES, ids=[c[1] for c in CASES])
def test_teacher_forced_top1_agrees_with_llamacpp(model_name, ref_file):
    model = load_cached(model_name)
    agree = total = 0
    for ref in references(ref_file):
        prompt, completion = ref["prompt_tokens"], ref["completion_tokens"]
        context = model.new_context(len(prompt) + len(completion))
        out = model.forward(Batch.for_sequence(0, 0, prompt + completion, logits="all"), context)
        ours = out.logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].argmax(-1).tolist()
        for top1, tops in zip(ours, ref["top_logprobs"]):
            if len(tops) > 1 and tops[0][1] - tops[1][1] > 0.5:
                total += 1
                agree += top1 == tops[0][0]
    assert total > 50
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


RAW = [(TARGET, "qwen2.5-coder-1.5b.raw.json"), (DRAFT, "qwen2.5-coder-0.5b.raw.json"), (GEMMA, "gemma-3-270m.raw.json")]


GREEDY_CASES = [pytest.param(model, ref_file, ref["name"], id=f"{ref_file}:{ref['name']}")
                for model, ref_file in RAW for ref in references(ref_file)]


@pytest.mark.parametrize("model_name,ref_file,ref_name", GREEDY_CASES)
def test_greedy_reproduces_llamacpp_first_32_tokens(model_name, ref_file, ref_name):
    """Greedy decoding gives llama.cpp's first 32 tokens exactly, near-ties included: the CPU
    backend computes what llama.cpp's CPU backend computes, operation for operation."""
    model = load_cached(model_name)
    ref = next(r for r in references(ref_file) if r["name"] == ref_name)
    engine = Engine(model, EngineConfig(n_ctx=512))
    got = list(engine.generate(ref["prompt_tokens"], 32))
    want = ref["completion_tokens"][:32]
    diverge = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diverge is not None:
        (top1, lp1), (top2, lp2) = ref["top_logprobs"][diverge][:2]
        pytest.fail(f"{ref['name']}: left llama.cpp at token {diverge} (margin {lp1 - lp2:.3f}) for {got[diverge]}")


# gemma-3-270m is held to the greedy test only: for two of its three prompts, llama-server's
# log-probabilities (the reference files) differ from what llama.cpp's own llama_decode computes
# for the same tokens in one batch (which ours equal bit for bit, compared tensor by tensor), by up
# to 0.5; the greedy tokens agree. Where llama-server takes another path there is not known.
@pytest.mark.parametrize("model_name,ref_file", RAW[:2], ids=[r[1] for r in RAW[:2]])
def test_logprobs_are_llamacpp_when_fed_as_llamacpp_feeds(model_name, ref_file):
    """Fed as llama-server feeds a model (the prompt in one batch, then one token at a time), the
    gaps between our log-probabilities of llama.cpp's top-5 tokens are its gaps to the 4 decimals
    its reference files keep (two roundings: 1e-4), at every one of the first 32 positions: the
    logits are the same floats, not merely close. (Gaps, not the values: llama-server normalizes
    over its sampler's candidates, not the whole vocabulary, which shifts every value alike.)"""
    model = load_cached(model_name)
    for ref in references(ref_file):
        prompt, completion = ref["prompt_tokens"], ref["completion_tokens"][:32]
        context = model.new_context(len(prompt) + len(completion))
        rows = [Batch.for_sequence(0, 0, prompt, prompt_len=len(prompt))]
        rows += [Batch.for_sequence(0, len(prompt) + i, [t], prompt_len=len(prompt)) for i, t in enumerate(completion[:-1])]
        for i, batch in enumerate(rows):
            logits = model.forward(batch, context).logits[-1].double()
            (top, top_lp), *others = ref["top_logprobs"][i]
            for token, lp in others:
                gap = (logits[top] - logits[token]).item()
                assert abs(gap - (top_lp - lp)) <= 1.0001e-4, (ref["name"], i, token, gap, top_lp - lp)


def test_rows_do_not_depend_on_batch_size_real_model():
    """The bit-exactness premise on the real target: a row's logits are the same alone or with others."""
    model = load_cached(TARGET)
    prompt = references("qwen2.5-coder-1.5b.raw.json")[0]["prompt_tokens"]
    extra = [262, 421, 308, 2651, 220, 16, 510, 286, 470, 308, 198, 262, 770, 510, 286, 470]
    ctx = model.new_context(256)
    model.forward(Batch.for_sequence(0, 0, prompt), ctx)
    base = len(prompt)
    singles = []
    for i, t in enumerate(extra):
        singles.append(model.forward(Batch.for_sequence(0, base + i, [t]), ctx).logits[0])
    for k in (2, 5, 16):
        ctx.truncate(0, base)
        batched = model.forward(Batch.for_sequence(0, base, extra[:k], logits="all"), ctx).logits
        for i in range(k):
            assert torch.equal(batched[i], singles[i]), f"row {i} of {k} differs"
