"""EAGLE3 on tiny models: llama.cpp's layout read back, the inference head equal to the
trainer's module (training-time test included), drafting kept in step with the target through
rejections and prompt chunks, and exactness alone, in chains and for concurrent sequences."""
from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from speculant import Batch, ModelFileError, SpeculantError
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_eagle3 import Eagle3Head
from speculant_eagle3.layout import write_head
from speculant_eagle3.testing import write_random_head

from drafter_spies import assert_top1_mixed, record_drafts, windowed_run as recorded_run

N_DRAFT = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3")
    target_path = write_tiny_model(d / "target.gguf", "qwen2", n_layers=4, n_embd=64, n_ctx=2048)
    head_path, net, d2t = write_random_head(d / "head.gguf", target_path, n_draft_vocab=N_DRAFT)
    torch.set_num_threads(1)
    target = load_model(target_path, progress=False)
    return SimpleNamespace(dir=d, target_path=target_path, target=target, head_path=head_path, net=net, d2t=d2t)


def make(tiny, names=("eagle3",), **options):
    return build_speculators(list(names), {"seed": 3, **options}, target=tiny.target, draft_model=tiny.head_path)


def run(model, prompts, n, speculators=(), params=SamplingParams(), **config):
    engine = Engine(model, EngineConfig(n_ctx=2048, **{"draft_n_max": 5, "adaptive": False, **config}), list(speculators))
    seqs = [engine.add(p, n, params) for p in prompts]
    while engine.active():
        engine.step()
    return engine, [s.tokens[s.n_prompt:] for s in seqs]


def prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def test_layout_read_back(tiny):
    head = load_model(tiny.head_path, progress=False)
    assert isinstance(head, Eagle3Head)
    c = head.config
    assert c.target_layers == tiny.net.cfg.target_layers and c.n_draft_vocab == N_DRAFT and c.target_hidden == 64
    assert head.d2t.tolist() == tiny.d2t.tolist()
    with pytest.raises(SpeculantError, match="EAGLE3 head"):
        head.forward(None, None)


def test_missing_keys_and_bad_files_are_one_line_errors(tiny, tmp_path):
    net = tiny.net
    weights = net.gguf_weights()
    del weights["blk.0.attn_norm_2.weight"]
    path = tmp_path / "broken.gguf"
    write_head(str(path), net.cfg, weights, target_path=tiny.target_path)
    with pytest.raises(ModelFileError, match="attn_norm_2"):
        load_model(str(path), progress=False)
    # a head_dim the weights were not made for is found at load, not in the first draft
    write_head(str(path), attrs.evolve(net.cfg, head_dim=net.cfg.head_dim // 2), net.gguf_weights(), target_path=tiny.target_path)
    with pytest.raises(ModelFileError, match=r"'blk.0.attn_q.weight' has shape .* expected"):
        load_model(str(path), progress=False)
    with pytest.raises(SpeculantError, match="not an EAGLE3 head"):
        build_speculators(["eagle3"], {}, target=tiny.target, draft_model=tiny.target_path)
    with pytest.raises(SpeculantError, match="-md"):
        build_speculators(["eagle3"], {}, target=tiny.target, draft_model=None)


def test_head_matches_the_training_module(tiny):
    """Step 0 over a history, then two draft steps from one anchor: the inference head (fp16 KV,
    the backend's kernels) computes what the trainer's unrolled module computes."""
    head = load_model(tiny.head_path, progress=False)
    T = 16
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 500, (1, T + 3), generator=gen)
    taps = torch.randn(1, T, 3 * 64, generator=gen)
    with torch.no_grad():
        ref = tiny.net.unrolled(toks, taps, 3)
    ctx = head.new_context(64)
    logits, pre = head.decode(Batch.for_sequence(0, 0, toks[0, :T].tolist(), logits="all"), ctx, head.encode(taps[0]),
                              tiny.target.embed)
    scale = ref[0].abs().max()
    assert (logits - ref[0][0]).abs().max() < 0.02 * scale
    anchor = 9
    ctx.truncate(0, anchor + 1)
    g = pre[anchor : anchor + 1]
    for j in (1, 2):
        step, g = head.decode(Batch.for_sequence(0, anchor + j, [int(toks[0, anchor + j])], logits="all"), ctx, g,
                              tiny.target.embed)
        assert (step[0] - ref[j][0, anchor]).abs().max() < 0.02 * scale


@pytest.mark.parametrize("chain", [("eagle3",), ("draft-eagle3",), ("ngram-simple", "eagle3")])
def test_greedy_equals_plain_for_concurrent_sequences(tiny, chain):
    ps = prompts(3, 20) + [prompts(1, 700, seed=5)[0]]  # one prompt longer than a prefill chunk
    _, plain = run(tiny.target, ps, 24)
    engine, out = run(tiny.target, ps, 24, make(tiny, chain))
    assert out == plain
    stats = engine.spec_stats.get(chain[-1])
    assert stats is not None and stats.drafted > 0


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
    for history, draft in seen[-4:]:
        n = len(history)
        ctx = tiny.target.new_context(2048)
        hidden = {}
        for start in range(0, n, 256):
            out = tiny.target.forward(Batch.for_sequence(0, start, list(history[start : start + 256]), logits="none"), ctx,
                                      hidden_layers=spec.hidden_layers)
            for l, h in out.hidden.items():
                hidden.setdefault(l, []).append(h)
        taps = torch.cat([torch.cat(hidden[l - 1]) for l in tiny.net.cfg.target_layers], -1)[None, : n - 1]
        ext = list(history) + list(draft.tokens)
        with torch.no_grad():
            steps = tiny.net.unrolled(torch.tensor([ext[1:]]), taps, len(draft))
        for j, token in enumerate(draft.tokens):
            top2 = steps[j][0, n - 2].topk(2)
            if float(top2.values[0] - top2.values[1]) > 0.05:  # not a near tie
                assert t2d[token] == int(top2.indices[0]), f"draft token {j} differs from a fresh computation"


def test_a_long_prompt_is_written_into_the_head_in_pieces(tiny):
    """The head catches up on a prompt CATCH_UP_ROWS rows a forward: all at once, a long prompt's
    temporaries doubled the head's memory (peak RSS), and greedy output stays plain decoding's."""
    from speculant_eagle3.speculator import CATCH_UP_ROWS

    spec = make(tiny)[0]
    sizes = []
    original = spec.head.decode
    spec.head.decode = lambda batch, *a, **k: sizes.append(len(batch)) or original(batch, *a, **k)
    prompt = prompts(1, 5 * CATCH_UP_ROWS + 7, seed=4)[0]
    _, (out,) = run(tiny.target, [prompt], 12, [spec])
    assert max(sizes) <= CATCH_UP_ROWS and sum(1 for n in sizes if n == CATCH_UP_ROWS) >= 5
    assert out == run(tiny.target, [prompt], 12)[1][0]


def test_a_head_trained_on_windows_attends_over_its_window_and_skips_older_rows(tiny, tmp_path):
    """A head that records a training window of 64 attends over its last 64 rows (its drafts
    differ from attending over all 600), computes only the rows those windows read (the drafts
    are the same as with every prompt row written), and the output stays plain decoding's;
    --spec-eagle3-window overrides the file."""
    head_path, _, _ = write_random_head(tmp_path / "head-windowed.gguf", tiny.target_path, n_draft_vocab=N_DRAFT,
                                        extra={"speculant.training": json.dumps({"window": 64, "steps": 1})})
    prompt = prompts(1, 600, seed=6)[0]
    plain = run(tiny.target, [prompt], 24)[1][0]

    def windowed_run(skip=True, **options):
        spec = build_speculators(["eagle3"], {"seed": 3, **options}, target=tiny.target, draft_model=head_path)[0]
        return (spec, *recorded_run(spec, lambda sp: run(tiny.target, [prompt], 24, [sp])[1][0], skip))

    spec, drafts, rows, out = windowed_run()
    assert spec.window == 64 and out == plain and len(drafts) >= 3
    _, drafts_all_rows, rows_all, out_all = windowed_run(skip=False)
    assert drafts_all_rows == drafts and out_all == plain
    assert rows_all - rows >= 600 - 64 - 2  # the prompt's rows before its window were not computed
    spec, drafts_full, _, out_full = windowed_run(spec_eagle3_window=0)
    assert spec.window == 0 and out_full == plain and drafts_full != drafts
    assert make(tiny)[0].window == 0  # a file that records no window: the whole context


def test_sampled_drafts_carry_probabilities_and_keep_the_distribution(tiny):
    """At temperature > 0 drafts come with the head's distribution over the target vocabulary
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
    # distribution of the second generated token (the first that can be drafted), 300 runs each
    def second_tokens(speculators):
        out = []
        for seed in range(300):
            eng = Engine(tiny.target, EngineConfig(n_ctx=2048, draft_n_max=3, adaptive=False), speculators)
            s = eng.add(prompt, 3, params(seed))
            while eng.active():
                eng.step()
            out.append(s.tokens[s.n_prompt + 1])
        return out
    a, b = second_tokens([]), second_tokens(make(tiny))
    keys = sorted(set(a) | set(b))
    ca, cb = np.array([a.count(k) for k in keys]), np.array([b.count(k) for k in keys])
    big = (ca + cb) >= 10
    chi2 = (((ca - cb) ** 2) / np.maximum(ca + cb, 1))[big].sum() + ((ca[~big].sum() - cb[~big].sum()) ** 2) / max(1, (ca + cb)[~big].sum())
    dof = int(big.sum())
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} with {dof} bins"


def test_train_command_collects_trains_resumes_and_exports(tiny, tmp_path):
    """`speculant train eagle3` with tiny settings: data, a checkpoint, a head that loads and
    drafts; a rerun with more steps resumes from the checkpoint instead of starting over."""
    import json

    from speculant.cli import main

    data, out = tmp_path / "data", tmp_path / "head.gguf"
    args = ["train", "eagle3", "-m", tiny.target_path, "-o", str(out), "--data", str(data), "--source",
            "core/speculant/*.py", "--tokens", "2000", "--piece-tokens", "100", "--batch", "2", "--window", "32",
            "--draft-vocab", "200", "--ffn", "64", "--save-every", "5", "--qtype", "F32", "--precision", "fp32", "-t", "1"]
    assert main(args + ["--steps", "10"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokens"] >= 2000 and manifest["taps"] == [1, 2, 3]
    assert torch.load(data / "ckpt.pt", weights_only=False)["step"] == 10
    assert main(args + ["--steps", "15"]) == 0
    assert torch.load(data / "ckpt.pt", weights_only=False)["step"] == 15
    assert json.loads((data / "manifest.json").read_text())["tokens"] == manifest["tokens"]  # not collected again
    head = load_model(str(out), progress=False)
    assert head.config.n_draft_vocab == 200 and head.config.n_ff == 64
    spec = build_speculators(["eagle3"], {}, target=tiny.target, draft_model=str(out))
    ps = prompts(2, 30, seed=4)
    _, plain = run(tiny.target, ps, 16)
    engine, out_tokens = run(tiny.target, ps, 16, spec)
    assert out_tokens == plain and engine.spec_stats["eagle3"].drafted > 0


def test_train_init_starts_from_a_trained_head(tiny, tmp_path):
    """`--init HEAD.gguf`: the new training starts from that head's weights and draft vocabulary
    (an F32 head round-trips exactly), and a head of another shape is refused by name."""
    from speculant.cli import main
    from speculant.gguf import open_gguf
    from speculant_eagle3.testing import head_config_for, target_embedding
    from speculant_eagle3.train.loop import init_from_head
    from speculant_eagle3.train.net import Eagle3Net

    base = ["-m", tiny.target_path, "--source", "core/speculant/*.py", "--tokens", "800", "--piece-tokens", "100",
            "--batch", "2", "--window", "32", "--draft-vocab", "200", "--ffn", "64", "--qtype", "F32", "--precision", "fp32", "-t", "1"]
    first = tmp_path / "first.gguf"
    assert main(["train", "eagle3", "-o", str(first), "--data", str(tmp_path / "a"), "--steps", "4", *base]) == 0
    cfg = head_config_for(tiny.target_path, n_draft_vocab=200, n_ff=64, target_layers=(1, 2, 3))
    net = Eagle3Net(cfg, target_embedding(tiny.target_path))
    d2t = init_from_head(net, str(first))
    g = open_gguf(str(first))
    assert d2t.tolist() == np.asarray(g.tensors["d2t"].data).reshape(-1).tolist()
    for name, w in net.gguf_weights().items():
        assert np.array_equal(w, np.asarray(g.tensors[name].data, dtype=np.float32).reshape(w.shape)), name
    second = tmp_path / "second.gguf"
    assert main(["train", "eagle3", "-o", str(second), "--data", str(tmp_path / "b"), "--steps", "2", "--init", str(first), *base]) == 0
    assert open_gguf(str(second)).tensors["d2t"].data.tolist() == g.tensors["d2t"].data.tolist()
    with pytest.raises(ValueError, match="ffn_gate"):
        init_from_head(Eagle3Net(head_config_for(tiny.target_path, n_draft_vocab=200, n_ff=96, target_layers=(1, 2, 3)),
                                 target_embedding(tiny.target_path)), str(first))


def test_top1_weight_mixes_the_hard_cross_entropy_in(tiny):
    """`--top1-weight w`: each step's loss is (1 - w) * the soft loss + w * the cross-entropy
    against the target's top-1; rows whose top-1 is outside the draft vocabulary count in
    neither the hard term nor the accuracy."""
    from speculant_eagle3.testing import head_config_for, target_embedding
    from speculant_eagle3.train.loop import step_losses
    from speculant_eagle3.train.net import Eagle3Net

    torch.manual_seed(0)
    cfg = head_config_for(tiny.target_path, n_draft_vocab=50, n_ff=64, target_layers=(1, 2, 3))
    net = Eagle3Net(cfg, target_embedding(tiny.target_path))
    B, T, K, steps = 2, 6, 4, 2
    tokens = torch.randint(0, 50, (B, T + steps))
    taps = torch.randn(B, T, 3 * cfg.n_embd)
    ids = torch.randint(0, 50, (B, T + steps, K))
    p = torch.softmax(torch.randn(B, T + steps, K), -1)
    top1 = ids[..., 0].clone()
    top1[0, 1] = -1  # a top-1 the draft vocabulary lacks
    labels = (ids, p, top1)
    with torch.no_grad():
        soft, acc = step_losses(net, tokens, taps, labels, steps)
        mixed, acc_mixed = step_losses(net, tokens, taps, labels, steps, top1_weight=0.25)
        outs = net.unrolled(tokens, taps, steps)
    assert acc == acc_mixed
    assert_top1_mixed(outs, top1, soft, mixed, 0.25)


def test_train_refuses_a_top1_weight_outside_0_to_1(tiny, tmp_path, capsys):
    from speculant.cli import main

    assert main(["train", "eagle3", "-m", tiny.target_path, "-o", str(tmp_path / "h.gguf"), "--data", str(tmp_path / "d"),
                 "--top1-weight", "1.5"]) == 2
    assert "--top1-weight" in capsys.readouterr().err


def test_layout_keeps_the_norm_epsilon(tmp_path):
    """The head's RMSNorm epsilon is read back from the key the writer writes (a target whose
    epsilon is not the 1e-6 default shows a misspelt key)."""
    target_path = write_tiny_model(tmp_path / "target.gguf", "qwen2", n_layers=4, n_embd=64, rms_eps=1e-5)
    head_path, net, _ = write_random_head(tmp_path / "head.gguf", target_path)
    assert net.cfg.eps == pytest.approx(1e-5)
    assert load_model(head_path, progress=False).config.eps == pytest.approx(1e-5)


def test_windows_drawn_by_rows_follow_the_documents_lengths():
    """`--sample-by-rows`: a window's document is drawn in proportion to its rows, so one long
    document among short ones gives about its share of the windows; by default every document
    is drawn alike. The held-out batches (docs passed in) stay uniform."""
    from speculant_eagle3.train.loop import Batches

    docs = [(0, 0, 1000)] + [(0, 1000 + 100 * i, 1100 + 100 * i) for i in range(9)]  # 1000 rows, then 9 x 100
    t2d = torch.arange(10)

    def share_of_long(by_rows):
        b = Batches(None, docs, t2d, window=64, steps=3, seed=0, by_rows=by_rows)
        picked = []
        b.window_of = lambda doc: picked.append(doc) or (torch.zeros(8, dtype=torch.long),) * 4 + (5,)
        b.labels = lambda ids, p: None
        for _ in range(400):
            b.batch(5)
        return sum(d == docs[0] for d in picked) / len(picked)

    assert 0.45 < share_of_long(True) < 0.58   # 1000 of 1900 rows: 0.53
    assert 0.06 < share_of_long(False) < 0.15  # 1 of 10 documents
