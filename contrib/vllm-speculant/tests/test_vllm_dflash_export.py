"""The DFlash exporter: tiny drafters written by speculant's dflash test writers, exported, read
back and checked against the layout vLLM 0.33.0's qwen3_dflash loads (names, shapes, dtypes,
config), and computed in plain torch the way that model computes (context K/V precomputed from
the fused taps, the block [next token, MASK...] over it): the same logits as speculant's own
drafter on the GGUF."""
from __future__ import annotations

import json

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from speculant import SpeculantError
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_dflash.layout import write_head
from speculant_dflash.testing import random_net, target_embedding, write_random_head

from vllm_speculant.export import export as export_any

N_DRAFT, BLOCK = 300, 5


def export(path, out_dir, dtype="bfloat16"):
    out, method = export_any(path, out_dir, dtype=dtype)
    assert method == "dflash"
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_dflash")
    path = write_tiny_model(d / "target.gguf", "qwen2", n_layers=4, n_embd=64, n_head=4, n_kv_head=2, n_ctx=512)
    torch.set_num_threads(1)
    return path, load_model(path, progress=False)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """A reduced draft vocabulary (d2t), F32; the full vocabulary, causal, with value and logit
    scales, F32; the first in Q8_0."""
    d = tmp_path_factory.mktemp("drafters")
    path, _ = target
    reduced, _, _ = write_random_head(d / "reduced.gguf", path, n_draft_vocab=N_DRAFT, block_size=BLOCK, seed=1)
    net = random_net(path, seed=2, block_size=BLOCK)
    scaled = str(d / "scaled.gguf")
    write_head(scaled, attrs.evolve(net.cfg, causal=True, value_scale=0.5, logit_scale=1.5), net.gguf_weights(), target_path=path)
    q8, _, _ = write_random_head(d / "q8.gguf", path, n_draft_vocab=N_DRAFT, block_size=BLOCK, seed=1, qtype="Q8_0")
    return {"reduced": reduced, "scaled": scaled, "q8": q8}


def vllm_layout(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype; None: the checkpoint's float dtype) of what DFlashQwen3ForCausalLM
    takes from a checkpoint: fc over target_hidden_size x the aux layers (:87-96, :477-486),
    hidden_norm and norm (:488-495), per layer Qwen3 attention with per-head q/k norms
    (:203-219, :269-270), the Qwen2-style MLP and the two layer norms (:353-362), lm_head over
    draft_vocab_size (:757-766), d2t for a reduced vocabulary (:771-777; t2d skipped, :861)."""
    H, I, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    taps = len(config["dflash_config"]["target_layer_ids"])
    out = {"fc.weight": ((H, taps * config["target_hidden_size"]), None), "hidden_norm.weight": ((H,), None),
           "norm.weight": ((H,), None), "lm_head.weight": ((config["draft_vocab_size"], H), None)}
    for i in range(config["num_hidden_layers"]):
        out.update({f"layers.{i}.{k}": (v, None) for k, v in {
            "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
            "self_attn.o_proj.weight": (H, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
            "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}.items()})
    if config["draft_vocab_size"] != config["vocab_size"]:
        out["d2t"] = ((config["draft_vocab_size"],), torch.int64)
        out["t2d"] = ((config["vocab_size"],), torch.bool)
    return out


@pytest.mark.parametrize("which", ["reduced", "scaled", "q8"])
def test_layout_is_what_vllm_dflash_loads(drafters, which, tmp_path):
    head = load_model(drafters[which], progress=False)
    c = head.config
    out = export(drafters[which], str(tmp_path / "ckpt"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"  # registry.py:664
    assert config["num_hidden_layers"] == c.n_layers and config["vocab_size"] == c.n_target_vocab
    dc = config["dflash_config"]
    # vLLM taps aux state id = target_layer_id + 1 (gpu_model_runner.py:5210-5214), ours are those ids
    assert [i + 1 for i in dc["target_layer_ids"]] == list(c.target_layers)
    assert (dc["mask_token_id"], dc["block_size"], dc["causal"]) == (c.mask_token_id, BLOCK, which == "scaled")
    assert dc.get("attention_value_scale") == (0.5 if which == "scaled" else None)
    assert config.get("logit_scale") == (1.5 if which == "scaled" else None)
    tensors = load_file(str(out / "model.safetensors"))
    layout = vllm_layout(config)
    assert set(tensors) == set(layout)
    for name, (shape, want) in layout.items():
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].dtype == (want or torch.bfloat16), name
    if which != "scaled":
        assert (torch.arange(N_DRAFT) + tensors["d2t"]).tolist() == head.d2t.tolist()


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def neox_rope(x, positions, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def vllm_dflash(sd, config, embed, taps, block):
    """qwen3_dflash.py's computation, on the exported weights: combine_hidden_states (fc, :832-849),
    precompute_and_store_context_kv (hidden_norm, each layer's k/v, k_norm, RoPE at positions
    0..C-1, V times attention_value_scale, :586-700), then the block at positions C..C+B-1
    through the layers (:283-300, :365-383: pre-norm, q/k norms, RoPE, attention over context and
    block, causal only if the config says so), norm, lm_head, logit_scale."""
    p = {k: v.float() for k, v in sd.items()}
    dc, eps, theta = config["dflash_config"], config["rms_norm_eps"], config["rope_theta"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    vs = dc.get("attention_value_scale", 1.0)
    C, B = len(taps), len(block)
    ctx = rms(taps @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    x = (p["embed_tokens.weight"] if "embed_tokens.weight" in p else embed)[torch.tensor(block)]
    cpos, bpos = torch.arange(C), torch.arange(C, C + B)
    allowed = torch.ones(B, C + B, dtype=torch.bool)
    if dc["causal"]:
        allowed[:, C:] = torch.ones(B, B, dtype=torch.bool).tril()
    for i in range(config["num_hidden_layers"]):
        w = lambda n: p[f"layers.{i}.{n}.weight"]  # noqa: E731
        kc = neox_rope(rms((ctx @ w("self_attn.k_proj").T).view(C, nkv, hd), w("self_attn.k_norm"), eps), cpos, theta)
        vc = (ctx @ w("self_attn.v_proj").T).view(C, nkv, hd) * vs
        h = rms(x, w("input_layernorm"), eps)
        q = neox_rope(rms((h @ w("self_attn.q_proj").T).view(B, nh, hd), w("self_attn.q_norm"), eps), bpos, theta)
        k = neox_rope(rms((h @ w("self_attn.k_proj").T).view(B, nkv, hd), w("self_attn.k_norm"), eps), bpos, theta)
        v = (h @ w("self_attn.v_proj").T).view(B, nkv, hd) * vs
        K = torch.cat([kc, k]).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
        V = torch.cat([vc, v]).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), K, V, attn_mask=allowed)
        x = x + attn.transpose(0, 1).reshape(B, nh * hd) @ w("self_attn.o_proj").T
        h = rms(x, w("post_attention_layernorm"), eps)
        x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    return (rms(x, p["norm.weight"], eps) @ p["lm_head.weight"].T) * config.get("logit_scale", 1.0)


# F32: float rounding and the fp16 KV cache. Q8_0: the CPU backend also quantizes activations to
# 8 bits, held to the backend contract's linear tolerance (docs/plugins.md), 2e-2.
@pytest.mark.parametrize("which, tol", [("reduced", 5e-3), ("scaled", 5e-3), ("q8", 2e-2)])
def test_exported_numbers_compute_what_our_drafter_computes(drafters, target, which, tol, tmp_path):
    target_path, model = target
    head = load_model(drafters[which], progress=False)
    out = export(drafters[which], str(tmp_path / "ckpt"), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    C = 11
    taps = torch.randn(C, head.config.n_taps * head.config.n_embd, generator=gen)
    block = [int(torch.randint(0, 500, (1,), generator=gen))] + [head.config.mask_token_id] * (BLOCK - 1)

    ctx = head.new_context(64)
    head.inject([(0, 0, head.encode(taps))], ctx)
    (ours,) = head.draft([(0, block, BLOCK - 1)], ctx, model.embed)
    theirs = vllm_dflash(sd, config, target_embedding(target_path), taps, block)[1:]  # rows 1.. predict P+1..
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < tol * scale


def test_what_vllm_cannot_compute_is_refused(target, tmp_path):
    path, _ = target
    net = random_net(path, seed=3, block_size=BLOCK)
    bad = str(tmp_path / "gelu.gguf")
    write_head(bad, attrs.evolve(net.cfg, activation="gelu", softcap=30.0), net.gguf_weights(), target_path=path)
    with pytest.raises(SpeculantError, match="hidden_activation = gelu, final_logit_softcapping = 30"):
        export(bad, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
