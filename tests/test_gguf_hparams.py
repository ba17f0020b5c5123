"""Broken hyperparameters and shapes in a GGUF file (issue 22): loading gives one ModelFileError line
(exit 2 from the CLI), never a traceback and never a model that loads and then fails every request."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from speculant.errors import ModelFileError
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model

from gguf_edit import T_ARRAY, T_STRING, rewrite, u32, value

F32, I32 = 6, 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hparams")
    return {arch: write_tiny_model(d / f"{arch}.gguf", arch, tokenizer="llama" if arch == "gemma3" else "gpt2")
            for arch in ("qwen2", "gemma3")}


def broken(models, tmp_path, changes, arch="qwen2"):
    changes = {k.replace("ARCH", arch): v for k, v in changes.items()}
    return rewrite(models[arch], tmp_path / f"{arch}-broken.gguf", changes)


def assert_one_line(path, *words):
    with pytest.raises(ModelFileError) as e:
        load_model(path, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


CASES = {
    # the three of the issue
    "head_count 0": ({"ARCH.attention.head_count": u32(0)}, ["head_count", "at least 1"]),
    "head_count_kv 0": ({"ARCH.attention.head_count_kv": u32(0)}, ["head_count_kv", "at least 1"]),
    # heads that do not share evenly, or disagree with the tensors
    "head_count_kv 3": ({"ARCH.attention.head_count_kv": u32(3)}, ["not a multiple of 'head_count_kv'"]),
    "head_count 8": ({"ARCH.attention.head_count": u32(8)}, ["attn_", "expected"]),
    "head_count 5": ({"ARCH.attention.head_count": u32(5), "ARCH.attention.head_count_kv": u32(5)},
                     ["does not divide the embedding length"]),
    "key_length odd": ({"ARCH.attention.key_length": u32(15)}, ["even head size"]),
    "key_length wrong": ({"ARCH.attention.key_length": u32(32), "ARCH.attention.value_length": u32(32)},
                         ["attn_q.weight", "expected"]),
    "value_length": ({"ARCH.attention.value_length": u32(8)}, ["value_length"]),
    "embedding_length 0": ({"ARCH.embedding_length": u32(0)}, ["embedding_length", "at least 1"]),
    "embedding_length wrong": ({"ARCH.embedding_length": u32(32)}, ["token_embd.weight", "expected"]),
    "feed_forward_length 0": ({"ARCH.feed_forward_length": u32(0)}, ["feed_forward_length"]),
    "feed_forward_length wrong": ({"ARCH.feed_forward_length": u32(64)}, ["ffn_gate.weight", "expected"]),
    "block_count 0": ({"ARCH.block_count": u32(0)}, ["block_count", "at least 1"]),
    "block_count too many": ({"ARCH.block_count": u32(2**31)}, ["blk.2.", "missing"]),
    "block_count missing": ({"ARCH.block_count": None}, ["block_count' is missing"]),
    # wrong types
    "head_count string": ({"ARCH.attention.head_count": (T_STRING, value(T_STRING, "4"))}, ["must be an integer", "string"]),
    "head_count float": ({"ARCH.attention.head_count": (F32, value(F32, 4.0))}, ["must be an integer"]),
    "head_count_kv per layer": ({"ARCH.attention.head_count_kv": (T_ARRAY, value(T_ARRAY, (4, [2, 2])))},
                                ["must be an integer", "array of 2"]),
    "head_count negative": ({"ARCH.attention.head_count": (I32, value(I32, -4))}, ["at least 1"]),
    "rope base 0": ({"ARCH.rope.freq_base": (F32, value(F32, 0.0))}, ["freq_base", "positive"]),
    "rope base nan": ({"ARCH.rope.freq_base": (F32, value(F32, float("nan")))}, ["freq_base", "positive"]),
    "eps string": ({"ARCH.attention.layer_norm_rms_epsilon": (T_STRING, value(T_STRING, "1e-6"))}, ["must be a number"]),
    "context_length string": ({"ARCH.context_length": (T_STRING, value(T_STRING, "lots"))}, ["context_length"]),
}


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_broken_hyperparameters_are_one_line(models, tmp_path, case, arch):
    changes, words = CASES[case]
    if arch == "gemma3" and case in ("head_count 5", "embedding_length wrong"):
        pytest.skip("gemma3 files give key_length: the head size does not come from the embedding length")
    if arch == "gemma3" and case == "head_count 8":
        words = ["attn_q.weight", "expected"]
    assert_one_line(broken(models, tmp_path, changes, arch), *words)


def test_tokenizer_larger_than_the_embedding(tmp_path):
    """A token id the embedding has no row for would fail the first prompt that uses it."""
    src = write_tiny_model(tmp_path / "m.gguf", "qwen2")
    from speculant.gguf.file import read_gguf_metadata

    md = read_gguf_metadata(src)
    tokens = md["tokenizer.ggml.tokens"] + ["extra0", "extra1"]
    types = md["tokenizer.ggml.token_type"] + [1, 1]
    path = rewrite(src, tmp_path / "big-vocab.gguf", {"tokenizer.ggml.tokens": (T_ARRAY, value(T_ARRAY, (T_STRING, tokens))),
                                                      "tokenizer.ggml.token_type": (T_ARRAY, value(T_ARRAY, (I32, types)))})
    assert_one_line(path, "514 tokens", "rows for 512")


def test_missing_tensor_half_of_qk_norm(tmp_path):
    """qwen3's per-head norms come in pairs: one without the other is a broken file."""
    from pathlib import Path

    src = write_tiny_model(tmp_path / "q3.gguf", "qwen3")
    raw = Path(src).read_bytes()
    name = b"blk.0.attn_k_norm.weight"
    assert raw.count(name) == 1
    path = tmp_path / "half.gguf"
    path.write_bytes(raw.replace(name, b"blk.0.attn_x_norm.weight"))
    assert_one_line(str(path), "attn_q_norm and attn_k_norm")


def test_cli_exits_2_with_one_line(models, tmp_path, capsys):
    from speculant.cli import main

    for case in ("head_count 0", "head_count_kv 0", "head_count_kv per layer"):
        path = broken(models, tmp_path, CASES[case][0])
        assert main(["generate", "-m", path, "-p", "hi", "-n", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"speculant: error: {path}: "), err


def test_serve_refuses_a_model_that_would_fail_every_request(models, tmp_path):
    """head_count_kv=0 loaded, /health said 200 and every request got 500: now serve exits 2 at start."""
    path = broken(models, tmp_path, CASES["head_count_kv 0"][0])
    env = {**os.environ, "SPECULANT_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "speculant.cli", "serve", "-m", path, "--port", "0", "-c", "64"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "head_count_kv" in lines[0], r.stderr


def test_valid_files_still_load(models):
    for path in models.values():
        load_model(path, progress=False)
