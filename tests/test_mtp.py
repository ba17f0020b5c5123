"""MTP on tiny models: llama.cpp's NextN layout read back (in a qwen35 target's own file, split off
into a sidecar, and a sidecar the trainer writes for a qwen2 target), the inference head equal to
the trainer's module, drafting kept in step with the target through rejections and prompt
chunks, exactness alone, in chains and for concurrent sequences on a plain and a hybrid target,
sampling from the target's distribution, and `speculant train mtp`."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculant import Batch, ModelFileError, SpeculantError
from speculant.engine import Engine, EngineConfig
from speculant.gguf import open_gguf
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_mtp import MtpHead, has_nextn, read_config, split_sidecar
from speculant_mtp.testing import write_random_sidecar

from drafter_spies import assert_top1_mixed, draft_tokens, record_drafts, windowed_run

Q35 = dict(n_layers=5, recurrent_layers=[True, False, True, True, False], head_dim=32, n_rot=8,
           rope_sections=[1, 1, 1, 1], n_ctx=2048, seed=22)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    torch.set_num_threads(1)
    q2_path = write_tiny_model(d / "qwen2.gguf", "qwen2", n_layers=4, n_embd=64, n_ctx=2048)
    sidecar, net = write_random_sidecar(d / "mtp-qwen2.gguf", q2_path, seed=1, n_ff=96)
    q35_path = write_tiny_model(d / "qwen35.gguf", "qwen35", nextn_layers=1, **Q35)
    q35_trunk = write_tiny_model(d / "qwen35-trunk.gguf", "qwen35", **Q35)  # the same trunk, no NextN block
    q35_sidecar = split_sidecar(q35_path, str(d / "mtp-qwen35.gguf"))
    vocab = np.sort(np.random.default_rng(0).choice(512, 200, replace=False))
    vocab_sidecar, _ = write_random_sidecar(d / "mtp-qwen2-vocab.gguf", q2_path, seed=1, n_ff=96, draft_vocab=vocab)
    return SimpleNamespace(dir=d, q2_path=q2_path, q2=load_model(q2_path, progress=False), sidecar=sidecar, net=net,
                           vocab=vocab, vocab_sidecar=vocab_sidecar,
                           q35_path=q35_path, q35=load_model(q35_path, progress=False), q35_trunk_path=q35_trunk,
                           q35_trunk=load_model(q35_trunk, progress=False), q35_sidecar=q35_sidecar)


def targets(tiny, which):
    """(target, -md file) of a case: the qwen2 target with a sidecar, qwen35 with its own block,
    the qwen35 trunk with the block split off into a sidecar."""
    return {"qwen2": (tiny.q2, tiny.sidecar), "qwen35": (tiny.q35, None),
            "qwen35-sidecar": (tiny.q35_trunk, tiny.q35_sidecar), "qwen2-vocab": (tiny.q2, tiny.vocab_sidecar)}[which]


def make(target, draft, names=("mtp",), **options):
    return build_speculators(list(names), {"seed": 3, **options}, target=target, draft_model=draft)


def run(model, prompts, n, speculators=(), params=SamplingParams(), **config):
    engine = Engine(model, EngineConfig(n_ctx=2048, **{"draft_n_max": 4, "adaptive": False, **config}), list(speculators))
    seqs = [engine.add(p, n, params) for p in prompts]
    while engine.active():
        engine.step()
    return engine, [s.tokens[s.n_prompt:] for s in seqs]


def prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


# --- the layout ------------------------------------------------------------------------------
def test_block_in_the_target_s_own_file(tiny):
    g = open_gguf(tiny.q35_path)
    assert has_nextn(g) and not has_nextn(open_gguf(tiny.q35_trunk_path))
    cfg = read_config(g)
    assert (cfg.arch, cfg.n_trunk, cfg.n_nextn, cfg.gated, cfg.head_dim, cfg.n_rot) == ("qwen35", 5, 1, True, 32, 8)
    assert cfg.unrotated  # an IMROPE section left at position 0
    spec = make(tiny.q35, None)[0]
    head = spec.head
    assert head.in_target and head.path == tiny.q35_path
    # what the block shares with the trunk is the target's own module, not a second copy
    assert head.embed is tiny.q35.embed and head.head is tiny.q35.output
    assert head.parts["nextn.eh_proj"] is tiny.q35.nextn[0].eh_proj  # the block the target loaded, reused
    assert spec.hidden_layers == (5,)  # the final-normed state: llama.cpp's h_nextn for qwen35


def test_sidecar_split_off_as_llama_cpp_writes_it(tiny):
    g = open_gguf(tiny.q35_sidecar)
    assert g.arch_key("block_count") == 6 and g.arch_key("nextn_predict_layers") == 1
    assert not any(n.startswith("blk.0.") for n in g.tensors)  # no trunk
    assert {"token_embd.weight", "output_norm.weight"} <= set(g.tensors)  # llama.cpp's qwen35 sidecar needs them
    head = make(tiny.q35_trunk, tiny.q35_sidecar)[0].head
    assert not head.in_target
    assert head.embed is tiny.q35_trunk.embed and head.head is tiny.q35_trunk.output  # identical bytes: borrowed
    # the same block drafts the same tokens from the sidecar as from the target's own file
    ps = prompts(2, 30, seed=7)
    a = _drafts(tiny.q35, None, ps)
    b = _drafts(tiny.q35_trunk, tiny.q35_sidecar, ps)
    assert a and a == b


def test_trained_sidecar_layout(tiny):
    g = open_gguf(tiny.sidecar)
    cfg = read_config(g)
    assert (cfg.arch, cfg.n_trunk, cfg.n_nextn, cfg.gated, cfg.n_ff) == ("qwen2", 4, 1, False, 96)
    assert g.arch_key("feed_forward_length") == [128] * 4 + [96]  # the block's own FFN width, per layer
    assert set(tiny.net.gguf_weights()) == set(g.tensors)  # only the block: the rest is borrowed
    assert all(n.startswith("blk.4.") for n in g.tensors) and "blk.4.attn_q.bias" in g.tensors
    assert g.metadata["tokenizer.ggml.tokens"] == open_gguf(tiny.q2_path).metadata["tokenizer.ggml.tokens"]
    head = make(tiny.q2, tiny.sidecar)[0].head
    assert head.embed is tiny.q2.embed and head.head is tiny.q2.output and head.head_norm is not tiny.q2.out_norm


def test_missing_blocks_and_wrong_files_are_one_line_errors(tiny, tmp_path):
    with pytest.raises(SpeculantError, match="no MTP block.*-md"):
        make(tiny.q2, None)
    with pytest.raises(SpeculantError, match="holds no MTP block"):
        make(tiny.q2, tiny.q2_path)
    # a -md file without a block falls back to the target's own (a chain's draft model for draft-simple)
    assert make(tiny.q35, tiny.q2_path)[0].head.in_target
    # a sidecar made for a target of another depth
    other = write_tiny_model(tmp_path / "deeper.gguf", "qwen2", n_layers=6, n_embd=64)
    with pytest.raises(SpeculantError, match="trunk of 4 layers.*has 6"):
        make(load_model(other, progress=False), tiny.sidecar)
    # a tensor missing from the block
    from speculant_mtp.layout import write_sidecar
    weights = tiny.net.gguf_weights()
    del weights["blk.4.nextn.hnorm.weight"]
    broken = write_sidecar(str(tmp_path / "mtp-broken.gguf"), tiny.q2_path, weights)
    with pytest.raises(SpeculantError, match="nextn.hnorm"):
        make(tiny.q2, broken)


def test_draft_vocabulary(tiny):
    """A sidecar naming a draft vocabulary drafts from those tokens through those rows of the
    target's lm_head; --spec-mtp-full-vocab drafts from all of them."""
    spec = make(tiny.q2, tiny.vocab_sidecar)[0]
    assert spec.head.vocab.tolist() == tiny.vocab.tolist()
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    logits, _ = spec.head.decode(Batch.for_sequence(0, 0, [1, 2, 3], logits="last"), spec.head.new_context(8), h)
    full = make(tiny.q2, tiny.vocab_sidecar, spec_mtp_full_vocab=True)[0].head
    assert full.vocab is None
    ref, _ = full.decode(Batch.for_sequence(0, 0, [1, 2, 3], logits="last"), full.new_context(8), h)
    assert logits.shape == (1, 200) and ref.shape == (1, 512)
    assert torch.allclose(logits, ref[:, torch.from_numpy(tiny.vocab)], atol=1e-4)
    drafts = _drafts(tiny.q2, tiny.vocab_sidecar, prompts(2, 30, seed=8))
    assert drafts and all(set(d) <= set(tiny.vocab.tolist()) for d in drafts)


# --- the head --------------------------------------------------------------------------------
def test_head_matches_the_training_module(tiny):
    """Rows over a history, then two draft steps from one anchor: the inference head (fp16 KV,
    the backend's kernels, the file's weights) computes what the trainer's unrolled module does."""
    head = make(tiny.q2, tiny.sidecar)[0].head
    T = 16
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 500, (1, T + 2), generator=gen)
    h = torch.randn(1, T, 64, generator=gen)
    with torch.no_grad():
        ref = tiny.net.unrolled(toks, h, 3, start=0)
    ctx = head.new_context(64)
    logits, states = head.decode(Batch.for_sequence(0, 0, toks[0, :T].tolist(), logits="all"), ctx, h[0])
    scale = ref[0].abs().max()
    assert (logits - ref[0][0]).abs().max() < 0.02 * scale
    anchor = 9
    ctx.truncate(0, anchor + 1)
    s = states[anchor : anchor + 1]
    for j in (1, 2):
        step, s = head.decode(Batch.for_sequence(0, anchor + j, [int(toks[0, anchor + j])], logits="all"), ctx, s)
        assert (step[0] - ref[j][0, anchor]).abs().max() < 0.02 * scale


def test_gated_head_matches_the_training_module(tiny, tmp_path):
    """The same for qwen35's block (query gate, q/k norms, IMROPE with an unrotated section)."""
    path, net = write_random_sidecar(tmp_path / "mtp-q35.gguf", tiny.q35_trunk_path, seed=2)
    g = open_gguf(path)  # per-layer arrays cover the block too (llama.cpp checks their length)
    assert g.arch_key("attention.recurrent_layers") == Q35["recurrent_layers"] + [False]
    assert {"token_embd.weight", "output_norm.weight"} <= set(g.tensors)  # what llama.cpp's qwen35 sidecar needs
    head = make(tiny.q35_trunk, path)[0].head
    assert head.config.gated and head.config.unrotated
    T = 12
    gen = torch.Generator().manual_seed(2)
    toks = torch.randint(0, 500, (1, T + 1), generator=gen)
    h = torch.randn(1, T, 64, generator=gen)
    with torch.no_grad():
        ref = net.unrolled(toks, h, 2, start=0)
    ctx = head.new_context(64)
    logits, states = head.decode(Batch.for_sequence(0, 0, toks[0, :T].tolist(), logits="all"), ctx, h[0])
    scale = ref[0].abs().max()
    assert (logits - ref[0][0]).abs().max() < 0.02 * scale
    ctx.truncate(0, 6)
    step, _ = head.decode(Batch.for_sequence(0, 6, [int(toks[0, 6])], logits="all"), ctx, states[5:6])
    assert (step[0] - ref[1][0, 5]).abs().max() < 0.02 * scale


# --- drafting --------------------------------------------------------------------------------
def _drafts(target, draft, ps, n=20):
    spec = make(target, draft)[0]
    seen = record_drafts(spec, draft_tokens)
    run(target, ps, n, [spec])
    return seen


@pytest.mark.parametrize("which", ["qwen2", "qwen35", "qwen35-sidecar", "qwen2-vocab"])
@pytest.mark.parametrize("chain", [("mtp",), ("draft-mtp",), ("ngram-simple", "mtp"), ("suffix", "mtp")])
def test_greedy_equals_plain_for_concurrent_sequences(tiny, which, chain):
    target, draft = targets(tiny, which)
    ps = prompts(3, 20) + [prompts(1, 700, seed=5)[0]]  # one prompt longer than a prefill chunk
    _, plain = run(target, ps, 24)
    engine, out = run(target, ps, 24, make(target, draft, chain))
    assert out == plain
    stats = engine.spec_stats.get(chain[-1])
    assert stats is not None and stats.drafted > 0


@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
def test_hybrid_target_both_rollback_modes(tiny, use_checkpoints):
    ps = prompts(3, 40, seed=3)
    _, plain = run(tiny.q35, ps, 24)
    engine, out = run(tiny.q35, ps, 24, make(tiny.q35, None), spec_use_checkpoints=use_checkpoints)
    assert out == plain
    st, r = engine.spec_stats["mtp"], engine.recurrent_stats
    assert st.drafted > st.accepted  # drafts were cut: the way back was taken
    assert (r.replays > 0) == use_checkpoints and (r.rollbacks > 0) != use_checkpoints


@pytest.mark.parametrize("which", ["qwen2", "qwen35"])
def test_drafts_equal_a_fresh_computation(tiny, which):
    """After many steps with rejections and a long prompt fed in chunks, each draft is what the
    trainer's module computes from scratch over the whole history: nothing drifts."""
    target, draft = targets(tiny, which)
    if which == "qwen35":  # the trainer's module of the file's block
        from speculant_mtp.testing import config_for, target_parts
        from speculant_mtp.train.net import MtpNet
        from speculant.training import target_tensor
        net = MtpNet(config_for(tiny.q35_path), *target_parts(tiny.q35_path), bias=False)
        b = "blk.5."
        names = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm", "head_norm": "nextn.shared_head_norm",
                 "attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                 "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "ffn_norm": "post_attention_norm", "gate": "ffn_gate",
                 "up": "ffn_up", "down": "ffn_down"}
        with torch.no_grad():
            for mod, t in names.items():
                getattr(net, mod).weight.copy_(target_tensor(tiny.q35_path, b + t + ".weight"))
    else:
        net = tiny.net
    spec = make(target, draft)[0]
    seen = record_drafts(spec)
    engine = Engine(target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), [spec])
    engine.add(prompts(1, 600, seed=2)[0], 40, SamplingParams())
    while engine.active():
        engine.step()
    assert len(seen) >= 5
    checked = 0
    for history, draft_ in seen[-4:]:
        n = len(history)
        ctx = target.new_context(2048)
        hs = []
        for start in range(0, n, 256):
            out = target.forward(Batch.for_sequence(0, start, list(history[start : start + 256]), logits="none"), ctx,
                                 hidden_layers=spec.hidden_layers)
            hs.append(out.hidden[spec.hidden_layers[0]])
        h = torch.cat([torch.zeros(1, 64), torch.cat(hs)[: n - 1]])[None]  # h_{q-1} of rows 0..n-1
        ext = list(history) + list(draft_.tokens)
        with torch.no_grad():
            steps = net.unrolled(torch.tensor([ext]), h, len(draft_), start=0)
        for j, token in enumerate(draft_.tokens):
            top2 = steps[j][0, n - 1].topk(2)
            if float(top2.values[0] - top2.values[1]) > 0.05:  # not a near tie
                assert token == int(top2.indices[0]), f"draft token {j} differs from a fresh computation"
                checked += 1
    assert checked


def _windowed_run(target, draft, prompt, skip=True, **options):
    spec = make(target, draft, **options)[0]
    return (spec, *windowed_run(spec, lambda sp: run(target, [prompt], 24, [sp])[1][0], skip))


def test_a_head_trained_on_windows_attends_over_its_window_and_skips_older_rows(tiny, tmp_path):
    """A sidecar that records a training window of 64 attends over its last 64 rows (its drafts
    differ from attending over all 600), computes only the rows those windows read (the drafts
    are the same as with every prompt row written), and the output stays plain decoding's;
    --spec-mtp-window overrides the file."""
    windowed, _ = write_random_sidecar(tmp_path / "mtp-windowed.gguf", tiny.q2_path, seed=1, n_ff=96,
                                       extra={"speculant.training": json.dumps({"window": 64, "steps": 1})})
    prompt = prompts(1, 600, seed=6)[0]
    plain = run(tiny.q2, [prompt], 24)[1][0]
    spec, drafts, rows, out = _windowed_run(tiny.q2, windowed, prompt)
    assert spec.window == 64 and out == plain and len(drafts) >= 3
    _, drafts_all_rows, rows_all, out_all = _windowed_run(tiny.q2, windowed, prompt, skip=False)
    assert drafts_all_rows == drafts and out_all == plain
    assert rows_all - rows >= 600 - 64 - 1  # the prompt's rows before its window were not computed
    spec, drafts_full, _, out_full = _windowed_run(tiny.q2, windowed, prompt, spec_mtp_window=0)
    assert spec.window == 0 and out_full == plain and drafts_full != drafts
    assert make(tiny.q2, tiny.sidecar)[0].window == 0  # a file that records no window: the whole context


def test_a_windowed_head_computes_skipped_rows_when_a_cached_prompt_reaches_back_to_them(tiny, tmp_path):
    """A long prompt's catch-up skips the rows before its window; a later request that continues
    from a shorter part of it (the prompt cache) reads some of those rows in its window: they are
    computed then, and its drafts are a cold start's."""
    windowed, _ = write_random_sidecar(tmp_path / "mtp-windowed.gguf", tiny.q2_path, seed=1, n_ff=96,
                                       extra={"speculant.training": json.dumps({"window": 64})})
    first = prompts(1, 600, seed=7)[0]
    second = first[:300] + prompts(1, 20, seed=8)[0]  # its window (positions 256..) reaches below 300

    def drafts_of_second(cached: bool):
        spec = make(tiny.q2, windowed)[0]
        seen = record_drafts(spec, lambda r, d: (len(r.seq.tokens), d.tokens) if list(r.seq.tokens[:320]) == second else None)
        engine = Engine(tiny.q2, EngineConfig(n_ctx=2048, draft_n_max=4, adaptive=False), [spec])
        entry = None
        if cached:
            seq = engine.add(first, 8, SamplingParams())
            while engine.active():
                engine.step()
            entry = engine.keep(seq)
        seq = engine.add(second, 16, SamplingParams(), cached=entry)
        assert seq.n_reused == (300 if cached else 0)  # the common prefix continues from the cache
        while engine.active():
            engine.step()
        return seen, seq.tokens[seq.n_prompt:]

    cold, cold_out = drafts_of_second(cached=False)
    warm, warm_out = drafts_of_second(cached=True)
    assert warm_out == cold_out and len(cold) >= 3
    assert warm == cold


def test_a_long_prompt_is_written_into_the_head_in_pieces(tiny):
    from speculant_mtp.speculator import CATCH_UP_ROWS

    spec = make(tiny.q2, tiny.sidecar)[0]
    sizes = []
    original = spec.head.decode
    spec.head.decode = lambda batch, *a, **k: sizes.append(len(batch)) or original(batch, *a, **k)
    prompt = prompts(1, 5 * CATCH_UP_ROWS + 7, seed=4)[0]
    _, (out,) = run(tiny.q2, [prompt], 12, [spec])
    assert max(sizes) <= CATCH_UP_ROWS and sum(1 for n in sizes if n == CATCH_UP_ROWS) >= 5
    assert out == run(tiny.q2, [prompt], 12)[1][0]


@pytest.mark.parametrize("which", ["qwen2", "qwen2-vocab"])
def test_sampled_drafts_carry_probabilities_and_keep_the_distribution(tiny, which):
    """At temperature > 0 drafts come with the head's distribution over the target vocabulary
    (rejection sampling; zero outside a draft vocabulary); the first tokens are distributed as
    plain sampling's (chi-square)."""
    params = lambda seed: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    target, draft = targets(tiny, which)
    prompt = prompts(1, 12, seed=9)[0]
    got = _drafts_sampled(target, draft, prompt, params(1))
    assert got and all(d.probs is not None and d.probs.shape == (len(d), target.info.n_vocab) for d in got)
    assert all(torch.allclose(d.probs.sum(-1), torch.ones(len(d)), atol=1e-4) for d in got)
    if which == "qwen2-vocab":
        outside = torch.ones(target.info.n_vocab, dtype=torch.bool)
        outside[torch.from_numpy(tiny.vocab)] = False
        assert all(float(d.probs[:, outside].sum()) == 0 and set(d.tokens) <= set(tiny.vocab.tolist()) for d in got)

    def second_tokens(speculators):
        out = []
        for seed in range(300):
            eng = Engine(target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), speculators)
            s = eng.add(prompt, 3, params(seed))
            while eng.active():
                eng.step()
            out.append(s.tokens[s.n_prompt + 1])
        return out
    a, b = second_tokens([]), second_tokens(make(target, draft))
    keys = sorted(set(a) | set(b))
    ca, cb = np.array([a.count(k) for k in keys]), np.array([b.count(k) for k in keys])
    big = (ca + cb) >= 10
    chi2 = (((ca - cb) ** 2) / np.maximum(ca + cb, 1))[big].sum() + ((ca[~big].sum() - cb[~big].sum()) ** 2) / max(1, (ca + cb)[~big].sum())
    dof = int(big.sum())
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} with {dof} bins"


def _drafts_sampled(target, draft, prompt, params):
    spec = make(target, draft)[0]
    drafts = record_drafts(spec, lambda r, d: d)
    engine = Engine(target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), [spec])
    engine.add(prompt, 6, params)
    while engine.active():
        engine.step()
    return drafts


# --- training --------------------------------------------------------------------------------
def test_train_command_collects_trains_resumes_and_exports(tiny, tmp_path):
    """`speculant train mtp` with tiny settings: data, a checkpoint, a sidecar that loads and
    drafts; a rerun with more steps resumes from the checkpoint instead of starting over."""
    from speculant.cli import main

    data, out = tmp_path / "data", tmp_path / "mtp-tiny.gguf"
    args = ["train", "mtp", "-m", tiny.q2_path, "-o", str(out), "--data", str(data), "--source", "core/speculant/*.py",
            "--tokens", "2000", "--piece-tokens", "100", "--batch", "4", "--window", "64", "--ffn", "64", "--lr", "3e-3",
            "--save-every", "20", "--qtype", "F32", "--precision", "fp32", "-t", "1", "--train-vocab", "200"]
    assert main(args + ["--steps", "20"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokens"] >= 2000 and manifest["layers"] == [4]  # the final-normed state
    assert torch.load(data / "mtp-ckpt.pt", weights_only=False)["step"] == 20
    assert main(args + ["--steps", "60"]) == 0
    assert torch.load(data / "mtp-ckpt.pt", weights_only=False)["step"] == 60
    assert json.loads((data / "manifest.json").read_text())["tokens"] == manifest["tokens"]  # not collected again
    g = open_gguf(str(out))
    assert has_nextn(g) and read_config(g).n_ff == 64
    assert len(g.metadata["speculant.mtp.draft_vocab"]) == 200  # the training vocabulary, drafted from
    summary = json.loads(g.metadata["speculant.training"])
    assert summary["steps"] == 60 and len(summary["held_out_accuracy"]) == 3
    assert summary["held_out_accuracy"][0] > 0.1  # it learned something of the target
    ps = [tiny.q2.tokenizer.encode_chat([{"role": "user", "content": "Show me the source of `speculant/engine.py`."}],
                                        add_generation_prompt=True)]
    _, plain = run(tiny.q2, ps, 32)
    engine, got = run(tiny.q2, ps, 32, make(tiny.q2, str(out)))
    assert got == plain and engine.spec_stats["mtp"].accepted > 0


def test_top1_weight_mixes_the_hard_cross_entropy_in(tiny):
    """`speculant train mtp --top1-weight w`: each unrolled step's loss is (1 - w) * the soft loss
    + w * the cross-entropy against the target's top-1; rows whose top-1 is outside the
    training vocabulary count in neither the hard term nor the accuracy."""
    from speculant_mtp.train.loop import step_losses

    net, steps, B, T, K = tiny.net, 2, 2, 6, 4
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 500, (B, T + steps), generator=gen)
    hidden = torch.randn(B, T, 64, generator=gen)
    ids = torch.randint(0, 500, (B, T + steps, K), generator=gen)
    p = torch.softmax(torch.randn(B, T + steps, K, generator=gen), -1)
    top1 = ids[..., 0].clone()
    top1[1, 2] = -1
    with torch.no_grad():
        soft, acc = step_losses(net, tokens, hidden, (ids, p, top1), steps)
        mixed, acc_mixed = step_losses(net, tokens, hidden, (ids, p, top1), steps, top1_weight=0.4)
        outs = net.unrolled(tokens, hidden, steps)
    assert acc == acc_mixed
    assert_top1_mixed(outs, top1, soft, mixed, 0.4)


def test_train_refuses_a_top1_weight_outside_0_to_1(tiny, tmp_path, capsys):
    from speculant.cli import main

    assert main(["train", "mtp", "-m", tiny.q2_path, "-o", str(tmp_path / "m.gguf"), "--data", str(tmp_path / "d"),
                 "--top1-weight", "-0.1"]) == 2
    assert "--top1-weight" in capsys.readouterr().err
