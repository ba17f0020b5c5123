"""The screened output head (speculant_cpu.screen): greedy rows' argmax from a Q4_K copy of the
head and a bound, then the exact logits of the candidates.

What must hold: the bound contains every exact logit (so the candidates hold the argmax), the
selection keeps exactly the tokens whose upper bound reaches the best lower bound, the argmax
is the full head's bit for bit in every row kind, and greedy decoding writes the same tokens
with and without the screen. Only greedy rows without logprobs or a grammar may take it."""
from __future__ import annotations

import math
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from speculant import Batch
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_cpu import native, screen
from speculant_cpu.backend import NativeLinear

lib = native.load()
pytestmark = pytest.mark.skipif(lib is None, reason=f"native kernels unavailable here: {native.why_unavailable()}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny qwen2 whose head is Q6_K with rows of 256 values: the screen applies."""
    path = write_tiny_model(tmp_path_factory.mktemp("screen") / "m.gguf", "qwen2", qtype="Q6_K", n_vocab=2048,
                            n_embd=256, n_ff=256, n_head=4, n_kv_head=2, head_dim=64, n_layers=2, seed=5)
    m = load_model(path, threads=2, progress=False)
    assert m.argmax_output is not None and m.argmax_output.wait(), m.argmax_output and m.argmax_output.error
    return m


def _inputs(rng, rows, k):
    """Final-norm-like rows, some with a few large values (the bound's worst case)."""
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.5, 8.0, (rows, 1)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 10
    return torch.from_numpy(x)


def test_bound_holds_and_selection_is_exact(model):
    """|exact - approx| <= q_v * x_bound + slack for every token, and spk_screen_select keeps
    exactly {v : approx_v + half_v >= max_u (approx_u - half_u)}."""
    head, sh = model.output, model.argmax_output
    scr = sh.screen
    rng = np.random.default_rng(0)
    for trial in range(8):
        x = _inputs(rng, 2, sh.k)
        exact, approx = head(x), torch.empty(2, sh.n)
        assert lib.spk_linear(int(screen.SCREEN_QTYPE), scr.q4.ctypes.data, sh.n, sh.k, x.data_ptr(), 2, approx.data_ptr()) == 0
        xb = ((x.double().norm(dim=1) + math.sqrt(sh.k) * x.abs().amax(1).double() / 254) * (1 + 1e-6)).float()
        half = torch.from_numpy(scr.qv)[None, :] * xb[:, None] + screen.ABS_SLACK
        assert ((exact - approx).abs() <= half).all()
        idx = np.empty((2, screen.CAP), np.int32)
        counts = np.empty(2, np.int64)
        xbn = xb.numpy()
        lib.spk_screen_select(approx.data_ptr(), 2, sh.n, scr.qv.ctypes.data, xbn.ctypes.data, screen.ABS_SLACK,
                              idx.ctypes.data, screen.CAP, counts.ctypes.data)
        for i in range(2):
            lo = (approx[i] - half[i]).max()
            want = torch.nonzero(approx[i] + half[i] >= lo).flatten().numpy()
            assert counts[i] == len(want) and (idx[i, : counts[i]] == want).all()
            assert int(exact[i].argmax()) in want


@pytest.mark.parametrize("position,prompt_len", [(300, 1000), (20, 30)])  # a row of kind 4 (canonical), of kind 0
def test_argmax_is_the_full_heads(model, position, prompt_len):
    head, sh = model.output, model.argmax_output
    rng = np.random.default_rng(position)
    screened_any = False
    for trial in range(20):
        rows = 1 + trial % min(sh.max_rows, 5)
        x = _inputs(rng, rows, sh.k)
        b = Batch.for_sequence(0, position, [1] * rows, logits="all", prompt_len=prompt_len)
        with model.backend.batch(b, prompt=False):
            full, fast = head(x), sh(x)
        assert fast is not None and fast.shape == full.shape
        assert torch.equal(full.argmax(1), fast.argmax(1))
        kept = torch.isfinite(fast)
        assert torch.equal(fast[kept], full[kept])  # the candidates' logits are the head's bits
        screened_any |= bool((~kept).any())
    assert screened_any, "the screen never left a token out: it did not screen"


def test_ties_go_to_the_first_maximum(model):
    """Two identical head rows give equal exact logits: the screen must return the lower index,
    as the full head's argmax does."""
    head = model.output
    x = _inputs(np.random.default_rng(3), 1, head.in_features)
    best = int(head(x).argmax())
    raw = np.array(head.raw).reshape(head.out_features, -1)
    twin = 0 if best else 1  # a copy of the best row, before it (or after it when it is row 0)
    raw[twin] = raw[best]
    info = types.SimpleNamespace(data=raw, qtype=head.qtype, shape=(head.out_features, head.in_features))
    twins = NativeLinear(model.backend, lib, info, None)
    sh = screen.ScreenedHead(twins, background=False)
    full, fast = twins(x), sh(x)
    assert torch.equal(full[0, min(best, twin)], full[0, max(best, twin)])
    assert int(fast.argmax()) == int(full.argmax()) == min(best, twin)


def test_greedy_decoding_is_the_same_with_and_without(model):
    prompt = model.tokenizer.encode("def add(a, b):\n    return", parse_special=False)
    outs = []
    for use in (True, False):
        keep = model.argmax_output
        model.argmax_output = keep if use else None
        try:
            outs.append(list(Engine(model, EngineConfig(), []).generate(prompt, 24)))
        finally:
            model.argmax_output = keep
    assert outs[0] == outs[1] and len(outs[0]) == 24


def test_only_greedy_rows_without_logprobs_or_grammar_are_argmax_only(model):
    e = Engine(model, EngineConfig(), [])
    greedy = e.add([1, 2, 3], 4)
    sampled = e.add([1, 2, 3], 4, SamplingParams(temperature=0.8, seed=1))
    with_logprobs = e.add([1, 2, 3], 4, logprobs=2)
    assert greedy.argmax_only and not sampled.argmax_only and not with_logprobs.argmax_only
    b = Batch.concat([Batch.for_sequence(0, 0, [1, 2], argmax_only=True), Batch.for_sequence(1, 0, [3])])
    assert b.argmax_only == (True, True, False)
    assert b.select([1, 2]).argmax_only == (True, False)
    assert Batch.concat([Batch.for_sequence(0, 0, [1])]).argmax_only == ()


def test_switched_off_and_not_for_heads_it_cannot_shrink(model, monkeypatch):
    monkeypatch.setenv("SPECULANT_SCREEN", "0")
    assert model.backend.argmax_head(model.output) is None
    monkeypatch.delenv("SPECULANT_SCREEN")
    assert model.backend.argmax_head(model.blocks[0]) is None  # not a NativeLinear


def test_the_cache_is_read_back_and_a_broken_one_rebuilt(model, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(screen, "CACHE_MIN_VALUES", 0)
    head = model.output
    args = (head.raw, head.qtype, head.out_features, head.in_features)
    first = screen.load_or_build(*args)
    (path,) = (tmp_path / "screens").glob("*.npz")
    again = screen.load_or_build(*args)
    assert np.array_equal(first.q4, again.q4) and np.array_equal(first.qv, again.qv)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    rebuilt = screen.load_or_build(*args)
    assert np.array_equal(first.q4, rebuilt.q4) and np.array_equal(first.qv, rebuilt.qv)
    assert path.stat().st_size > 100  # and written again


def test_built_only_once_a_greedy_row_asks(model):
    """A model never decoded greedily (a draft model, a training run) builds no copy."""
    sh = screen.ScreenedHead(model.output)
    assert sh.screen is None and not sh._thread.is_alive() and sh._thread.ident is None
    x = _inputs(np.random.default_rng(9), 1, sh.k)
    assert sh(x) is None  # not ready: the full head runs this time
    assert sh.wait() and sh(x) is not None


def test_warm_up_leaves_the_copy_ready(tmp_path):
    """A model's warm_up (what `speculant serve` runs before it listens, unless --no-warmup) runs
    a greedy row and returns with the copy built, so the first request neither runs without it
    nor shares the cores with its build."""
    path = write_tiny_model(tmp_path / "w.gguf", "qwen2", qtype="Q6_K", n_vocab=1024, n_embd=256, n_ff=256, n_head=4,
                            n_kv_head=2, head_dim=64, n_layers=1, seed=6)
    m = load_model(path, threads=2, progress=False)
    assert m.argmax_output is not None and m.argmax_output.screen is None  # nothing built at load
    m.warm_up()
    assert m.argmax_output.screen is not None and not m.argmax_output._thread.is_alive()


def test_a_build_stopped_at_exit_writes_nothing(model, monkeypatch, tmp_path):
    """stop() (what the atexit handler calls) ends a build at its next chunk: no copy, no cache
    file, the full head keeps answering."""
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path))
    monkeypatch.setattr(screen, "CACHE_MIN_VALUES", 0)
    sh = screen.ScreenedHead(model.output)
    sh._cancel.set()  # as if the process were exiting before the first chunk
    assert not sh.wait() and sh.error.startswith("cancelled")
    assert not list(tmp_path.rglob("*.npz"))
    assert sh(_inputs(np.random.default_rng(1), 1, sh.k)) is None  # the caller takes the full head


EXIT_DURING_BUILD = """
import sys
from pathlib import Path
from speculant.loader import load_model
from speculant_cpu import screen
screen.CHUNK_ROWS = 16  # many chunks: the build is still running when the script ends
screen.CACHE_MIN_VALUES = 0
screen._cache_dir = lambda: Path(sys.argv[2])  # (not SPECULANT_CACHE: the native library's cache stays warm)
m = load_model(sys.argv[1], threads=2, progress=False)
m.argmax_output.start()
assert m.argmax_output._thread.is_alive()
"""


def test_a_process_exiting_during_the_build_exits_cleanly(tmp_path):
    """A short `speculant generate` used to end while the copy was still building, and the
    daemon thread, ended inside torch during finalization, aborted the process (exit 134)."""
    path = write_tiny_model(tmp_path / "x.gguf", "qwen2", qtype="Q6_K", n_vocab=8192, n_embd=256, n_ff=256, n_head=4,
                            n_kv_head=2, head_dim=64, n_layers=1, seed=7)
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_BUILD, str(path), str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate" not in done.stderr
    assert not list((tmp_path / "cache").rglob("*.npz"))  # stopped before the last chunk
