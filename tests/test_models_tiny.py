"""The transformer architectures on tiny random GGUF models, every supported tensor type.

Correctness: the model's logits against an independent float64 forward written here from the
file's weights as gguf-py dequantizes them (llama: adjacent-pair rope; qwen2/qwen3/gemma3:
NEOX halves; gemma3: scaled embedding, q/k norms, post norms, GELU, sliding/global layers).
With the CPU backend (bf16 matmuls) the tolerance is loose; with a float32 test backend
registered through `extra_plugins` it is tight, which pins the architecture code itself.

Bit-exactness, which speculative decoding rests on: a row's logits may not depend on how many
rows are computed with it, on other sequences in the batch, or on a KV truncate before it.
"""
from __future__ import annotations

import os
import types
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from speculant import Batch, hookimpl
from speculant.gguf.quants import dequantize
from speculant.loader import load_model
from speculant.plugins import load_registry
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_cpu.backend import CpuBackend

ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SOME_TYPES = {  # per other architecture: a dense, a 4-bit (torch int4 kernel) and a K-quant type
    "qwen2": ("BF16", "Q4_1", "Q5_K"),
    "qwen3": ("F16", "Q4_K", "Q6_K"),
    "gemma3": ("F32", "Q8_0", "Q4_0", "Q3_K"),
}
CASES = [("llama", t) for t in ALL_TYPES] + [(a, t) for a, ts in SOME_TYPES.items() for t in ts]
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
N_VOCAB = 512
WINDOW = 4  # gemma3's sliding window in these models: short, so 12-token sequences feel it

# Shapes: GQA everywhere; qwen3 and gemma3 with head_dim != n_embd / n_head as their real configs;
# gemma3 with 6 layers, so layer 5 is a global-attention layer, and one kv head like gemma-3-270m.
ARCH_DIMS = {
    "llama": dict(n_layers=2, n_head=4, n_kv_head=2),
    "qwen2": dict(n_layers=2, n_head=4, n_kv_head=2),
    "qwen3": dict(n_layers=2, n_head=4, n_kv_head=2, head_dim=32),
    "gemma3": dict(n_layers=6, n_head=4, n_kv_head=1, head_dim=32, sliding_window=WINDOW),
}


def _dims(arch: str, qtype: str) -> dict:
    d = dict(ARCH_DIMS[arch], n_vocab=N_VOCAB, seed=11)
    if qtype.endswith("_K"):  # K-quant rows are multiples of 256 values
        d.update(n_embd=256, n_ff=256, head_dim=64)
    else:
        d.update(n_embd=64, n_ff=128)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Backends built here use one thread: the matrices are tiny, and OpenMP threads spinning at
    barriers make these hundreds of small forwards ~10x slower on a loaded machine.
    (test_rows_do_not_depend_on_batch_size_default_threads covers the default.)"""
    old_env, old_threads = os.environ.get("SPECULANT_THREADS"), torch.get_num_threads()
    os.environ["SPECULANT_THREADS"] = "1"
    yield
    if old_env is None:
        del os.environ["SPECULANT_THREADS"]
    else:
        os.environ["SPECULANT_THREADS"] = old_env
    torch.set_num_threads(old_threads)


_files: dict = {}
_models: dict = {}


def model_file(model_dir, arch: str, qtype: str, **overrides) -> str:
    key = (arch, qtype, tuple(sorted(overrides.items())))
    if key not in _files:
        name = f"{arch}-{qtype}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) + ".gguf"
        _files[key] = write_tiny_model(model_dir / name, arch, qtype=qtype, **{**_dims(arch, qtype), **overrides})
    return _files[key]


def get_model(model_dir, arch: str, qtype: str, backend: str = "cpu", **overrides):
    path = model_file(model_dir, arch, qtype, **overrides)
    key = (path, backend)
    if key not in _models:
        registry = _f32_registry() if backend == "f32" else None
        _models[key] = load_model(path, backend=backend, registry=registry, progress=False)
    return _models[key]


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, N_VOCAB, n).tolist()


# ---------------------------------------------------------------------------------------------
# A float32 backend for tight checks of the architecture code, registered as a test plugin
# ---------------------------------------------------------------------------------------------

class F32Backend(CpuBackend):
    """The CPU backend with plain float32 dense matmuls (no bf16 rounding, no int4 packing)."""

    name = "f32"

    def __init__(self, threads=None):
        super().__init__(threads, use_native=False)  # float32 KV cache and attention too

    def linear(self, weight, bias=None):
        w = dequantize(weight.data, weight.qtype, weight.shape)
        b = None if bias is None else self.tensor(bias)
        return lambda x: F.linear(x, w, b)


@lru_cache(maxsize=1)
def _f32_registry():
    plugin = types.SimpleNamespace(speculant_register_backends=hookimpl(lambda register: register("f32", F32Backend)))
    return load_registry(extra_plugins=[("test-f32-backend", plugin)])


# ---------------------------------------------------------------------------------------------
# The independent reference forward (float64 NumPy, one sequence from position 0)
# ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def read_weights(path: str) -> tuple[dict, dict]:
    """(metadata, {name: float64 array in PyTorch order}) through gguf-py's reader and dequantizer."""
    r = GGUFReader(path)
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    weights = {}
    for t in r.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        weights[t.name] = np.asarray(gguf_dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64).reshape(shape)
    return md, weights


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, base, neox):
    """x [n, heads, d]: rotate pairs (i, i + d/2) (NEOX) or (2i, 2i+1) by pos * base^(-2i/d)."""
    d = x.shape[-1]
    i = np.arange(d // 2)
    a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
    angle = pos[:, None].astype(np.float64) * base ** (-2.0 * i / d)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = np.empty_like(x)
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., a] * sin + x[..., b] * cos
    return out


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference_forward(path: str, toks: list[int], window: int | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits [n, n_vocab] and hidden states (output of each layer, then the final-normed one).
    `window` overrides gemma3's sliding window (0: none)."""
    md, W = read_weights(path)
    arch = md["general.architecture"]

    def key(k, default=None):
        return md.get(f"{arch}.{k}", default)

    n_embd, n_layers, n_head = key("embedding_length"), key("block_count"), key("attention.head_count")
    n_kv = key("attention.head_count_kv", n_head)
    hd = key("attention.key_length", n_embd // n_head)
    eps, base = key("attention.layer_norm_rms_epsilon"), key("rope.freq_base")
    gemma = arch == "gemma3"
    if window is None:
        window = key("attention.sliding_window", 0) if gemma else 0
    n = len(toks)
    pos = np.arange(n)

    x = W["token_embd.weight"][toks]
    if gemma:
        x = x * np.sqrt(n_embd)
    hidden = []
    for layer in range(n_layers):
        p = f"blk.{layer}."
        sliding = gemma and window > 0 and (layer + 1) % 6 != 0
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q, k, v = (h @ W[p + f"attn_{t}.weight"].T + W.get(p + f"attn_{t}.bias", 0.0) for t in "qkv")
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        if p + "attn_q_norm.weight" in W:
            q, k = _rms(q, W[p + "attn_q_norm.weight"], eps), _rms(k, W[p + "attn_k_norm.weight"], eps)
        rope_base = 10000.0 if sliding else base
        q, k = _rope(q, pos, rope_base, arch != "llama"), _rope(k, pos, rope_base, arch != "llama")
        att = np.zeros((n, n_head, hd))
        for t in range(n):
            lo = max(0, t + 1 - window) if sliding else 0
            for head in range(n_head):
                kv = head // (n_head // n_kv)
                scores = k[lo : t + 1, kv] @ q[t, head] / np.sqrt(hd)
                w = np.exp(scores - scores.max())
                att[t, head] = (w / w.sum()) @ v[lo : t + 1, kv]
        o = att.reshape(n, n_head * hd) @ W[p + "attn_output.weight"].T
        x = x + (_rms(o, W[p + "post_attention_norm.weight"], eps) if gemma else o)
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        gate, up = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        f = ((_gelu_tanh(gate) if gemma else _silu(gate)) * up) @ W[p + "ffn_down.weight"].T
        x = x + (_rms(f, W[p + "post_ffw_norm.weight"], eps) if gemma else f)
        hidden.append(x)
    final = _rms(x, W["output_norm.weight"], eps)
    hidden.append(final)
    return final @ W.get("output.weight", W["token_embd.weight"]).T, hidden


def assert_close_to_reference(got: torch.Tensor, ref: np.ndarray, rel: float) -> None:
    """max |got - ref| <= rel * std(ref), and the same top-1 wherever the reference's top-2
    margin exceeds twice that tolerance."""
    got = got.double().numpy()
    scale = ref.std()
    err = np.abs(got - ref).max()
    assert err <= rel * scale, f"max |logit error| {err:.4g} > {rel} * logit std {scale:.3g}"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * rel * scale
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


# ---------------------------------------------------------------------------------------------
# (1) Correct logits
# ---------------------------------------------------------------------------------------------

# bf16 weights and activations in the matmuls: measured max error ~2-3% of the logit std for the
# 2-layer llama family, ~6-9% for the 6-layer tied gemma3 (its large output norm amplifies);
# any architectural mistake (rope style, window, norms) gives errors of ~100%.
LOOSE = {"llama": 0.06, "qwen2": 0.06, "qwen3": 0.06, "gemma3": 0.2}


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_logits_match_reference(model_dir, arch, qtype):
    model = get_model(model_dir, arch, qtype)
    assert model.info.architecture == arch and model.info.n_vocab == N_VOCAB
    toks = tokens(12, seed=1)
    out = model.forward(Batch.for_sequence(0, 0, toks, logits="all"), model.new_context(64))
    assert out.logits.shape == (12, N_VOCAB) and out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all()
    assert out.hidden == {}
    ref, _ = reference_forward(model_file(model_dir, arch, qtype), toks)
    assert_close_to_reference(out.logits, ref, LOOSE[arch])


@pytest.mark.parametrize("arch,qtype", [(a, "F32") for a in ARCHS] + [("llama", "Q4_K"), ("gemma3", "Q6_K")])
def test_architecture_exact_with_float32_backend(model_dir, arch, qtype):
    """Without bf16 rounding the model equals the float64 reference to float32 precision, so
    small details count too (rope bases, eps, scales, the global layer of gemma3)."""
    model = get_model(model_dir, arch, qtype, backend="f32")
    assert isinstance(model.backend, F32Backend)
    toks = tokens(12, seed=2)
    out = model.forward(Batch.for_sequence(0, 0, toks, logits="all"), model.new_context(64))
    ref, _ = reference_forward(model_file(model_dir, arch, qtype), toks)
    assert_close_to_reference(out.logits, ref, 1e-4)


@pytest.mark.parametrize("arch,qtype", [("qwen2", "Q4_K"), ("llama", "F32")])
def test_ffn_gate_and_up_lying_back_to_back_are_one_product_with_the_same_bits(model_dir, arch, qtype):
    """The tiny models' writer puts each layer's ffn_gate and ffn_up back to back, as llama.cpp's
    converters do: the llama family computes them as one product over the joined rows, and its
    logits are those of the two products computed apart, bit for bit, prompt and decode rows."""
    from speculant.gguf import open_gguf

    path = model_file(model_dir, arch, qtype)
    model = load_model(path, progress=False)
    assert all(b.w_gate_up is not None and b.w_gate is None for b in model.blocks)
    toks = tokens(10, seed=4)

    def logits():
        ctx = model.new_context(64)
        first = model.forward(Batch.for_sequence(0, 0, toks[:8], logits="all", prompt_len=8), ctx).logits
        return torch.cat([first, model.forward(Batch.for_sequence(0, 8, toks[8:], logits="all", prompt_len=8), ctx).logits])

    joined = logits()
    g = open_gguf(path)
    for i, b in enumerate(model.blocks):
        b.w_gate = model.backend.linear(g.tensors[f"blk.{i}.ffn_gate.weight"])
        b.w_up = model.backend.linear(g.tensors[f"blk.{i}.ffn_up.weight"])
        b.w_gate_up = None
    assert torch.equal(logits(), joined)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_layers_give_the_bits_of_the_layer_piece_by_piece(model_dir, arch):
    """With the native kernels, the llama family runs each layer as one backend call
    (BackendKernels.fused_layer; the last layer only in batches without prompt rows, whose FFN it
    computes as decode rows): its logits, hidden states and cache rows are those of the layer run
    piece by piece, bit for bit: short-prompt rows (llama.cpp's prompt arithmetic), decode rows,
    rows past LLAMA_SPLIT_KV, two sequences in one batch."""
    model = load_model(model_file(model_dir, arch, "Q4_K", n_layers=3), progress=False)
    assert [f is not None for f in model.fused] == [True, True, True]
    last_calls = []
    model.fused[2] = lambda x, rows, f=model.fused[2]: last_calls.append(len(x)) or f(x, rows)
    t = tokens(300, seed=5)

    def run():
        out, ctx = [], model.new_context(320)
        out.append(model.forward(Batch.for_sequence(0, 0, t[:20], logits="all", prompt_len=20), ctx, hidden_layers=(0, 1)))
        out.append(model.forward(Batch.for_sequence(0, 20, t[20:23], logits="all", prompt_len=20), ctx, hidden_layers=(0,)))
        out.append(model.forward(Batch.for_sequence(1, 0, t[:280], logits="last", prompt_len=280), ctx))
        two = Batch((0, 0, 1), (23, 24, 280), (t[23], t[24], t[280]), (True, True, True), (20, 20, 280))
        out.append(model.forward(two, ctx, hidden_layers=(1,)))
        logits = [o.logits for o in out]
        hidden = [h for o in out for _, h in sorted(o.hidden.items())]
        return logits + hidden + [torch.cat([k.flatten() for k in ctx.buffers(layer, s)]) for layer in range(3) for s in (0, 1)]

    fused = run()
    assert last_calls == [3, 3]  # the decode batches; the prompts ran the last layer piece by piece
    model.fused = [None] * 3
    assert all(torch.equal(a, b) for a, b in zip(fused, run()))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_long_prefill_matches_reference(model_dir, arch):
    """A prompt longer than the per-row attention limit takes the masked batched attention path
    (causal, and gemma3's window); its last rows must still match the reference."""
    model = get_model(model_dir, arch, "F32", backend="f32")
    toks = tokens(80, seed=3)
    out = model.forward(Batch.for_sequence(0, 0, toks, logits="all"), model.new_context(128))
    ref, _ = reference_forward(model_file(model_dir, arch, "F32"), toks)
    assert_close_to_reference(out.logits, ref, 1e-4)


# ---------------------------------------------------------------------------------------------
# (2)-(4) Bit-exactness: batch size, other sequences, KV truncate
# ---------------------------------------------------------------------------------------------

def feed(model, context, seq_id, start, toks, chunk):
    """Feed toks in chunks of `chunk` rows, all logits; returns [len(toks), n_vocab]."""
    out = []
    for i in range(0, len(toks), chunk):
        part = toks[i : i + chunk]
        out.append(model.forward(Batch.for_sequence(seq_id, start + i, part, logits="all"), context).logits)
    return torch.cat(out)


BATCH_CASES = [pytest.param(a, t, id=f"{a}-{t}") for a, t in CASES]


@pytest.mark.parametrize("arch,qtype", BATCH_CASES)
def test_rows_do_not_depend_on_batch_size(model_dir, arch, qtype):
    model = get_model(model_dir, arch, qtype)
    prompt, rows = tokens(7, seed=4), tokens(16, seed=5)
    results = {}
    for chunk in (1, 2, 3, 8, 16):
        ctx = model.new_context(64)
        model.forward(Batch.for_sequence(0, 0, prompt, logits="last"), ctx)
        results[chunk] = feed(model, ctx, 0, len(prompt), rows, chunk)
        assert ctx.length(0) == len(prompt) + len(rows)
    for chunk in (2, 3, 8, 16):
        assert torch.equal(results[chunk], results[1]), f"{chunk} rows at a time differ from one at a time"


@pytest.mark.parametrize("qtype", ["F32", "Q4_K"])
def test_rows_do_not_depend_on_batch_size_default_threads(model_dir, monkeypatch, qtype):
    monkeypatch.delenv("SPECULANT_THREADS")
    try:
        model = load_model(model_file(model_dir, "llama", qtype), progress=False)  # all cores
        prompt, rows = tokens(7, seed=4), tokens(16, seed=5)
        results = []
        for chunk in (1, 3, 16):
            ctx = model.new_context(64)
            model.forward(Batch.for_sequence(0, 0, prompt, logits="last"), ctx)
            results.append(feed(model, ctx, 0, len(prompt), rows, chunk))
        assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0])
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_sequences_in_one_batch_equal_each_alone(model_dir, arch, qtype):
    model = get_model(model_dir, arch, qtype)
    # seq id -> (prompt, continuation); ids not in row order, lengths and positions all differ
    seqs = {7: (tokens(3, 10), tokens(1, 11)), 2: (tokens(9, 12), tokens(5, 13)),
            5: (tokens(1, 14), tokens(3, 15)), 0: (tokens(14, 16), tokens(2, 17))}
    alone = {}
    for sid, (prompt, cont) in seqs.items():
        ctx = model.new_context(64)
        first = model.forward(Batch.for_sequence(sid, 0, prompt, logits="all"), ctx).logits
        second = model.forward(Batch.for_sequence(sid, len(prompt), cont, logits="all"), ctx).logits
        alone[sid] = (first, second)

    ctx = model.new_context(64)
    for step, order in enumerate([(7, 2, 5, 0), (0, 5, 7, 2)]):
        parts = []
        for sid in order:
            prompt, cont = seqs[sid]
            parts.append(Batch.for_sequence(sid, 0, prompt, "all") if step == 0
                         else Batch.for_sequence(sid, len(prompt), cont, "all"))
        batch = Batch.concat(parts)
        assert len(batch.groups()) == 4
        logits = model.forward(batch, ctx).logits
        assert logits.shape == (len(batch), N_VOCAB)
        row = 0
        for sid, part in zip(order, parts):
            assert torch.equal(logits[row : row + len(part)], alone[sid][step]), f"sequence {sid}, step {step}"
            row += len(part)
    for sid, (prompt, cont) in seqs.items():
        assert ctx.length(sid) == len(prompt) + len(cont)


def _order_probe(k: int, rows: int) -> float:
    """y[0, 0] of the CPU backend's dense bf16 linear for x rows [1, .., 2^30, .., -2^30, .., 1] and
    an all-ones weight: exact value k-2, but float32 sums lose the ones added while 2^30 is in the
    partial sum, so the result tells the order in which the kernel accumulated row 0."""
    x = torch.ones(rows, k)
    x[:, 3], x[:, k - 5] = 2.0**30, -(2.0**30)
    lin = CpuBackend(use_native=False).linear(types.SimpleNamespace(data=np.ones((16, k), np.float32), qtype=Q.F32, shape=(16, k)))
    return lin(x)[0, 0].item()


def test_cpu_dense_linear_is_batch_invariant():
    for k in (64, 256, 1536):
        results = {rows: _order_probe(k, rows) for rows in (1, 2, 3, 4, 8, 16, 64)}
        assert len(set(results.values())) == 1, f"K={k}: row 0's result by number of rows: {results}"


def test_cpu_int4_linear_is_batch_invariant():
    """The same probe for the int4 kernel (Q4_0/Q4_1/Q4_K weights)."""
    for k in (64, 256, 1536):
        # Q4_0 blocks of (9 - 8) * 1.0: f16 d=1, then 16 bytes of nibbles 9
        block = np.concatenate([np.frombuffer(np.float16(1.0).tobytes(), np.uint8), np.full(16, 0x99, np.uint8)])
        info = types.SimpleNamespace(data=np.tile(block, (16, k // 32)), qtype=Q.Q4_0, shape=(16, k))
        lin = CpuBackend(use_native=False).linear(info)
        assert type(lin).__name__ == "Int4Linear"
        results = set()
        for rows in (1, 2, 3, 4, 8, 16, 64):
            x = torch.ones(rows, k)
            x[:, 3], x[:, k - 5] = 2.0**30, -(2.0**30)
            results.add(lin(x)[0, 0].item())
        assert len(results) == 1, (k, results)


def test_int4_weight_with_rows_not_multiple_of_16_loads(model_dir):
    # one kv head of head_dim 8: attn_k/attn_v have 8 rows
    path = model_file(model_dir, "llama", "Q4_0", n_head=8, n_kv_head=1)
    model = load_model(path, progress=False)
    toks = tokens(12, seed=1)
    out = model.forward(Batch.for_sequence(0, 0, toks, logits="all"), model.new_context(64))
    assert_close_to_reference(out.logits, reference_forward(path, toks)[0], LOOSE["llama"])


def test_partial_want_logits_returns_wanted_rows_in_order(model_dir):
    model = get_model(model_dir, "qwen2", "BF16")
    a, b = tokens(5, 20), tokens(4, 21)
    ctx = model.new_context(32)
    full = model.forward(Batch.concat([Batch.for_sequence(1, 0, a, "all"), Batch.for_sequence(3, 0, b, "all")]), ctx).logits
    ctx = model.new_context(32)
    batch = Batch.concat([Batch.for_sequence(1, 0, a, "last"), Batch.for_sequence(3, 0, b, "none")])
    out = model.forward(batch, ctx)
    assert torch.equal(out.logits, full[4:5])
    ctx = model.new_context(32)
    want = (True, False, True, False, False, False, True, True, False)
    out = model.forward(Batch(batch.seq_ids, batch.positions, batch.tokens, want), ctx)
    assert torch.equal(out.logits, full[[0, 2, 6, 7]])
    # a prompt chunk without logits still fills the cache
    ctx = model.new_context(32)
    out = model.forward(Batch.for_sequence(0, 0, a, "none"), ctx)
    assert out.logits.shape == (0, N_VOCAB) and ctx.length(0) == 5


def test_batch_must_continue_each_sequence(model_dir):
    model = get_model(model_dir, "llama", "F32")
    ctx = model.new_context(32)
    model.forward(Batch.for_sequence(0, 0, tokens(4), "last"), ctx)
    with pytest.raises(ValueError, match="position"):  # a gap after the cached rows
        model.forward(Batch.for_sequence(0, 5, tokens(2), "last"), ctx)
    with pytest.raises(ValueError, match="position"):  # a sequence split in two runs of rows
        model.forward(Batch.concat([Batch.for_sequence(0, 4, [1], "all"), Batch.for_sequence(1, 0, [2], "all"),
                                    Batch.for_sequence(0, 5, [3], "all")]), ctx)


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("qwen2", "Q5_K"), ("qwen3", "F16"), ("gemma3", "Q8_0")])
def test_kv_truncate_then_new_tokens_equals_fresh_context(model_dir, arch, qtype):
    model = get_model(model_dir, arch, qtype)
    first, other = tokens(10, 30), tokens(4, 31)
    assert first[6:] != other
    ctx = model.new_context(64)
    model.forward(Batch.for_sequence(0, 0, first, "all"), ctx)
    ctx.truncate(0, 6)
    assert ctx.length(0) == 6
    got = model.forward(Batch.for_sequence(0, 6, other, "all"), ctx).logits
    got_next = model.forward(Batch.for_sequence(0, 10, [5], "all"), ctx).logits
    assert ctx.length(0) == 11

    fresh = model.new_context(64)  # the same 10 tokens, chunked the same way
    model.forward(Batch.for_sequence(0, 0, first[:6], "all"), fresh)
    want = model.forward(Batch.for_sequence(0, 6, other, "all"), fresh).logits
    want_next = model.forward(Batch.for_sequence(0, 10, [5], "all"), fresh).logits
    assert torch.equal(got, want) and torch.equal(got_next, want_next)

    at_once = model.new_context(64)  # and fed all at once (batch invariance)
    all10 = model.forward(Batch.for_sequence(0, 0, first[:6] + other, "all"), at_once).logits
    assert torch.equal(all10[6:], got)
    # the stale rows 6..9 really were different: the logits of `first` there are not these
    stale = model.forward(Batch.for_sequence(0, 0, first, "all"), model.new_context(64)).logits
    assert not torch.equal(stale[6:], got)


# ---------------------------------------------------------------------------------------------
# (5) Hidden states
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("qwen2", "BF16"), ("qwen3", "Q4_K"), ("gemma3", "F32")])
def test_hidden_layers(model_dir, arch, qtype):
    model = get_model(model_dir, arch, qtype)
    n_layers, n_embd = model.info.n_layers, model.info.n_embd
    toks = tokens(9, 40)
    ctx = model.new_context(64)
    layers = (0, n_layers - 1, n_layers)
    out = model.forward(Batch.for_sequence(0, 0, toks, "last"), ctx, hidden_layers=layers)
    assert sorted(out.hidden) == sorted(layers)
    for layer in layers:  # every row, not only the rows with logits
        h = out.hidden[layer]
        assert h.shape == (9, n_embd) and h.dtype == torch.float32 and torch.isfinite(h).all()
    assert out.logits.shape == (1, N_VOCAB)
    # the last entry is the final-normed state the output head reads
    assert torch.allclose(out.logits, model.output(out.hidden[n_layers][-1:]))
    _, ref_hidden = reference_forward(model_file(model_dir, arch, qtype), toks)
    for layer in layers:
        ref = ref_hidden[layer]
        err = np.abs(out.hidden[layer].double().numpy() - ref).max()
        assert err <= LOOSE[arch] * np.abs(ref).max(), f"hidden {layer}: max error {err:.3g}"
    # hidden states of a decode step; a prompt chunk without logits still returns them
    step = model.forward(Batch.for_sequence(0, 9, [3, 4], "none"), ctx, hidden_layers=(1,))
    assert step.logits.shape == (0, N_VOCAB) and list(step.hidden) == [1] and step.hidden[1].shape == (2, n_embd)


# ---------------------------------------------------------------------------------------------
# (6) Gemma 3's sliding window
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,rel", [("cpu", LOOSE["gemma3"]), ("f32", 1e-4)])
def test_gemma3_sliding_window_is_applied(model_dir, backend, rel):
    windowed = get_model(model_dir, "gemma3", "F32", backend)  # sliding_window=4
    assert windowed.config.window == WINDOW
    wide = get_model(model_dir, "gemma3", "F32", backend, sliding_window=64)  # same weights, window > sequence
    toks = tokens(12, 50)
    got = windowed.forward(Batch.for_sequence(0, 0, toks, "all"), windowed.new_context(64)).logits
    no_window = wide.forward(Batch.for_sequence(0, 0, toks, "all"), wide.new_context(64)).logits
    # rows 0..3 see at most 4 keys, so the window changes nothing there; later rows differ a lot
    assert torch.equal(got[:WINDOW], no_window[:WINDOW])
    assert (got[WINDOW:] - no_window[WINDOW:]).abs().amax(-1).min() > got.std()  # >> the tolerance
    path = model_file(model_dir, "gemma3", "F32")
    ref, _ = reference_forward(path, toks)
    assert_close_to_reference(got, ref, rel)
    ref_no_window, _ = reference_forward(path, toks, window=64)
    assert_close_to_reference(no_window, ref_no_window, rel)
    # one row at a time through the cache: the window is applied per row too
    one_by_one = feed(windowed, windowed.new_context(64), 0, 0, toks, 1)
    if backend == "cpu":
        assert torch.equal(one_by_one, got)
    else:  # float32 matmuls are not batch-invariant, only close
        assert torch.allclose(one_by_one, got, atol=1e-4 * got.std().item())
