"""Qwen3.5 (speculant_transformer.qwen35) on tiny random GGUFs: bit-exact batching, the recurrent
state (conv and DeltaNet) cut back inside a forward and checkpointed, speculation equal to plain
decoding, and llama.cpp's own greedy output (tests/data/llamacpp-outputs/hybrid, written by
scripts/hybrid_references.py from tests/hybrid_cases.py).

Agreement with llama.cpp, stated as tolerances on the top-5 log-probabilities:

- Q8_0, Q4_K, Q6_K (the CPU backend's native kernels, llama.cpp's arithmetic; the DeltaNet
  recurrence with ggml_gated_delta_net's rounding): QUANT_TOL = 1e-5. The logits are llama.cpp's
  bit for bit (compared tensor by tensor against a ggml eval-callback dump while writing this,
  every layer's output, prompt and decode rows); what is left is the softmax: llama-server sums
  exp() in float over a partially sorted vocabulary, we take torch's log_softmax (observed at most
  1.7e-6; the gaps between two tokens' log-probabilities, where the normalization cancels, agree
  to 4e-7). The same top tokens come in the same order.
- F32: the CPU backend computes float weights in bf16 by design (DenseLinear), which is not
  llama.cpp's F32 matmul, so the F32 case runs on a float32-linear test backend (the native
  attention, fp16 KV, norms, rope and SiLU as llama.cpp): F32_TOL = 1e-3 (observed 1.1e-4). ggml's
  F32 dot products sum in another order than torch's, and a 1-ulp difference in k or v moves its
  fp16 KV rounding.
  Bit equality is out of reach there without reimplementing ggml's F32 matmul.

llama-server gives no probabilities for a token after which the text ends inside a UTF-8
character, so its lists are matched to our positions by that rule (`llama_server_steps`); tokens
are compared in full. K-quant prompts avoid lengths llama-server splits off llama.cpp's batching
(tests/hybrid_cases.py).
"""
from __future__ import annotations

import os

import attrs
import pytest
import torch
import torch.nn.functional as F

from speculant import Batch, Draft, HybridCache, ModelFileError, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.plugins import load_registry
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_cpu.backend import CpuBackend

from gguf_edit import T_ARRAY, rewrite, u32, value
from hybrid_cases import QWEN35_CASES
from hybrid_refs import llama_server_steps, registry_with_f32, max_logprob_diff, reference

QUANT_TOL = 1e-5
F32_TOL = 1e-3
K_DIMS = dict(n_embd=256, n_ff=512, head_dim=64, ssm_d_state=32, ssm_n_group=4, ssm_dt_rank=8)
# (qtype, writer kwargs), all 4 layers: delta-net layers 0-2 and attention at 3, unless said
VARIANTS = {
    "F32": ("F32", {}),
    "Q8_0": ("Q8_0", {"recurrent_layers": [True, False, True, True], "nextn_layers": 1}),
    "Q4_K": ("Q4_K", K_DIMS),
    # a 128-value state (ggml's 64-value dot steps), one key head tiled over two value heads
    "Q8_0-wide": ("Q8_0", {"full_attention_interval": 2, "n_embd": 128, "n_ff": 256, "n_head": 2, "n_kv_head": 1,
                           "head_dim": 64, "ssm_d_state": 128, "ssm_n_group": 1, "ssm_dt_rank": 2}),
}
TOKENS = [5, 77, 300, 12, 9, 44, 123, 8, 42, 7, 7, 42, 7, 7, 260, 261, 262, 263, 100, 3]


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35")
    cache = {}

    def get(variant: str):
        if variant not in cache:
            qtype, kw = VARIANTS[variant]
            path = write_tiny_model(d / f"{variant}.gguf", "qwen35", qtype=qtype, seed=7, n_layers=4, **kw)
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


def states(ctx, seq_id):
    """Every recurrent layer's (conv state, DeltaNet state), copied."""
    return {layer: [t.clone() for t in ctx.read(seq_id, layer)] for layer in ctx.state_shapes}


def same_states(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for layer in a for x, y in zip(a[layer], b[layer]))


# --- loading -------------------------------------------------------------------------------------
def test_loads_as_hybrid_with_its_nextn_block(model_of):
    model = model_of("Q8_0")
    c = model.config
    assert model.info.architecture == "qwen35" and model.state_kind == "recurrent"
    assert c.recurrent == (True, False, True, True) and c.n_layers == 4 and c.n_nextn == 1
    assert (c.d_state, c.n_k_heads, c.n_v_heads, c.d_conv, c.conv_dim) == (16, 2, 4, 4, 2 * 32 + 64)
    assert c.n_rot == 4 and c.rope_sections == (1, 1, 0, 0)  # a quarter of head_dim 16; 2 pairs
    ctx = model.new_context(64)
    assert isinstance(ctx, HybridCache) and ctx.state_kind == "recurrent" and ctx.kv.n_layers == 1
    assert ctx.state_shapes == {i: ((c.conv_dim, 3), (4, 16, 16)) for i in (0, 2, 3)}
    # the NextN block (block_count counts it) is loaded and kept for a draft head, not run here
    (nextn,) = model.nextn
    assert nextn.layer == 4 and nextn.embed_tokens is None and nextn.shared_head_head is None
    assert nextn.shared_head_norm.shape == nextn.enorm.shape == nextn.hnorm.shape == (c.n_embd,)
    assert nextn.eh_proj(torch.ones(2, 2 * c.n_embd)).shape == (2, c.n_embd)
    assert nextn.block.mixer.wq(torch.ones(1, c.n_embd)).shape == (1, 2 * c.n_head * c.head_dim)
    # the other variants: the interval's pattern, and one layer of attention every two
    assert model_of("F32").config.recurrent == (True, True, True, False) and model_of("F32").nextn == []
    assert model_of("Q8_0-wide").config.recurrent == (True, False, True, False)


def test_a_stack_of_recurrent_layers_only(tmp_path):
    """Two layers under an interval of 4 are both DeltaNet layers (a truncated draft): no KV rows."""
    model = load_model(write_tiny_model(tmp_path / "m.gguf", "qwen35", n_layers=2), progress=False)
    assert model.config.recurrent == (True, True)
    ctx = model.new_context(32)
    a = feed(model, ctx, 0, 0, TOKENS[:6], 6)
    assert torch.equal(a, feed(model, model.new_context(32), 0, 0, TOKENS[:6], 1))


def _arr_i32(items):
    return (T_ARRAY, value(T_ARRAY, (5, items)))


@pytest.mark.parametrize("change,message", [
    ({"qwen35.ssm.state_size": None}, "ssm.state_size' is missing"),
    ({"qwen35.ssm.inner_size": u32(60)}, "ssm.inner_size' \\(60\\) is not"),
    ({"qwen35.ssm.time_step_rank": u32(3)}, "not a multiple"),
    ({"qwen35.rope.dimension_sections": None}, "dimension_sections' is missing"),
    ({"qwen35.rope.dimension_sections": _arr_i32([9, 9, 0, 0])}, "add up to more than the head size"),
    ({"qwen35.rope.dimension_count": u32(5)}, "must be even"),
    ({"qwen35.attention.recurrent_layers": (T_ARRAY, value(T_ARRAY, (7, [True, False])))}, "has 2 entries"),
    ({"qwen35.attention.recurrent_layers": (T_ARRAY, value(T_ARRAY, (7, [True, False, True, True])))},
     "'blk.1.attn_q.weight' is missing"),
    ({"qwen35.nextn_predict_layers": u32(4)}, "leaves no trunk layers"),
    ({"qwen35.nextn_predict_layers": u32(1)}, "nextn.eh_proj.weight' is missing"),
])
def test_broken_metadata_is_a_model_file_error(tmp_path, change, message):
    """What llama.cpp's loader refuses, refused at load with the key or tensor named."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen35", n_layers=4)
    with pytest.raises(ModelFileError, match=message):
        load_model(rewrite(path, tmp_path / "broken.gguf", change), progress=False)


# --- batch invariance, bit for bit ---------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rows_compute_alike_in_any_batch(model_of, variant):
    """A row's logits do not depend on how many rows its forward has (1..all), nor on another
    sequence's rows beside it, on either side (prompt rows 0..11, decode rows after them)."""
    model = model_of(variant)
    n_prompt = 12
    ref = feed(model, model.new_context(64), 0, 0, TOKENS, 1, n_prompt)
    for chunk in (2, 3, 5, 8, 16, len(TOKENS)):
        assert torch.equal(feed(model, model.new_context(64), 0, 0, TOKENS, chunk, n_prompt), ref), f"chunks of {chunk}"
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


# --- the recurrent state cut back and checkpointed ------------------------------------------------
@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K", "Q8_0-wide"])
def test_truncate_inside_last_forward_is_a_recompute(model_of, variant):
    """A verification-like forward of 6 rows, cut back to each of its rows (the per-row states),
    then 3 more rows: their logits and both states are bitwise those of a run that never saw the
    cut rows. Two sequences share every forward and are cut at different rows."""
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
        cut = states(ctx, 0)
        out = model.forward(Batch.concat([Batch.for_sequence(0, 8 + keep, nxt, "all"),
                                          Batch.for_sequence(1, 8 + keep1, other[14:17], "all")]), ctx).logits

        fresh = model.new_context(64)
        model.forward(Batch.for_sequence(0, 0, prompt + verify[:keep], "none"), fresh)
        assert same_states(states(fresh, 0), cut), f"state after keeping {keep}"
        ref0 = model.forward(Batch.for_sequence(0, 8 + keep, nxt, "all"), fresh).logits
        model.forward(Batch.for_sequence(1, 0, other[: 8 + keep1], "none"), fresh)
        ref1 = model.forward(Batch.for_sequence(1, 8 + keep1, other[14:17], "all"), fresh).logits
        assert torch.equal(out[:3], ref0), f"seq 0 kept {keep}"
        assert torch.equal(out[3:], ref1), f"seq 1 kept {keep1}"


def test_per_row_states_are_the_states_of_shorter_runs(model_of):
    model = model_of("Q8_0")
    ctx = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, TOKENS[:10], "last"), ctx)
    rows = ctx.seqs[0].rows
    for j in range(1, 11):
        fresh = model.new_context(64)
        model.forward(Batch.for_sequence(0, 0, TOKENS[:j], "last"), fresh)
        for layer, (conv, ssm) in states(fresh, 0).items():
            got_conv, got_ssm = rows[layer](j - 1)  # recomputed from the state before the forward
            assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm), (layer, j)


def test_rows_not_wanted_are_not_kept(model_of):
    model = model_of("Q8_0")
    ctx = model.new_context(64)
    ctx.keep_rows = False
    model.forward(Batch.for_sequence(0, 0, TOKENS[:6], "last"), ctx)
    assert ctx.rollback_floor(0) == 6 and ctx.seqs[0].rows == {}
    with pytest.raises(ValueError):
        ctx.truncate(0, 4)
    if hasattr(ctx, "rows_for"):  # only the sequences the engine names keep them
        ctx.keep_rows, ctx.rows_for = True, {1}
        model.forward(Batch.concat([Batch.for_sequence(0, 6, TOKENS[6:9], "last"),
                                    Batch.for_sequence(1, 0, TOKENS[:3], "last")]), ctx)
        assert ctx.rollback_floor(0) == 9 and ctx.rollback_floor(1) == 0


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K"])
def test_save_restore_replays_exactly(model_of, variant):
    model = model_of(variant)
    c = model.config
    prompt, first, second = TOKENS[:8], TOKENS[8:14], TOKENS[14:18]
    ctx = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, prompt, "none"), ctx)
    handle = ctx.save(0)
    per_layer = 4 * (c.conv_dim * (c.d_conv - 1) + c.n_v_heads * c.d_state * c.d_state)
    assert handle.nbytes == ctx.state_nbytes() == per_layer * sum(c.recurrent)
    model.forward(Batch.for_sequence(0, 8, first, "all"), ctx)
    model.forward(Batch.for_sequence(0, 14, first[:2], "all"), ctx)  # past the per-row states
    ctx.restore(0, handle)
    assert ctx.length(0) == ctx.kv.length(0) == 8
    out = model.forward(Batch.for_sequence(0, 8, second, "all"), ctx).logits
    fresh = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, prompt, "none"), fresh)
    assert torch.equal(out, model.forward(Batch.for_sequence(0, 8, second, "all"), fresh).logits)


# --- speculation through the engine equals plain decoding -----------------------------------------
# A random model rarely repeats itself, so the n-gram speculators see prompts that do: a prompt,
# the model's own continuation of it, and the prompt again; the model then mostly repeats that
# continuation (its state has seen it once): drafts get accepted, and cut short where it does not.
BASE = [[5, 77, 300, 12, 9, 44, 123, 8, 42, 7, 11, 19], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]
NGRAM_OPTIONS = {"spec_ngram_simple_size_n": 3, "spec_ngram_simple_size_m": 8,
                 "spec_ngram_map_k_size_n": 3, "spec_ngram_map_k_size_m": 8}


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


@pytest.mark.parametrize("config", ENGINE_MODES, ids=lambda c: "checkpoints" if c else "per-row")
@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-map-k"])
@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K"])
def test_ngram_speculation_equals_plain_decoding(model_of, variant, spec_type, config):
    """Four sequences decoding at once, greedy: the tokens with an n-gram speculator are the
    plain ones, and its drafts were both accepted and cut short."""
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


@pytest.mark.parametrize("config", ENGINE_MODES, ids=lambda c: "checkpoints" if c else "per-row")
@pytest.mark.parametrize("variant", ["Q8_0", "Q8_0-wide"])
def test_partial_acceptance_equals_plain_decoding(model_of, variant, config):
    model = model_of(variant)
    prompts = [p[:n] for p, n in zip(BASE * 2, (12, 5, 1, 9))]
    plain, _, _ = run_engine(model, prompts, 30)
    spec = Corrupted({tuple(p): o for p, o in zip(prompts, plain)}, every=3 + len(config))
    got, drafted, accepted = run_engine(model, prompts, 30, [spec], **config)
    assert got == plain
    assert drafted > accepted > 0


# --- llama.cpp's greedy output --------------------------------------------------------------------
@pytest.fixture(scope="module")
def ref_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35-ref")
    cache = {}

    def get(ref):
        if ref["case"] not in cache:
            path = write_tiny_model(os.path.join(d, f"{ref['case']}.gguf"), ref["arch"], **ref["writer"])
            f32 = ref["writer"].get("qtype", "F32") in ("F32", "F16", "BF16")
            model = (load_model(path, backend="f32-linear", registry=registry_with_f32(), progress=False) if f32
                     else load_model(path, progress=False))
            cache[ref["case"]] = model, (F32_TOL if f32 else QUANT_TOL)
        return cache[ref["case"]]
    return get


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram-simple"])
@pytest.mark.parametrize("case", QWEN35_CASES, ids=[c["name"] for c in QWEN35_CASES])
def test_matches_llama_cpp(ref_model, case, speculate):
    """llama.cpp's greedy tokens, every one, and its top-5 log-probabilities within the tolerance
    (module docstring); with speculation too (the tokens)."""
    ref = reference(case["name"])
    if ref is None:
        pytest.skip(f"no llama.cpp reference for {case['name']} (scripts/hybrid_references.py writes it)")
    assert ref["writer"] == case["writer"] and ref["arch"] == "qwen35"
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


# --- the native recurrence against the torch one -------------------------------------------------
@pytest.mark.parametrize("dk", [32, 96, 128])
def test_native_delta_net_equals_torch_scan(dk):
    """The CPU backend's gated_delta_net (one native call, heads in parallel) computes the torch
    scan's bits: the outputs, the final state and every per-row state."""
    from speculant_transformer.qwen35 import delta_net_scan

    backend = CpuBackend()
    if backend.native is None:
        pytest.skip(f"no native library here: {__import__('speculant_cpu.native', fromlist=['x']).why_unavailable()}")
    g = torch.Generator().manual_seed(dk)
    n, hv = 7, 6
    q = F.normalize(torch.randn(n, hv, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(n, hv, dk, generator=g), dim=-1)
    v = torch.randn(n, hv, dk, generator=g)
    decay = torch.rand(n, hv, generator=g) * 0.5 + 0.4
    beta = torch.rand(n, hv, generator=g)
    state = torch.randn(hv, dk, dk, generator=g)
    s_torch, s_native = state.clone(), state.clone()
    rows_torch, rows_native = torch.empty(n, hv, dk, dk), torch.empty(n, hv, dk, dk)
    out_torch = torch.empty(n, hv, dk)
    delta_net_scan(s_torch, q, k, v, decay, beta, dk ** -0.5, out_torch, rows_torch)
    out_native = backend.gated_delta_net(s_native, q, k, v, decay, beta, dk ** -0.5, rows_native)
    assert torch.equal(out_native, out_torch)
    assert torch.equal(s_native, s_torch) and torch.equal(rows_native, rows_torch)
    s_alone = state.clone()  # and with no per-row states asked for
    assert torch.equal(backend.gated_delta_net(s_alone, q, k, v, decay, beta, dk ** -0.5), out_torch)
    assert torch.equal(s_alone, s_torch)
