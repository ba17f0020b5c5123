"""LFM2 (speculant_transformer.lfm2) on tiny random GGUFs: bit-exact batching, the recurrent
state cut back inside a forward and checkpointed, speculation equal to plain decoding, and
llama.cpp's own greedy output (tests/data/llamacpp-outputs/hybrid, scripts/hybrid_references.py).

Agreement with llama.cpp, as stated tolerances on the top-5 log-probabilities:

- Q8_0, Q4_K (the CPU backend's native kernels, llama.cpp's arithmetic, and the conv's fused
  multiply-adds as ggml_ssm_conv's compiled code does them): QUANT_TOL = 1e-5. The logits are
  llama.cpp's; what is left is the softmax: llama-server sums exp() in float over a partially
  sorted vocabulary, we take torch's log_softmax (observed at most 2e-6, one float ulp at |lp| ~ 8).
- F32: the CPU backend computes float weights in bf16 by design (DenseLinear), which is not
  llama.cpp's F32 matmul, so the F32 cases run on a float32-linear test backend (native attention,
  fp16 KV, norms and rope as llama.cpp): F32_TOL = 3e-3. ggml's F32 dot products sum in another
  order; a 1-ulp difference in q, k or v moves its fp16 rounding by 2^-11 (observed 9e-4).

llama-server gives no probabilities for a token after which the text ends inside a UTF-8
character (server-context.cpp: `incomplete`), so its lists are matched to our positions by that
rule (`llama_server_steps`); tokens are compared in full.
"""
from __future__ import annotations

import os

import attrs
import pytest
import torch

from speculant import Batch, Draft, HybridCache, ModelFileError, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.plugins import load_registry
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model

from gguf_edit import T_ARRAY, rewrite, u32, value
from hybrid_cases import LFM2_CASES
from hybrid_refs import llama_server_steps, registry_with_f32, max_logprob_diff, reference

QUANT_TOL = 1e-5
F32_TOL = 3e-3
K_DIMS = dict(n_embd=256, n_ff=512, n_head=4, n_kv_head=2)  # K-quants: rows multiple of 256
# (qtype, writer kwargs): attention at 1 and 3, or a conv block last with kernel 4
VARIANTS = {
    "F32": ("F32", {}),
    "Q8_0": ("Q8_0", {}),
    "Q4_K": ("Q4_K", K_DIMS),
    "Q8_0-conv-last": ("Q8_0", {"attn_layers": [0, 2], "l_cache": 4}),
}
TOKENS = [5, 77, 300, 12, 9, 44, 123, 8, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263, 100, 3]


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    d = tmp_path_factory.mktemp("lfm2")
    cache = {}

    def get(variant: str):
        if variant not in cache:
            qtype, kw = VARIANTS[variant]
            path = write_tiny_model(d / f"{variant}.gguf", "lfm2", qtype=qtype, seed=3, n_layers=4, **kw)
            cache[variant] = load_model(str(path), progress=False)
        return cache[variant]
    return get


def feed(model, ctx, seq_id, start, toks, chunk, prompt_len=0):
    """Feed toks in forwards of `chunk` rows, logits for all rows -> [len(toks), n_vocab]."""
    out = []
    for i in range(0, len(toks), chunk):
        b = Batch.for_sequence(seq_id, start + i, toks[i : i + chunk], logits="all", prompt_len=prompt_len)
        out.append(model.forward(b, ctx).logits)
    return torch.cat(out)


def test_loads_as_hybrid(model_of):
    model = model_of("Q8_0-conv-last")
    c = model.config
    assert model.info.architecture == "lfm2" and model.state_kind == "recurrent"
    assert c.recurrent == (False, True, False, True) and c.l_cache == 4
    ctx = model.new_context(64)
    assert isinstance(ctx, HybridCache) and ctx.state_kind == "recurrent"
    assert ctx.state_shapes == {1: ((3, c.n_embd),), 3: ((3, c.n_embd),)}
    assert ctx.kv.n_layers == 2


@pytest.mark.parametrize("change,message", [
    ({"lfm2.shortconv.l_cache": None}, "shortconv.l_cache' is missing"),
    ({"lfm2.shortconv.l_cache": u32(1)}, "l_cache' must be an integer of at least 2"),
    ({"lfm2.attention.head_count_kv": (T_ARRAY, value(T_ARRAY, (5, [0, 2, 0])))}, "must hold 4 non-negative integers"),
    ({"lfm2.attention.head_count_kv": (T_ARRAY, value(T_ARRAY, (5, [0, 2, 0, 4])))}, "differs between attention layers"),
    ({"lfm2.attention.head_count_kv": (T_ARRAY, value(T_ARRAY, (5, [0, 3, 0, 3])))}, "not a multiple"),
    ({"lfm2.attention.head_count_kv": (T_ARRAY, value(T_ARRAY, (5, [2, 2, 0, 2])))}, "attn_q.weight' is missing"),
    ({"lfm2.attention.layer_norm_rms_epsilon": None}, "layer_norm_rms_epsilon' is missing"),
])
def test_broken_metadata_is_a_model_file_error(tmp_path, change, message):
    """What llama.cpp's loader refuses, refused at load with the key named (not on the first request)."""
    path = write_tiny_model(tmp_path / "m.gguf", "lfm2", n_layers=4)
    with pytest.raises(ModelFileError, match=message):
        load_model(rewrite(path, tmp_path / "broken.gguf", change), progress=False)


# --- (a) batch invariance, bit for bit ------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rows_compute_alike_in_any_batch(model_of, variant):
    """A row's logits do not depend on how many rows its forward has, nor on another sequence's
    rows beside it (prompt rows 0..11, decode rows after: both of the backend's row kinds)."""
    model = model_of(variant)
    n_prompt = 12
    ref = feed(model, model.new_context(64), 0, 0, TOKENS, 1, n_prompt)
    for chunk in (2, 3, 4, 7, 16, len(TOKENS)):
        got = feed(model, model.new_context(64), 0, 0, TOKENS, chunk, n_prompt)
        assert torch.equal(got, ref), f"chunks of {chunk}"
    # with another sequence (other tokens, other chunking) in every forward, on either side
    other = [(t * 7 + 3) % 500 for t in TOKENS]
    ctx = model.new_context(64)
    mine, pos, pos1 = [], 0, 0
    for i, chunk in enumerate((3, 1, 5, 2, 6, 3)):
        b0 = Batch.for_sequence(0, pos, TOKENS[pos : pos + chunk], logits="all", prompt_len=n_prompt)
        k = 1 + i % 4
        b1 = Batch.for_sequence(1, pos1, other[pos1 : pos1 + k], logits="all", prompt_len=5)
        out = model.forward(Batch.concat([b1, b0] if i % 2 else [b0, b1]), ctx).logits
        mine.append(out[len(b1):] if i % 2 else out[: len(b0)])
        pos, pos1 = pos + chunk, pos1 + k
    assert torch.equal(torch.cat(mine), ref[:pos])


# --- (b) the recurrent state cut back and checkpointed ------------------------------------------
def conv_states(model, ctx, seq_id):
    return {layer: ctx.read(seq_id, layer)[0].clone() for layer in ctx.state_shapes}


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K", "Q8_0-conv-last"])
def test_truncate_inside_last_forward_is_a_recompute(model_of, variant):
    """A verification-like forward of 6 rows, cut back to each of its rows (per-row states), then
    3 more rows: their logits and the states are bitwise those of a run that never saw the cut
    rows. Two sequences share every forward and are cut differently."""
    model = model_of(variant)
    prompt, verify, nxt = TOKENS[:8], TOKENS[8:14], TOKENS[14:17]
    other = [(t * 5 + 1) % 500 for t in TOKENS]
    for keep in range(len(verify) + 1):
        keep1 = (keep + 3) % (len(verify) + 1)
        ctx = model.new_context(64)
        model.forward(Batch.concat([Batch.for_sequence(0, 0, prompt, "none"), Batch.for_sequence(1, 0, other[:8], "none")]), ctx)
        model.forward(Batch.concat([Batch.for_sequence(1, 8, other[8:14], "all"), Batch.for_sequence(0, 8, verify, "all")]), ctx)
        assert ctx.rollback_floor(0) == 8
        ctx.truncate(0, 8 + keep)
        ctx.truncate(1, 8 + keep1)
        assert ctx.length(0) == ctx.kv.length(0) == 8 + keep
        if keep < len(verify):
            with pytest.raises(ValueError):
                ctx.truncate(0, 8 + keep - 1)  # the per-row states are spent: one use
        cut = conv_states(model, ctx, 0)
        b0 = Batch.for_sequence(0, 8 + keep, nxt, "all")
        b1 = Batch.for_sequence(1, 8 + keep1, other[14:17], "all")
        out = model.forward(Batch.concat([b0, b1]), ctx).logits

        fresh = model.new_context(64)
        model.forward(Batch.for_sequence(0, 0, prompt + verify[:keep], "none"), fresh)
        assert all(torch.equal(state, cut[layer]) for layer, state in conv_states(model, fresh, 0).items())
        ref0 = model.forward(Batch.for_sequence(0, 8 + keep, nxt, "all"), fresh).logits
        model.forward(Batch.for_sequence(1, 0, other[: 8 + keep1], "none"), fresh)
        ref1 = model.forward(Batch.for_sequence(1, 8 + keep1, other[14:17], "all"), fresh).logits
        assert torch.equal(out[:3], ref0), f"seq 0 kept {keep}"
        assert torch.equal(out[3:], ref1), f"seq 1 kept {keep1}"


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K"])
def test_per_row_states_are_the_states_of_shorter_runs(model_of, variant):
    model = model_of(variant)
    ctx = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, TOKENS[:10], "last"), ctx)
    rows = {layer: per_row[0] for layer, per_row in ctx.seqs[0].rows.items()}
    for j in range(1, 11):
        fresh = model.new_context(64)
        model.forward(Batch.for_sequence(0, 0, TOKENS[:j], "last"), fresh)
        for layer, state in conv_states(model, fresh, 0).items():
            assert torch.equal(rows[layer][j - 1], state), (layer, j)


def test_rows_not_wanted_are_not_kept(model_of):
    model = model_of("Q8_0")
    ctx = model.new_context(64)
    ctx.keep_rows = False
    model.forward(Batch.for_sequence(0, 0, TOKENS[:6], "last"), ctx)
    assert ctx.rollback_floor(0) == 6
    with pytest.raises(ValueError):
        ctx.truncate(0, 4)


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K"])
def test_save_restore_replays_exactly(model_of, variant):
    model = model_of(variant)
    prompt, first, second = TOKENS[:8], TOKENS[8:14], TOKENS[14:18]
    ctx = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, prompt, "none"), ctx)
    handle = ctx.save(0)
    assert handle.nbytes == ctx.state_nbytes() == sum(4 * (model.config.l_cache - 1) * model.config.n_embd
                                                      for r in model.config.recurrent if r)
    model.forward(Batch.for_sequence(0, 8, first, "all"), ctx)
    model.forward(Batch.for_sequence(0, 14, first[:2], "all"), ctx)  # past the per-row states
    ctx.restore(0, handle)
    assert ctx.length(0) == ctx.kv.length(0) == 8
    out = model.forward(Batch.for_sequence(0, 8, second, "all"), ctx).logits
    fresh = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, prompt, "none"), fresh)
    assert torch.equal(out, model.forward(Batch.for_sequence(0, 8, second, "all"), fresh).logits)


# --- (c) speculation through the engine equals plain decoding ------------------------------------
# A random model rarely repeats itself, so the n-gram speculators see prompts that do: a prompt,
# the model's own continuation of it, and the prompt again. The attention layers look back over a
# window of 4 tokens (the conv layers over 2), so after the second copy the model's output is
# the first continuation again, mostly (positions differ): drafts are accepted, then cut short.
BASE = [[5, 77, 300, 12, 9, 44, 123, 8, 42, 7, 11, 19], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]
NGRAM_OPTIONS = {"spec_ngram_simple_size_n": 4, "spec_ngram_simple_size_m": 8,
                 "spec_ngram_map_k_size_n": 4, "spec_ngram_map_k_size_m": 8}
VARIANTS |= {"Q8_0-swa": ("Q8_0", {"sliding_window": 4}), "Q4_K-swa": ("Q4_K", {**K_DIMS, "sliding_window": 4})}


def run_engine(model, prompts, n, speculators=(), **config):
    engine = Engine(model, EngineConfig(n_ctx=512, adaptive=False, **config), list(speculators))
    seqs = [engine.add(list(p), n) for p in prompts]
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    out = [s.tokens[s.n_prompt :] for s in seqs]
    drafted = sum(s.stats.n_drafted for s in seqs)
    accepted = sum(s.stats.n_accepted for s in seqs)
    for s in seqs:
        engine.release(s)
    return out, drafted, accepted


def repeating_prompts(model):
    first, _, _ = run_engine(model, BASE, 16)
    return [[1] + p + o[:16] + [3, 4] + p for p, o in zip(BASE, first)] + BASE


ENGINE_MODES = [{}]
if "spec_use_checkpoints" in {f.name for f in attrs.fields(EngineConfig)}:
    ENGINE_MODES.append({"spec_use_checkpoints": True})


@pytest.mark.parametrize("config", ENGINE_MODES, ids=lambda c: "checkpoints" if c else "default")
@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-map-k"])
@pytest.mark.parametrize("variant", ["Q8_0-swa", "Q4_K-swa"])
def test_ngram_speculation_equals_plain_decoding(model_of, variant, spec_type, config):
    """Four sequences decoding at once, greedy: the tokens with an n-gram speculator are the
    plain ones, and the speculator's drafts were both accepted and cut short."""
    model = model_of(variant)
    prompts = repeating_prompts(model)
    plain, _, _ = run_engine(model, prompts, 40)
    assert plain[:2] == [run_engine(model, [p], 40)[0][0] for p in prompts[:2]]  # concurrent = alone
    specs = build_speculators([spec_type], NGRAM_OPTIONS, registry=load_registry())
    got, drafted, accepted = run_engine(model, prompts, 40, specs, **config)
    assert got == plain
    assert drafted > accepted > 0, (drafted, accepted)


class Corrupted:
    """Drafts the plain continuation with every `every`-th token wrong: partial acceptances at
    every offset of a verification step."""

    spec_type = "corrupted"

    def __init__(self, truth: dict, every: int = 4, n: int = 6):
        self.truth, self.every, self.n = truth, every, n

    @hookimpl
    def propose(self, seq, limits):
        truth = self.truth[tuple(seq.tokens[: seq.n_prompt])]
        done = len(seq.tokens) - seq.n_prompt
        toks = list(truth[done : done + min(self.n, limits.n_max)])
        for i in range(len(toks)):
            if (done + i) % self.every == self.every - 1:
                toks[i] = (toks[i] + 1) % 500
        return Draft(tuple(toks), self.spec_type) if toks else None


@pytest.mark.parametrize("config", ENGINE_MODES, ids=lambda c: "checkpoints" if c else "default")
@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K", "Q8_0-conv-last"])
def test_partial_acceptance_equals_plain_decoding(model_of, variant, config):
    model = model_of(variant)
    prompts = [p[:n] for p, n in zip(BASE * 2, (12, 5, 1, 9))]
    plain, _, _ = run_engine(model, prompts, 30)
    spec = Corrupted({tuple(p): o for p, o in zip(prompts, plain)}, every=3 + len(config))
    got, drafted, accepted = run_engine(model, prompts, 30, [spec], **config)
    assert got == plain
    assert drafted > accepted > 0


# --- (d) llama.cpp's greedy output -------------------------------------------------------------
def _case_ids():
    return [c["name"] for c in LFM2_CASES]


@pytest.fixture(scope="module")
def ref_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("lfm2-ref")
    cache = {}

    def get(ref):
        if ref["case"] not in cache:
            path = write_tiny_model(os.path.join(d, f"{ref['case']}.gguf"), ref["arch"], **ref["writer"])
            f32 = ref["writer"].get("qtype", "F32") in ("F32", "F16", "BF16")
            cache[ref["case"]] = (load_model(path, backend="f32-linear", registry=registry_with_f32(), progress=False)
                                  if f32 else load_model(path, progress=False)), (F32_TOL if f32 else QUANT_TOL)
        return cache[ref["case"]]
    return get


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram-simple"])
@pytest.mark.parametrize("case", LFM2_CASES, ids=_case_ids())
def test_matches_llama_cpp(ref_model, case, speculate):
    ref = reference(case["name"])
    if ref is None:
        pytest.skip(f"no llama.cpp reference for {case['name']} (scripts/hybrid_references.py writes it)")
    assert ref["writer"] == case["writer"] and ref["arch"] == "lfm2"
    model, tol = ref_model(ref)
    specs = build_speculators(["ngram-simple"], {}, registry=load_registry()) if speculate else []
    engine = Engine(model, EngineConfig(n_ctx=1024, adaptive=False), specs)
    worst = 0.0
    for r in ref["results"]:
        seq = engine.add(list(r["prompt"]), len(r["tokens"]), logprobs=ref["n_probs"])
        while seq.finish_reason is None:
            engine.step()
        engine.release(seq)
        assert seq.tokens[seq.n_prompt :] == r["tokens"], f"prompt {r['prompt']}"
        if speculate:
            continue
        steps = llama_server_steps(model.tokenizer, r["tokens"])
        assert len(steps) == len(r["top_logprobs"])
        ours = [list(seq.logprobs[j].top) for j in steps]
        if tol == QUANT_TOL:  # llama.cpp's logits: the same top tokens in the same order
            assert [[t for t, _ in a] for a in r["top_logprobs"]] == [[t for t, _ in b] for b in ours]
        worst = max(worst, max_logprob_diff(r["top_logprobs"], ours))
    assert worst <= tol
