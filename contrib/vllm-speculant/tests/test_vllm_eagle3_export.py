"""The EAGLE3 exporter: a tiny head written by speculant's eagle3 test writers, exported, read
back and checked against the layout vLLM 0.33.0's llama_eagle3 loads (names, shapes, dtypes,
config), and computed in plain torch the way that model computes (NeoX RoPE on the exported
q/k rows): the same logits as speculant's own head on the GGUF."""
from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from speculant import Batch, SpeculantError
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_eagle3.layout import write_head
from speculant_eagle3.testing import random_net, target_embedding, write_random_head

from vllm_speculant.export import export as export_any


def export(path, out_dir, dtype="bfloat16"):
    out, method = export_any(path, out_dir, dtype=dtype)
    assert method == "eagle3"
    return out

N_DRAFT = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_eagle3")
    path = write_tiny_model(d / "target.gguf", "qwen2", n_layers=4, n_embd=64, n_head=4, n_kv_head=2, n_ctx=512)
    torch.set_num_threads(1)
    return path, load_model(path, progress=False)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """Three heads: a reduced draft vocabulary (d2t), F32; the full vocabulary with both norm
    options on, F32; the first again with its matrices in Q8_0 (the exporter dequantizes)."""
    d = tmp_path_factory.mktemp("heads")
    path, _ = target
    reduced, _, _ = write_random_head(d / "reduced.gguf", path, n_draft_vocab=N_DRAFT, seed=1)
    net = random_net(path, seed=2)
    cfg = attrs.evolve(net.cfg, norm_before_fc=True, norm_before_residual=True)
    weights = net.gguf_weights()
    weights["enc.output_norm.weight"] = 1 + 0.1 * np.random.default_rng(2).standard_normal(3 * cfg.target_hidden)
    full = str(d / "full.gguf")
    write_head(full, cfg, weights, target_path=path)
    q8, _, _ = write_random_head(d / "q8.gguf", path, n_draft_vocab=N_DRAFT, seed=1, qtype="Q8_0")
    return {"reduced": reduced, "full": full, "q8": q8}


def vllm_layout(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype; None: the checkpoint's float dtype) of every tensor vLLM's
    Eagle3LlamaForCausalLM takes from a checkpoint with this config, read from
    llama_eagle3.py: qkv read 2 x hidden (:84, layer 0), o/MLP as LlamaDecoderLayer, hidden_norm
    (:97), fc over target_hidden_size x 3 aux states (:212-215, :242), norm (:252), input_norm
    when norm_before_fc (:219-225), lm_head over draft_vocab_size (:302), d2t when the draft
    vocabulary is smaller (:311-315; t2d is skipped, :426). embed_tokens is optional (shared)."""
    H, I, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = {
        "fc.weight": ((H, 3 * config["target_hidden_size"]), None),
        "midlayer.input_layernorm.weight": ((H,), None),
        "midlayer.hidden_norm.weight": ((H,), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ((H, q), None),
        "midlayer.post_attention_layernorm.weight": ((H,), None),
        "midlayer.mlp.gate_proj.weight": ((I, H), None),
        "midlayer.mlp.up_proj.weight": ((I, H), None),
        "midlayer.mlp.down_proj.weight": ((H, I), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((config["draft_vocab_size"], H), None),
    }
    if config["eagle_config"]["norm_before_fc"]:
        out["input_norm.weight"] = ((3 * config["target_hidden_size"],), None)
    if config["draft_vocab_size"] != config["vocab_size"]:
        out["d2t"] = ((config["draft_vocab_size"],), torch.int64)
        out["t2d"] = ((config["vocab_size"],), torch.bool)
    return out


def vllm_parameter_names(names) -> set[str]:
    """The parameters the checkpoint's names land on, renamed as llama_eagle3.py:425-470
    (load_weights) and :283-293 (hf_to_vllm_mapper, stacked q/k/v and gate/up) do."""
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for a, b in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                     (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            name = name.replace(a, b)
        out.add(name)
    return out


@pytest.mark.parametrize("which", ["reduced", "full", "q8"])
@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_layout_is_what_vllm_eagle3_loads(heads, target, which, dtype, torch_dtype, tmp_path):
    head = load_model(heads[which], progress=False)
    c = head.config
    out = export(heads[which], str(tmp_path / "ckpt"), dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    # registry.py:702 maps this architecture to llama_eagle3.Eagle3LlamaForCausalLM
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == c.n_target_vocab
    assert config["draft_vocab_size"] == c.n_draft_vocab == (c.n_target_vocab if which == "full" else N_DRAFT)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(c.target_layers)
    assert config["norm_before_residual"] == (which == "full") and config["eagle_config"]["norm_before_fc"] == (which == "full")
    assert (config["head_dim"], config["rope_theta"], config["rms_norm_eps"]) == (c.head_dim, c.rope_base, pytest.approx(c.eps))
    tensors = load_file(str(out / "model.safetensors"))
    layout = vllm_layout(config)
    assert set(tensors) == set(layout)
    for name, (shape, want) in layout.items():
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].dtype == (want or torch_dtype), name
    expected = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.qkv_proj.weight",
                "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.0.post_attention_layernorm.weight", "model.layers.0.hidden_norm.weight"}
    if which != "full":
        expected.add("draft_id_to_target_id")
        # compute_logits (llama_eagle3.py:380-384): target id = draft id + d2t
        assert (torch.arange(N_DRAFT) + tensors["d2t"]).tolist() == head.d2t.tolist()
        assert tensors["t2d"].nonzero().flatten().tolist() == sorted(head.d2t.tolist())
    else:
        expected.add("model.input_norm.weight")
    assert vllm_parameter_names(tensors) == expected


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half_rope(x, positions, theta):
    """x [T, heads, d]; vLLM's NeoX-style rotary embedding (llama.py:241, is_neox_style)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def vllm_forward(sd, config, embed, tokens, g):
    """llama_eagle3.py's layer 0 (:130-153) and LlamaModel.forward (:263-281) over one sequence
    of rows (token, g) at positions 0..T-1, causal: (logits over the draft vocabulary, the
    pre-norm state that becomes the next step's g)."""
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    T = len(tokens)
    p = {k: v.float() for k, v in sd.items()}
    e = (p["embed_tokens.weight"] if "embed_tokens.weight" in p else embed)[torch.tensor(tokens)]
    emb = rms(e, p["midlayer.input_layernorm.weight"], eps)
    gn = rms(g, p["midlayer.hidden_norm.weight"], eps)
    residual = gn if config["norm_before_residual"] else g
    a = torch.cat([emb, gn], dim=-1)
    pos = torch.arange(T)
    q = rotate_half_rope((a @ p["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd), pos, theta)
    k = rotate_half_rope((a @ p["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd), pos, theta)
    v = (a @ p["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = residual + attn.transpose(0, 1).reshape(T, nh * hd) @ p["midlayer.self_attn.o_proj.weight"].T
    h = rms(x, p["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(h @ p["midlayer.mlp.gate_proj.weight"].T) * (h @ p["midlayer.mlp.up_proj.weight"].T))
    x = x + mlp @ p["midlayer.mlp.down_proj.weight"].T
    return rms(x, p["norm.weight"], eps) @ p["lm_head.weight"].T, x


def combine(sd, config, taps):
    """combine_hidden_states (llama_eagle3.py:386-404): [input_norm], then fc."""
    x = taps
    if config["eagle_config"]["norm_before_fc"]:
        x = rms(x, sd["input_norm.weight"].float(), config["rms_norm_eps"])
    return x @ sd["fc.weight"].float().T


# F32 heads: float rounding only (the head's KV cache is fp16). Q8_0: the CPU backend's native
# kernels also quantize the activations to 8 bits, so it is held to the backend contract's linear
# tolerance (docs/plugins.md), 2e-2.
@pytest.mark.parametrize("which, tol", [("reduced", 5e-3), ("full", 5e-3), ("q8", 2e-2)])
def test_exported_numbers_compute_what_our_head_computes(heads, target, which, tol, tmp_path):
    """Step 0 over a prompt's rows, then a draft step fed its own pre-norm state (vLLM's
    aux_output): vLLM's computation on the exported weights equals speculant's head on the GGUF."""
    target_path, model = target
    head = load_model(heads[which], progress=False)
    out = export(heads[which], str(tmp_path / "ckpt"), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    embed = target_embedding(target_path)  # no embed_tokens in the head: vLLM shares the target's
    gen = torch.Generator().manual_seed(3)
    T = 12
    tokens = torch.randint(0, 500, (T + 1,), generator=gen).tolist()
    taps = torch.randn(T, 3 * config["target_hidden_size"], generator=gen)

    ctx = head.new_context(64)
    ours, pre = head.decode(Batch.for_sequence(0, 0, tokens[:T], logits="all"), ctx, head.encode(taps), model.embed)
    g = combine(sd, config, taps)
    theirs, x = vllm_forward(sd, config, embed, tokens[:T], g)
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < tol * scale
    assert (pre - x).abs().max() < tol * x.abs().max()

    step, _ = head.decode(Batch.for_sequence(0, T, [tokens[T]], logits="all"), ctx, pre[T - 1 : T], model.embed)
    theirs2, _ = vllm_forward(sd, config, embed, tokens, torch.cat([g, x[T - 1 : T]]))
    assert (step[0] - theirs2[T]).abs().max() < tol * scale
    if which == "reduced":  # the same target tokens once mapped: our d2t, vLLM's offset
        full = torch.full((T, config["vocab_size"]), float("-inf"))
        full[:, torch.arange(N_DRAFT) + sd["d2t"]] = theirs
        assert full.argmax(-1).tolist() == head.d2t[ours.argmax(-1)].tolist()


def test_bfloat16_is_the_float32_export_rounded(heads, tmp_path):
    a = load_file(str(export(heads["reduced"], str(tmp_path / "a"), dtype="float32") / "model.safetensors"))
    b = load_file(str(export(heads["reduced"], str(tmp_path / "b"), dtype="bfloat16") / "model.safetensors"))
    for name, t in a.items():
        assert torch.equal(t.to(torch.bfloat16) if t.is_floating_point() else t, b[name]), name


def test_command_and_what_is_not_exported(heads, target, tmp_path, capsys):
    from speculant.cli import main

    assert main(["export-vllm", heads["reduced"], "-o", str(tmp_path / "cli"), "--dtype", "float16"]) == 0
    assert '"method": "eagle3"' in capsys.readouterr().out
    assert load_file(str(tmp_path / "cli" / "model.safetensors"))["fc.weight"].dtype == torch.float16
    with pytest.raises(SpeculantError, match="not a drafter vLLM can load"):
        export(target[0], str(tmp_path / "x"))
