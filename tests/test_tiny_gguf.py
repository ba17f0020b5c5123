"""The tiny-model factory: files gguf-py reads back with the layout llama.cpp's converter writes."""
from __future__ import annotations

import hashlib
import os

import jinja2
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from speculant.testing.tiny_gguf import (
    ARCHS, MIN_VOCAB, bytes_to_unicode, quantize, quantize_k, tiny_vocab, write_tiny_model, write_tiny_pair,
)

MODEL_DIR = os.environ.get("SPECULANT_MODELS", os.path.expanduser("~/.cache/speculant-models"))
K_DIMS = dict(n_embd=256, n_ff=512, n_head=4, n_kv_head=2)  # K-quants need 256-multiples
TEXTS = [
    "Hello, world! The draft model proposes tokens and the target verifies them.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n",
    "naïve café, 日本語 and emoji 🎉 fall back to bytes",
    "  leading spaces,\ttabs\t\tand\n\nblank lines  ",
]


def read(path) -> tuple[dict, dict]:
    """(metadata as plain values, {tensor name: (qtype, ggml shape)}) via gguf-py's reader."""
    r = GGUFReader(path)
    md = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        md[k] = f.contents()
    tensors = {t.name: (Q(t.tensor_type), tuple(int(x) for x in t.shape)) for t in r.tensors}
    return md, tensors


def expected_tensors(arch, *, n_vocab, n_embd, n_layers, n_head, n_kv_head, head_dim, n_ff, tie, qtype):
    """The tensor table written out by hand from the converter's conventions (ggml shapes: ne0 first)."""
    q, kv = n_head * head_dim, n_kv_head * head_dim
    t = {"token_embd.weight": (qtype, (n_embd, n_vocab)), "output_norm.weight": (Q.F32, (n_embd,))}
    if not tie:
        t["output.weight"] = (qtype, (n_embd, n_vocab))
    for i in range(n_layers):
        b = f"blk.{i}."
        t |= {
            b + "attn_norm.weight": (Q.F32, (n_embd,)),
            b + "attn_q.weight": (qtype, (n_embd, q)),
            b + "attn_k.weight": (qtype, (n_embd, kv)),
            b + "attn_v.weight": (qtype, (n_embd, kv)),
            b + "attn_output.weight": (qtype, (q, n_embd)),
            b + "ffn_norm.weight": (Q.F32, (n_embd,)),
            b + "ffn_gate.weight": (qtype, (n_embd, n_ff)),
            b + "ffn_up.weight": (qtype, (n_embd, n_ff)),
            b + "ffn_down.weight": (qtype, (n_ff, n_embd)),
        }
        if arch == "qwen2":
            t |= {b + "attn_q.bias": (Q.F32, (q,)), b + "attn_k.bias": (Q.F32, (kv,)), b + "attn_v.bias": (Q.F32, (kv,))}
        if arch in ("qwen3", "gemma3"):
            t |= {b + "attn_q_norm.weight": (Q.F32, (head_dim,)), b + "attn_k_norm.weight": (Q.F32, (head_dim,))}
        if arch == "gemma3":
            t |= {b + "post_attention_norm.weight": (Q.F32, (n_embd,)), b + "post_ffw_norm.weight": (Q.F32, (n_embd,))}
    return t


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_layout_and_metadata(tmp_path, arch, qtype):
    tok = "llama" if arch in ("gemma3", "llama") else "gpt2"
    dims = dict(n_embd=64, n_ff=128, n_head=4, n_kv_head=2) if qtype != "Q4_K" else K_DIMS
    n_vocab, n_layers = 384, 2
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype=qtype, n_vocab=n_vocab, n_layers=n_layers,
                            tokenizer=tok, n_ctx=128, sliding_window=16, **dims)
    md, tensors = read(path)
    head_dim = dims["n_embd"] // dims["n_head"]
    tie = arch == "gemma3"
    assert tensors == expected_tensors(arch, n_vocab=n_vocab, n_layers=n_layers, head_dim=head_dim, tie=tie,
                                       qtype=Q[qtype], **dims)

    a = arch
    assert md["general.architecture"] == arch
    assert md["general.type"] == "model"
    assert md["general.quantization_version"] == 2
    assert md["general.file_type"] == {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 15}[qtype]
    assert md[f"{a}.block_count"] == n_layers
    assert md[f"{a}.context_length"] == 128
    assert md[f"{a}.embedding_length"] == dims["n_embd"]
    assert md[f"{a}.feed_forward_length"] == dims["n_ff"]
    assert md[f"{a}.attention.head_count"] == dims["n_head"]
    assert md[f"{a}.attention.head_count_kv"] == dims["n_kv_head"]
    assert md[f"{a}.rope.freq_base"] > 0
    assert 0 < md[f"{a}.attention.layer_norm_rms_epsilon"] < 1e-4
    has_kv_len = arch in ("qwen3", "gemma3")
    assert (f"{a}.attention.key_length" in md) == has_kv_len
    if has_kv_len:
        assert md[f"{a}.attention.key_length"] == md[f"{a}.attention.value_length"] == head_dim
    assert (f"{a}.attention.sliding_window" in md) == (arch == "gemma3")
    if arch == "gemma3":
        assert md["gemma3.attention.sliding_window"] == 16
    if arch == "llama":
        assert md["llama.vocab_size"] == n_vocab
        assert md["llama.rope.dimension_count"] == head_dim
    else:
        assert f"{a}.vocab_size" not in md and f"{a}.rope.dimension_count" not in md

    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == len(md["tokenizer.ggml.token_type"]) == n_vocab
    assert len(set(tokens)) == n_vocab
    assert md["tokenizer.ggml.model"] == tok
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        assert 0 <= md[f"tokenizer.ggml.{key}"] < n_vocab
    assert "tokenizer.chat_template" in md


def test_weights_are_sane(tmp_path):
    r = GGUFReader(write_tiny_model(tmp_path / "m.gguf", "gemma3", qtype="Q5_K", tokenizer="llama", **K_DIMS))
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        assert w.std() > 0, t.name
        if t.name.endswith("norm.weight") and t.name != "output_norm.weight":
            assert abs(float(w.mean()) - 1.0) < 0.1, t.name  # GGUF gemma norms already include the +1


@pytest.mark.parametrize("qtype,tol", [
    ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.01), ("Q5_0", 0.06), ("Q5_1", 0.06), ("Q4_0", 0.12), ("Q4_1", 0.12),
    ("Q6_K", 0.03), ("Q5_K", 0.06), ("Q4_K", 0.12), ("Q3_K", 0.3), ("Q2_K", 0.45),
])
def test_quantize_round_trips_through_gguf_dequantize(qtype, tol):
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    x[0] = 0.0  # all-zero blocks must not produce NaN scales
    x[1] *= 1e-3
    x[2] = np.abs(x[2])  # all-positive and all-negative sub-blocks
    x[3] = -np.abs(x[3])
    y = dequantize(quantize(x, qtype), Q[qtype]).reshape(x.shape)
    assert np.isfinite(y).all()
    assert (y[0] == 0).all()
    for row in range(1, 6):
        rel = np.sqrt(np.mean((y[row] - x[row]) ** 2) / np.mean(x[row] ** 2))
        assert rel < tol, (qtype, row, rel)


def test_quantize_k_validates():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 128), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="not a K-quant"):
        quantize_k(np.zeros((2, 256), np.float32), "Q8_0")


def test_deterministic_for_a_seed(tmp_path):
    def digest(name, **kw):
        return hashlib.sha256(open(write_tiny_model(tmp_path / name, "qwen3", qtype="Q4_0", **kw), "rb").read()).digest()
    assert digest("a.gguf", seed=7) == digest("b.gguf", seed=7)
    assert digest("a.gguf", seed=7) != digest("c.gguf", seed=8)


def test_byte_tokens_cover_all_bytes():
    gpt2 = tiny_vocab("gpt2", 300)
    assert gpt2["tokenizer.ggml.tokens"][:256] == list(bytes_to_unicode().values())
    assert sorted(bytes_to_unicode()) == list(range(256))
    spm = tiny_vocab("llama", 400)
    toks, types = spm["tokenizer.ggml.tokens"], spm["tokenizer.ggml.token_type"]
    byte_tokens = {t for t, ty in zip(toks, types) if ty == 6}
    assert byte_tokens == {f"<0x{b:02X}>" for b in range(256)}


def test_gpt2_vocabulary_is_consistent():
    v = tiny_vocab("gpt2", 512)
    toks, types, merges = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.token_type"], v["tokenizer.ggml.merges"]
    ids = {t: i for i, t in enumerate(toks)}
    made = set()
    for m in merges:
        a, b = m.split(" ")
        assert a in ids and b in ids and a + b in ids, m
        made.add(a + b)
    normal = [t for t, ty in zip(toks, types) if ty == 1]
    assert set(normal[256:]) <= made  # every learned token is produced by a merge
    assert len(normal) == 512 - 3  # the corpus fills the default vocabulary without padding
    assert "Ġthe" in ids and "Ġmodel" in ids  # common words are single tokens
    specials = {t: ty for t, ty in zip(toks, types) if t.startswith("<|")}
    assert specials == {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3}
    assert toks[v["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert toks[v["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert v["tokenizer.ggml.pre"] == "qwen2" and v["tokenizer.ggml.add_bos_token"] is False


def test_spm_vocabulary_is_consistent():
    v = tiny_vocab("llama", 512)
    toks, types, scores = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.token_type"], v["tokenizer.ggml.scores"]
    assert toks[:6] == ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert types[:6] == [3] * 6
    vocab = {t: s for t, s, ty in zip(toks, scores, types) if ty == 1}
    assert "▁the" in vocab and "▁model" in vocab
    for piece, score in vocab.items():
        if len(piece) > 1:  # every piece can be built by merging two pieces, as llama.cpp's SPM does
            assert any(piece[:i] in vocab and piece[i:] in vocab for i in range(1, len(piece))), piece
    assert v["tokenizer.ggml.add_bos_token"] is True and v["tokenizer.ggml.add_space_prefix"] is False


def test_small_and_padded_vocabularies(tmp_path):
    for tok in ("gpt2", "llama"):
        with pytest.raises(ValueError, match="too small"):
            tiny_vocab(tok, MIN_VOCAB[tok] - 1)
        v = tiny_vocab(tok, MIN_VOCAB[tok])
        assert len(v["tokenizer.ggml.tokens"]) == MIN_VOCAB[tok]
        big = tiny_vocab(tok, 2000)  # more than the corpus can fill: padded with unused tokens
        assert len(big["tokenizer.ggml.tokens"]) == len(set(big["tokenizer.ggml.tokens"])) == 2000


def test_chat_templates_render():
    env = jinja2.Environment()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    chatml = env.from_string(tiny_vocab("gpt2")["tokenizer.chat_template"]).render(messages=msgs, add_generation_prompt=True)
    assert chatml.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert chatml.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    gemma = env.from_string(tiny_vocab("llama")["tokenizer.chat_template"]).render(
        messages=msgs, add_generation_prompt=True, bos_token="<bos>")
    assert gemma == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                     "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_tie_embeddings_and_validation(tmp_path):
    _, t = read(write_tiny_model(tmp_path / "a.gguf", "qwen2", tie_embeddings=True))
    assert "output.weight" not in t
    _, t = read(write_tiny_model(tmp_path / "b.gguf", "gemma3", tokenizer="llama", tie_embeddings=False))
    assert "output.weight" in t
    md, t = read(write_tiny_model(tmp_path / "c.gguf", "llama", qtype="Q4_0", embd_qtype="Q8_0", head_dim=32))
    assert t["token_embd.weight"][0] == Q.Q8_0 and t["blk.0.attn_q.weight"] == (Q.Q4_0, (64, 128))
    assert md["llama.attention.key_length"] == 32 and md["llama.rope.dimension_count"] == 32
    with pytest.raises(ValueError, match="multiple of the Q4_K block size"):
        write_tiny_model(tmp_path / "d.gguf", "qwen2", qtype="Q4_K")  # n_embd=64
    with pytest.raises(ValueError, match="unknown arch"):
        write_tiny_model(tmp_path / "e.gguf", "mamba")


def test_pair_shares_vocabulary_and_prefix_weights(tmp_path):
    target, draft = write_tiny_pair(tmp_path / "pair", "qwen2", qtype="Q8_0", n_vocab=320)
    (tmd, tt), (dmd, dt) = read(target), read(draft)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert tmd[key] == dmd[key]
    assert tmd["qwen2.block_count"] > dmd["qwen2.block_count"] == 1
    rt, rd = GGUFReader(target), GGUFReader(draft)
    tdata = {t.name: bytes(t.data) for t in rt.tensors}
    for t in rd.tensors:  # the default draft is the target's first layer(s)
        assert bytes(t.data) == tdata[t.name], t.name
    _, small = write_tiny_pair(tmp_path / "other", "qwen2", draft_seed=5, draft_overrides={"n_embd": 32, "n_head": 2, "n_kv_head": 1})
    assert read(small)[1]["token_embd.weight"][1] == (32, 512)


@pytest.mark.parametrize("arch,tok", [("qwen2", "gpt2"), ("gemma3", "llama")])
def test_speculant_tokenizer_loads_and_round_trips(tmp_path, arch, tok):
    from speculant.gguf.file import open_gguf
    from speculant.gguf.tokenizer import Tokenizer

    md = open_gguf(write_tiny_model(tmp_path / "m.gguf", arch, tokenizer=tok)).metadata
    t = Tokenizer.from_metadata(md)
    for text in TEXTS:
        ids = t.encode(text, add_special=False)
        assert t.decode(ids) == text
    ids = t.encode("the model and the target", add_special=False)
    assert len(ids) <= 6  # merged words, not bytes
    assert md["tokenizer.ggml.tokens"][t.encode(" model", add_special=False)[0]] in ("Ġmodel", "▁model")


def header_names(path) -> tuple[list[str], list[str]]:
    """Metadata keys and tensor names of a GGUF file, skipping the values (GGUFReader would decode
    all 262k Gemma tokens, which takes seconds)."""
    import mmap
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos = 24

        def string(pos):
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n].decode(), pos + 8 + n

        def skip(kind, pos):
            if kind == 8:
                return string(pos)[1]
            if kind == 9:
                item, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if item in sizes:
                    return pos + sizes[item] * count
                for _ in range(count):
                    pos = skip(item, pos)
                return pos
            return pos + sizes[kind]

        keys, names = [], []
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos = skip(kind, pos + 4)
            keys.append(key)
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            pos += 4 + 8 * n_dims + 4 + 8
            names.append(name)
    return keys, names


@pytest.mark.realmodel
@pytest.mark.parametrize("real,arch,tok", [
    ("qwen2.5-coder-1.5b-instruct.gguf", "qwen2", "gpt2"), ("gemma-3-270m-q4_k_m.gguf", "gemma3", "llama"),
])
def test_keys_match_real_files(tmp_path, real, arch, tok):
    path = os.path.join(MODEL_DIR, real)
    if not os.path.exists(path):
        pytest.skip(f"{path} not present (set SPECULANT_MODELS)")
    real_keys, real_tensors = header_names(path)
    mine, tensors = read(write_tiny_model(tmp_path / "m.gguf", arch, tokenizer=tok, qtype="Q4_K", **K_DIMS))
    ignore = {"general.finetune", "general.basename", "general.size_label", "general.license", "general.tags"}
    real_keys = set(real_keys)
    assert real_keys - ignore - {"tokenizer.chat_template"} <= set(mine)  # gemma-3-270m has no template
    assert set(mine) - real_keys <= {"tokenizer.chat_template"}
    real_names = {n.split(".", 2)[-1] if n.startswith("blk.") else n for n in real_tensors}
    my_names = {n.split(".", 2)[-1] if n.startswith("blk.") else n for n in tensors}
    assert my_names == real_names
