"""DFlash on tiny models: llama.cpp's layout read back, the drafter equal to an independent float64
reference of llama.cpp's graph (and to the trainer's module), drafting kept in step with the
target through rejections and prompt chunks, one drafter forward per step for all sequences, and
exactness alone, in chains, for concurrent sequences and on hybrid targets."""
from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from speculant import ModelFileError, SpeculantError
from speculant.engine import Engine, EngineConfig
from speculant.gguf import dequantize, open_gguf
from speculant.loader import load_model
from speculant.plugins import default_registry
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.speculators import plugin_options
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_dflash import DFlashHead
from speculant_dflash.layout import write_head
from speculant_dflash.testing import write_random_head

from drafter_spies import record_drafts

N_DRAFT = 300
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target_path = write_tiny_model(d / "target.gguf", "qwen2", n_layers=4, n_embd=64, n_ctx=2048)
    head_path, net, d2t = write_random_head(d / "head.gguf", target_path, n_draft_vocab=N_DRAFT, block_size=BLOCK)
    torch.set_num_threads(1)
    target = load_model(target_path, progress=False)
    return SimpleNamespace(dir=d, target_path=target_path, target=target, head_path=head_path, net=net, d2t=d2t)


def make(tiny, names=("dflash",), head=None, **options):
    return build_speculators(list(names), {"seed": 3, **options}, target=tiny.target, draft_model=head or tiny.head_path)


def run(model, prompts, n, speculators=(), params=SamplingParams(), **config):
    engine = Engine(model, EngineConfig(n_ctx=2048, **{"draft_n_max": 3, "adaptive": False, **config}), list(speculators))
    seqs = [engine.add(p, n, params) for p in prompts]
    while engine.active():
        engine.step()
    return engine, [s.tokens[s.n_prompt:] for s in seqs]


def prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


# --- an independent reference: llama.cpp's graph in float64, from the file's weights ---------------
def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _neox(x, pos, n_rot, base):
    """x [rows, heads, d], rotating dims (i, i + n_rot/2) of the first n_rot."""
    half = n_rot // 2
    theta = pos[:, None].astype(np.float64) * base ** (-np.arange(half) * 2.0 / n_rot)
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
    a, b = x[..., :half], x[..., half:n_rot]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos, x[..., n_rot:]], axis=-1)


def reference_draft(path, embed, output, taps, block, causal=False):
    """The logits of block rows 1.. after a context of len(taps) positions, as llama.cpp's dflash
    graph computes them (KV injection of the fused taps into every layer, non-causal block)."""
    g = open_gguf(path)
    meta = lambda k, d=None: g.metadata.get(f"dflash.{k}", d)
    T = {name: dequantize(t.data, t.qtype, t.shape).double().numpy() for name, t in g.tensors.items() if name != "d2t"}
    eps, base = meta("attention.layer_norm_rms_epsilon"), meta("rope.freq_base")
    nh, nkv, hd = meta("attention.head_count"), meta("attention.head_count_kv"), meta("attention.key_length")
    n_rot = meta("rope.dimension_count", hd)
    P, B = len(taps), len(block)
    ctx = _rms(np.asarray(taps, np.float64) @ T["fc.weight"].T, T["enc.output_norm.weight"], eps)
    x = np.asarray(embed, np.float64)[block]
    pos_c, pos_b = np.arange(P), np.arange(P, P + B)
    for il in range(meta("block_count")):
        L = lambda n: T.get(f"blk.{il}.{n}.weight")
        def kv(h):
            k = (h @ L("attn_k").T).reshape(len(h), nkv, hd)
            v = (h @ L("attn_v").T).reshape(len(h), nkv, hd) if L("attn_v") is not None else _rms(k, None, eps)
            return _rms(k, L("attn_k_norm"), eps), v
        kc, vc = kv(ctx)
        kc = _neox(kc, pos_c, n_rot, base)
        h = _rms(x, L("attn_norm"), eps)
        q = _neox(_rms((h @ L("attn_q").T).reshape(B, nh, hd), L("attn_q_norm"), eps), pos_b, n_rot, base)
        kb, vb = kv(h)
        kb = _neox(kb, pos_b, n_rot, base)
        k, v = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        if causal:
            s = np.where(np.concatenate([pos_c, pos_b])[None, None, :] <= pos_b[None, :, None], s, -np.inf)
        if L("attn_sinks") is not None:
            s = np.concatenate([s, np.broadcast_to(L("attn_sinks")[:, None, None], (nh, B, 1))], axis=-1)
        w = np.exp(s - s.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        if L("attn_sinks") is not None:
            w = w[..., :-1]
        attn = np.einsum("hqk,khd->qhd", w, v).reshape(B, nh * hd)
        out = attn @ L("attn_output").T
        if L("post_attention_norm") is not None:
            out = _rms(out, L("post_attention_norm"), eps)
        x = x + out
        h = _rms(x, L("ffn_norm"), eps)
        gate = h @ L("ffn_gate").T
        out = (gate / (1 + np.exp(-gate)) * (h @ L("ffn_up").T)) @ L("ffn_down").T
        if L("post_ffw_norm") is not None:
            out = _rms(out, L("post_ffw_norm"), eps)
        x = x + out
    head = T["output.weight"] if "output.weight" in T else np.asarray(output, np.float64)
    return _rms(x[1:], T["output_norm.weight"], eps) @ head.T


def _target_rows(path, name):
    t = open_gguf(path).tensor(name)
    return dequantize(t.data, t.qtype, t.shape).double().numpy()


def test_layout_read_back(tiny):
    head = load_model(tiny.head_path, progress=False)
    assert isinstance(head, DFlashHead)
    c = head.config
    assert c.target_layers == tiny.net.cfg.target_layers and c.n_draft_vocab == N_DRAFT and c.block_size == BLOCK
    assert c.mask_token_id == tiny.net.cfg.mask_token_id and not c.causal and c.n_layers == 2
    assert head.d2t.tolist() == tiny.d2t.tolist()
    meta = open_gguf(tiny.head_path).metadata
    assert meta["general.architecture"] == "dflash" and meta["tokenizer.ggml.mask_token_id"] == c.mask_token_id
    assert meta["tokenizer.ggml.tokens"] == open_gguf(tiny.target_path).metadata["tokenizer.ggml.tokens"]
    with pytest.raises(SpeculantError, match="DFlash drafter"):
        head.forward(None, None)


def test_missing_keys_and_bad_files_are_one_line_errors(tiny, tmp_path):
    net, path = tiny.net, tmp_path / "broken.gguf"
    weights = net.gguf_weights()
    del weights["blk.1.attn_k_norm.weight"]
    write_head(str(path), net.cfg, weights, target_path=tiny.target_path)
    with pytest.raises(ModelFileError, match="attn_k_norm"):
        load_model(str(path), progress=False)
    write_head(str(path), attrs.evolve(net.cfg, head_dim=net.cfg.head_dim // 2), net.gguf_weights(), target_path=tiny.target_path)
    with pytest.raises(ModelFileError, match=r"'blk.0.attn_q.weight' has shape .* expected"):
        load_model(str(path), progress=False)
    write_head(str(path), net.cfg, {**net.gguf_weights(), "markov_w1.weight": np.zeros((4, 512), np.float32)},
               target_path=tiny.target_path)
    with pytest.raises(ModelFileError, match="DSpark"):
        load_model(str(path), progress=False)
    weights = net.gguf_weights()
    weights.pop("output.weight")
    write_head(str(path), net.cfg, weights, target_path=tiny.target_path, d2t=tiny.d2t)
    with pytest.raises(ModelFileError, match="d2t"):
        load_model(str(path), progress=False)
    # what llama.cpp requires of the file: the MASK token, the taps, the norm epsilon
    from gguf_edit import rewrite

    for key in ("tokenizer.ggml.mask_token_id", "dflash.target_layers", "dflash.attention.layer_norm_rms_epsilon",
                "dflash.feed_forward_length"):
        rewrite(tiny.head_path, path, {key: None})
        with pytest.raises(ModelFileError, match=key.split(".", 1)[1] if key.startswith("dflash.") else key):
            load_model(str(path), progress=False)
    with pytest.raises(SpeculantError, match="not a DFlash drafter"):
        build_speculators(["dflash"], {}, target=tiny.target, draft_model=tiny.target_path)
    with pytest.raises(SpeculantError, match="-md"):
        build_speculators(["dflash"], {}, target=tiny.target, draft_model=None)
    # a drafter for a target with more layers taps a layer this one does not have
    write_head(str(path), attrs.evolve(net.cfg, target_layers=(2, 9, 12)), net.gguf_weights(), target_path=tiny.target_path)
    with pytest.raises(SpeculantError, match="taps the input of layer 9"):
        build_speculators(["dflash"], {}, target=tiny.target, draft_model=str(path))


def test_drafter_matches_an_independent_reference(tiny):
    """Two sequences' blocks in one forward, after contexts of different lengths (one injected in
    two pieces): each equals the float64 reference, and the trainer's module computes the same."""
    head = load_model(tiny.head_path, progress=False)
    gen = torch.Generator().manual_seed(1)
    taps = torch.randn(2, 20, 3 * 64, generator=gen)
    mask = head.config.mask_token_id
    blocks = [(0, [17] + [mask] * (BLOCK - 1), BLOCK - 1), (1, [99] + [mask] * (BLOCK - 1), BLOCK - 1)]
    lengths = [13, 20]
    ctx = head.new_context(64)
    head.inject([(0, 0, head.encode(taps[0, :5])), (1, 0, head.encode(taps[1, :20]))], ctx)
    head.inject([(0, 5, head.encode(taps[0, 5:13]))], ctx)
    got = head.draft(blocks, ctx, tiny.target.embed)
    embed = _target_rows(tiny.target_path, "token_embd.weight")
    for s, (seq_id, block, _) in enumerate(blocks):
        assert ctx.length(seq_id) == lengths[s]  # the block was not kept
        ref = reference_draft(tiny.head_path, embed, None, taps[s, : lengths[s]].double().numpy(), block)
        scale = np.abs(ref).max()
        assert np.abs(got[s].double().numpy() - ref).max() < 0.01 * scale  # fp16 KV cache
        with torch.no_grad():
            net = tiny.net(taps[s : s + 1], torch.tensor([[lengths[s]]]), torch.tensor([[block]]))[0, 0]
        assert np.abs(net.double().numpy() - ref).max() < 1e-3 * scale
    # the trainer's many blocks in one window equal one block at a time
    with torch.no_grad():
        many = tiny.net(taps[:1], torch.tensor([[3, 8, 13]]), torch.tensor([[[5] + [mask] * 3, [6] + [mask] * 3, [17] + [mask] * 3]]))
        one = tiny.net(taps[:1, :8], torch.tensor([[8]]), torch.tensor([[[6] + [mask] * 3]]))
    assert torch.allclose(many[0, 1], one[0, 0], atol=1e-5)
    # a draft asking fewer rows gets the first ones of the same (full) block
    ctx2 = head.new_context(64)
    head.inject([(0, 0, head.encode(taps[0, :13]))], ctx2)
    (two,) = head.draft([(0, blocks[0][1], 2)], ctx2, tiny.target.embed)
    assert torch.equal(two, got[0][:2])


def test_optional_llama_cpp_features_match_the_reference(tiny, tmp_path):
    """What llama.cpp reads optionally: K shared as V (no attn_v), post-attention and post-FFN
    norms, attention sinks, a causal block, partial rotary dimensions, the drafter's own
    embeddings and tied lm_head."""
    from speculant_dflash.layout import expected_shapes

    cfg = attrs.evolve(tiny.net.cfg, causal=True, n_rot=8, n_draft_vocab=512)
    weights = tiny.net.gguf_weights()
    rng = np.random.default_rng(0)
    shapes = expected_shapes(cfg)
    for il in range(cfg.n_layers):
        weights.pop(f"blk.{il}.attn_v.weight")
        for t in ("post_attention_norm", "post_ffw_norm", "attn_sinks"):
            weights[f"blk.{il}.{t}.weight"] = (1 + 0.1 * rng.standard_normal(shapes[f"blk.{il}.{t}.weight"])).astype(np.float32)
    weights.pop("output.weight")
    weights["token_embd.weight"] = _target_rows(tiny.target_path, "token_embd.weight").astype(np.float32) * 1.5
    path = tmp_path / "options.gguf"
    write_head(str(path), cfg, weights, target_path=tiny.target_path)
    head = load_model(str(path), progress=False)
    assert head.config.causal and head.config.rot == 8 and head.layers[0]["attn_v"] is None
    taps = torch.randn(9, 3 * 64, generator=torch.Generator().manual_seed(2))
    block = [40] + [cfg.mask_token_id] * (BLOCK - 1)
    ctx = head.new_context(64)
    head.inject([(0, 0, head.encode(taps))], ctx)
    (got,) = head.draft([(0, block, BLOCK - 1)], ctx)  # neither embeddings nor lm_head borrowed
    ref = reference_draft(str(path), weights["token_embd.weight"], weights["token_embd.weight"], taps.double().numpy(), block,
                          causal=True)
    assert np.abs(got.double().numpy() - ref).max() < 0.01 * np.abs(ref).max()


@pytest.mark.parametrize("chain", [("dflash",), ("draft-dflash",), ("suffix", "dflash"), ("ngram-simple", "dflash")])
def test_greedy_equals_plain_for_concurrent_sequences(tiny, chain):
    ps = prompts(3, 20) + [prompts(1, 700, seed=5)[0]]  # one prompt longer than a prefill chunk
    _, plain = run(tiny.target, ps, 24)
    engine, out = run(tiny.target, ps, 24, make(tiny, chain))
    assert out == plain
    stats = engine.spec_stats.get(chain[-1])
    assert stats is not None and stats.drafted > 0


def test_one_drafter_forward_per_step_for_all_sequences(tiny):
    spec = make(tiny)[0]
    calls = []
    original = spec.head.draft
    spec.head.draft = lambda blocks, *a, **k: calls.append(len(blocks)) or original(blocks, *a, **k)
    _, out = run(tiny.target, prompts(3, 30, seed=7), 12, [spec])
    assert out == run(tiny.target, prompts(3, 30, seed=7), 12)[1]
    assert calls and max(calls) == 3


def history_taps(target, history, spec, target_layers) -> torch.Tensor:
    """The tap layers' states side by side for positions 0..n-2 of `history`, from a fresh
    target forward in pieces of 256 rows: [n - 1, taps x n_embd]."""
    from speculant import Batch

    n = len(history)
    ctx = target.new_context(2048)
    hidden = {}
    for start in range(0, n - 1, 256):
        out = target.forward(Batch.for_sequence(0, start, list(history[start : min(n - 1, start + 256)]), logits="none"),
                             ctx, hidden_layers=spec.hidden_layers)
        for l, h in out.hidden.items():
            hidden.setdefault(l, []).append(h)
    return torch.cat([torch.cat(hidden[l - 1]) for l in target_layers], -1)


def test_drafts_equal_a_fresh_computation(tiny):
    """After many steps with rejections and a long prompt fed in chunks, each draft is what the
    trainer's module computes from scratch over the whole history: nothing drifts."""
    spec = make(tiny)[0]
    seen = record_drafts(spec)
    engine = Engine(tiny.target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), [spec])
    engine.add(prompts(1, 600, seed=2)[0], 40, SamplingParams())
    while engine.active():
        engine.step()
    assert len(seen) >= 5
    t2d = {int(t): i for i, t in enumerate(tiny.d2t)}
    mask = tiny.net.cfg.mask_token_id
    for history, draft in seen[-4:]:
        n = len(history)
        taps = history_taps(tiny.target, history, spec, tiny.net.cfg.target_layers)[None]
        with torch.no_grad():
            logits = tiny.net(taps, torch.tensor([[n - 1]]), torch.tensor([[[history[-1]] + [mask] * (BLOCK - 1)]]))[0, 0]
        for j, token in enumerate(draft.tokens):
            top2 = logits[j].topk(2)
            if float(top2.values[0] - top2.values[1]) > 0.05:  # not a near tie
                assert t2d[token] == int(top2.indices[0]), f"draft token {j} differs from a fresh computation"


def test_a_drafter_trained_on_windows_sees_that_context_and_skips_older_rows(tiny, tmp_path):
    """A drafter whose file records a training window of 64 (blocks of 4) sees the 61 context
    rows before its block, as a block did in training: each draft is what the trainer's module
    computes from those rows alone. Only rows such blocks read are injected (not a 600-token
    prompt's), the output stays plain decoding's; --spec-dflash-window overrides the file."""
    from speculant_dflash.testing import random_net

    net = random_net(tiny.target_path, seed=7, n_draft_vocab=N_DRAFT, block_size=BLOCK)
    with torch.no_grad():  # attention that moves the output: what the block sees decides its tokens
        for layer in net.layers:
            layer.o.weight.mul_(30)
    path = tmp_path / "windowed.gguf"
    write_head(str(path), net.cfg, net.gguf_weights(), target_path=tiny.target_path, d2t=tiny.d2t, qtype="F32",
               extra={"speculant.training": json.dumps({"window": 64, "steps": 1})})
    spec = make(tiny, head=str(path))[0]
    assert spec.window == 64 and spec.context_rows == 64 - BLOCK + 1
    injected, inject = [], spec.head.inject
    spec.head.inject = lambda parts, cache: injected.append(sum(len(x) for _, _, x in parts)) or inject(parts, cache)
    seen = record_drafts(spec)
    prompt = prompts(1, 600, seed=2)[0]
    try:
        out = run(tiny.target, [prompt], 40, [spec])[1][0]
    finally:
        del spec.head.inject  # the drafter's head may be shared
    assert out == run(tiny.target, [prompt], 40)[1][0]
    assert len(seen) >= 5 and sum(injected) <= spec.context_rows + 40  # the window, then a row or two a step
    t2d = {int(t): i for i, t in enumerate(tiny.d2t)}
    ctx_rows, mask = spec.context_rows, net.cfg.mask_token_id
    compared = differs = 0
    for history, draft in seen[-6:]:
        n = len(history)
        all_taps = history_taps(tiny.target, history, spec, net.cfg.target_layers)
        block = torch.tensor([[[history[-1]] + [mask] * (BLOCK - 1)]])
        with torch.no_grad():  # the window's rows alone, the block right after them
            logits = net(all_taps[n - 1 - ctx_rows:][None], torch.tensor([[ctx_rows]]), block)[0, 0]
        for j, token in enumerate(draft.tokens):
            top2 = logits[j].topk(2)
            if float(top2.values[0] - top2.values[1]) > 0.05:  # not a near tie
                assert t2d[token] == int(top2.indices[0]), f"draft token {j} differs from the window's computation"
                compared += 1
        with torch.no_grad():  # the whole history's rows: what a drafter without the window sees
            whole = net(all_taps[None], torch.tensor([[n - 1]]), block)[0, 0]
        m = len(draft.tokens)
        differs += int(bool((whole[:m].argmax(-1) != logits[:m].argmax(-1)).any()))
    assert compared >= 6 and differs >= 2  # the window changes the drafts
    assert make(tiny, head=str(path), spec_dflash_window=0)[0].window == 0  # the whole context
    assert make(tiny)[0].window == 0  # a file that records no window: the whole context
    import structlog

    causal = tmp_path / "causal.gguf"  # its mask is per row: it keeps the whole context, and says so when asked
    write_head(str(causal), attrs.evolve(net.cfg, causal=True), net.gguf_weights(), target_path=tiny.target_path,
               d2t=tiny.d2t, qtype="F32", extra={"speculant.training": json.dumps({"window": 64, "steps": 1})})
    with structlog.testing.capture_logs() as logs:
        assert make(tiny, head=str(causal), spec_dflash_window=64)[0].window == 0
    assert any(e["event"] == "dflash_window_ignored" for e in logs)


def test_sampled_drafts_carry_probabilities_and_keep_the_distribution(tiny):
    """At temperature > 0 drafts come with the drafter's distribution over the target vocabulary
    (rejection sampling); the first tokens are distributed as plain sampling's (chi-square)."""
    params = lambda seed: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    spec = make(tiny)[0]
    prompt = prompts(1, 12, seed=9)[0]
    got = record_drafts(spec, lambda r, d: d)
    engine = Engine(tiny.target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), [spec])
    engine.add(prompt, 6, params(1))
    while engine.active():
        engine.step()
    assert got and all(d.probs is not None and d.probs.shape == (len(d), tiny.target.info.n_vocab) for d in got)
    assert all(float(d.probs[j, t]) > 0 for d in got for j, t in enumerate(d.tokens))

    def tokens_at(speculators, k):  # the tokens the target generates at offsets 1..k, 300 runs each
        out = []
        for seed in range(300):
            eng = Engine(tiny.target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), speculators)
            s = eng.add(prompt, k + 1, params(seed))
            while eng.active():
                eng.step()
            out.append(tuple(s.tokens[s.n_prompt + 1 : s.n_prompt + 1 + k]) + (-1,) * k)  # -1: ended before
        return out
    spec = make(tiny)[0]
    a, b = tokens_at([], 2), tokens_at([spec], 2)
    for j in range(2):  # the first drafted token and the one after (a second draft row)
        aj, bj = [t[j] for t in a], [t[j] for t in b]
        keys = sorted(set(aj) | set(bj))
        ca, cb = np.array([aj.count(k) for k in keys]), np.array([bj.count(k) for k in keys])
        big = (ca + cb) >= 10
        chi2 = (((ca - cb) ** 2) / np.maximum(ca + cb, 1))[big].sum() + \
            ((ca[~big].sum() - cb[~big].sum()) ** 2) / max(1, (ca + cb)[~big].sum())
        dof = int(big.sum())
        assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, f"offset {j + 1}: chi2 {chi2:.1f} with {dof} bins"


@pytest.fixture(scope="module", params=("lfm2", "qwen35"))
def hybrid(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    torch.set_num_threads(1)
    target_path = write_tiny_model(d / "target.gguf", request.param, n_layers=4, n_ctx=2048, seed=1)
    head, _, _ = write_random_head(d / "head.gguf", target_path, n_draft_vocab=300, block_size=BLOCK)
    return SimpleNamespace(target=load_model(target_path, progress=False), head=head)


@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
def test_greedy_equals_plain_on_hybrid_targets(hybrid, use_checkpoints):
    registry = default_registry()
    ps = [(p * 11)[:60] for p in prompts(3, 6, seed=3)]  # repeated phrases: suffix drafts too
    _, truth = run(hybrid.target, ps, 24)
    for chain in (("dflash",), ("suffix", "dflash")):
        specs = build_speculators(list(chain), {**plugin_options(registry), "seed": 3}, target=hybrid.target,
                                  draft_model=hybrid.head, registry=registry)
        engine, got = run(hybrid.target, ps, 24, specs, spec_use_checkpoints=use_checkpoints)
        assert got == truth
        assert engine.spec_stats["dflash"].drafted > 0


def test_train_command_collects_trains_resumes_and_exports(tiny, tmp_path):
    """`speculant train dflash` with tiny settings: data, a checkpoint, a drafter that loads and
    drafts; a rerun with more steps resumes from the checkpoint instead of starting over, and
    the drafter learns (held-out first-row accuracy well above chance)."""
    from speculant.cli import main

    data, out = tmp_path / "data", tmp_path / "head.gguf"
    args = ["train", "dflash", "-m", tiny.target_path, "-o", str(out), "--data", str(data), "--source",
            "core/speculant/*.py", "--tokens", "2000", "--piece-tokens", "100", "--batch", "4", "--window", "48",
            "--blocks", "8", "--block-size", "4", "--layers", "2", "--draft-vocab", "200", "--ffn", "64",
            "--save-every", "5", "--qtype", "F32", "--precision", "fp32", "-t", "1", "--lr", "2e-3"]
    assert main(args + ["--steps", "10"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokens"] >= 2000 and manifest["taps"] == [1, 2, 3] and manifest["layers"] == [0, 1, 2]
    assert torch.load(data / "dflash-ckpt.pt", weights_only=False)["step"] == 10
    assert main(args + ["--steps", "300", "--save-every", "300"]) == 0
    assert torch.load(data / "dflash-ckpt.pt", weights_only=False)["step"] == 300
    assert json.loads((data / "manifest.json").read_text())["tokens"] == manifest["tokens"]  # not collected again
    head = load_model(str(out), progress=False)
    c = head.config
    assert c.n_draft_vocab == 200 and c.n_ff == 64 and c.block_size == 4 and c.n_layers == 2 and c.target_layers == (1, 2, 3)
    summary = json.loads(open_gguf(str(out)).metadata["speculant.training"])
    assert summary["steps"] == 300 and summary["held_out_accuracy"][0] > 0.15  # chance: 1/200; about 0.37 here
    spec = build_speculators(["dflash"], {}, target=tiny.target, draft_model=str(out))
    ps = prompts(2, 30, seed=4)
    _, plain = run(tiny.target, ps, 16)
    engine, out_tokens = run(tiny.target, ps, 16, spec)
    assert out_tokens == plain and engine.spec_stats["dflash"].drafted > 0


def test_train_init_starts_from_a_trained_drafter(tiny, tmp_path):
    """`--init DRAFTER.gguf`: the new training starts from that drafter's weights and draft
    vocabulary (an F32 drafter round-trips exactly), and one of another shape is refused by name."""
    from speculant.cli import main
    from speculant.training import init_from_head
    from speculant_dflash.testing import head_config_for, target_embedding
    from speculant_dflash.train.net import DFlashNet

    base = ["-m", tiny.target_path, "--source", "core/speculant/*.py", "--tokens", "800", "--piece-tokens", "100",
            "--batch", "2", "--window", "32", "--blocks", "4", "--block-size", "4", "--draft-vocab", "200", "--ffn", "64",
            "--qtype", "F32", "--precision", "fp32", "-t", "1"]
    first = tmp_path / "first.gguf"
    assert main(["train", "dflash", "-o", str(first), "--data", str(tmp_path / "a"), "--steps", "4", *base]) == 0
    shape = dict(n_draft_vocab=200, n_layers=1, block_size=4, target_layers=(1, 2, 3))
    net = DFlashNet(head_config_for(tiny.target_path, n_ff=64, **shape), target_embedding(tiny.target_path))
    d2t = init_from_head(net.gguf_modules(), str(first))
    g = open_gguf(str(first))
    assert d2t.tolist() == np.asarray(g.tensors["d2t"].data).reshape(-1).tolist()
    for name, w in net.gguf_weights().items():
        assert np.array_equal(w, np.asarray(g.tensors[name].data, dtype=np.float32).reshape(w.shape)), name
    second = tmp_path / "second.gguf"
    assert main(["train", "dflash", "-o", str(second), "--data", str(tmp_path / "b"), "--steps", "2", "--init", str(first),
                 *base]) == 0
    assert open_gguf(str(second)).tensors["d2t"].data.tolist() == g.tensors["d2t"].data.tolist()
    assert json.loads(open_gguf(str(second)).metadata["speculant.training"])["init"] == str(first)
    other = DFlashNet(head_config_for(tiny.target_path, n_ff=96, **shape), target_embedding(tiny.target_path))
    with pytest.raises(ValueError, match="ffn_gate"):
        init_from_head(other.gguf_modules(), str(first))


def _llamacpp_reference():
    from pathlib import Path

    path = Path(__file__).parent / "data" / "dflash-llamacpp.json"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cases = {r["case"]["name"]: r["case"] for r in rows if "case" in r and isinstance(r["case"], dict)}
    return [(cases[r["result"]], r) for r in rows if "result" in r]


@pytest.mark.parametrize("case,ref", _llamacpp_reference(), ids=lambda x: x.get("name", "") if isinstance(x, dict) else "")
def test_drafts_equal_llama_cpp_draft_dflash(case, ref, tmp_path):
    """llama-server (`--spec-type draft-dflash`, greedy, its verbose log's drafts) loaded the
    drafter this test writes again (scripts/dflash_llamacpp.py wrote tests/data/dflash-llamacpp.json)
    and drafted, block for block, what speculant drafts: llama.cpp reads our files as we do. Rounds
    are compared while both engines' histories agree; a differing draft there is a near tie."""
    from speculant_dflash.testing import write_random_head

    target_path = write_tiny_model(tmp_path / "target.gguf", case["arch"], **case["writer"])
    head, _, _ = write_random_head(tmp_path / "dflash.gguf", target_path, **case["head"])
    target = load_model(target_path, progress=False)
    spec = build_speculators(["dflash"], {"seed": 1}, target=target, draft_model=head)[0]
    rounds = record_drafts(spec, lambda r, d: list(d.tokens))
    n_max = case["head"]["block_size"] - 1
    engine = Engine(target, EngineConfig(n_ctx=2048, draft_n_max=n_max, adaptive=False), [spec])
    seq = engine.add(ref["prompt"], len(ref["llama_tokens"]), SamplingParams())
    while engine.active():
        engine.step()
    theirs, ours = ref["llama_drafts"], rounds[ref["offset"]:]
    # compare up to where the greedy histories part (a tie of the two targets' own logits)
    tokens, mine = ref["llama_tokens"], seq.tokens[seq.n_prompt:]
    n_same = next((i for i, (a, b) in enumerate(zip(tokens, mine)) if a != b), min(len(tokens), len(mine)))
    pairs = list(zip(ours, theirs))[: max(1, n_same - 1)]
    assert all(len(d) == n_max for d in theirs[: len(pairs) - 1]), "llama.cpp drafted its full block every round"
    first = sum(a[:1] == b[:1] for a, b in pairs)
    whole = sum(a == b[: len(a)] for a, b in pairs)
    assert first >= 0.9 * len(pairs) and whole >= 0.8 * len(pairs), (first, whole, len(pairs))


def test_top1_weight_mixes_the_hard_cross_entropy_in(tiny):
    """`speculant train dflash --top1-weight w`: the block loss is (1 - w) * the soft loss + w *
    the cross-entropy against the target's top-1, each block row's averaged over the rows whose
    top-1 is in the draft vocabulary, under the same row weights; the accuracies do not move."""
    import torch.nn.functional as F

    from speculant_dflash.train.loop import block_loss, row_weights

    net, cfg = tiny.net, tiny.net.cfg
    gen = torch.Generator().manual_seed(6)
    n, T, nb, K = 2, 12, 3, 4
    taps = torch.randn(n, T, len(cfg.target_layers) * cfg.n_embd, generator=gen)
    anchors = torch.tensor([[1, 4, 8], [2, 5, 7]])
    block_tokens = torch.full((n, nb, BLOCK), cfg.mask_token_id, dtype=torch.long)
    block_tokens[:, :, 0] = torch.randint(0, 256, (n, nb), generator=gen)
    ids = torch.randint(0, N_DRAFT, (n, nb, BLOCK - 1, K), generator=gen)
    p = torch.softmax(torch.randn(n, nb, BLOCK - 1, K, generator=gen), -1)
    top1 = ids[..., 0].clone()
    top1[0, 1, 2] = top1[1, 0, 0] = -1
    with torch.no_grad():
        soft, acc, tau = block_loss(net, taps, anchors, block_tokens, (ids, p, top1))
        mixed, acc_mixed, tau_mixed = block_loss(net, taps, anchors, block_tokens, (ids, p, top1), top1_weight=0.3)
        lp = F.log_softmax(net(taps, anchors, block_tokens).float(), -1)
    assert (acc, tau) == (acc_mixed, tau_mixed)
    ok = top1 >= 0
    hard_rows = -lp.gather(-1, top1.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_row = torch.stack([hard_rows[..., i][ok[..., i]].mean() for i in range(BLOCK - 1)])
    w = row_weights(BLOCK)
    assert torch.allclose(mixed, 0.7 * soft + 0.3 * (per_row * w).sum() / w.sum(), atol=1e-5)
    assert not torch.allclose(mixed, soft)
