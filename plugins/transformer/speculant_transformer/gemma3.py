"""Gemma 3: interleaved sliding-window and global attention layers.

Differences from the llama family, as llama.cpp runs it: embeddings scaled by sqrt(n_embd);
per-head q/k RMSNorm; norms after attention and after the FFN as well as before (the GGUF norm
weights already include Gemma's +1); a GELU(tanh)-gated FFN; every 6th layer attends globally with
rope base `rope.freq_base`, the others over a window of `attention.sliding_window` tokens with
rope base 10000; queries scaled by 1/sqrt(head_dim); the output head is the tied embedding.
"""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from speculant import Batch, ForwardOutput, KVCache, backend_kernel
from speculant.gguf import Tokenizer

from speculant_transformer.layers import DecoderModel, attend, batch_scope, commit, ffn_scope, norm_fn, reserve, rope_fn, rotate_fn
from speculant_transformer.loading import WeightLoader, attention_shape, hparam_float, hparam_int, model_info, vocab_size

SWA_PATTERN = 6  # layers i with (i + 1) % 6 != 0 use the sliding window
SWA_ROPE_BASE = 10000.0


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """For backends without their own `gelu_tanh` (the Backend protocol's optional kernel)."""
    return F.gelu(x, approximate="tanh")


@attrs.frozen
class Gemma3Config:
    n_vocab: int
    n_embd: int
    n_layers: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_scale: float  # linear scaling of global layers' positions (larger Gemma 3 models)
    eps: float
    window: int

    @classmethod
    def from_gguf(cls, gguf, n_vocab: int) -> "Gemma3Config":
        n_embd = hparam_int(gguf, "embedding_length")
        n_head, n_kv_head, head_dim = attention_shape(gguf, n_embd)
        scaling = gguf.arch_key("rope.scaling.type")
        return cls(
            n_vocab=n_vocab, n_embd=n_embd, n_layers=hparam_int(gguf, "block_count"), n_head=n_head,
            n_kv_head=n_kv_head, head_dim=head_dim,
            n_ff=hparam_int(gguf, "feed_forward_length"),
            rope_base=hparam_float(gguf, "rope.freq_base", 1_000_000.0),
            rope_scale=hparam_float(gguf, "rope.scaling.factor", 1.0) if scaling == "linear" else 1.0,
            eps=hparam_float(gguf, "attention.layer_norm_rms_epsilon", 1e-6),
            window=hparam_int(gguf, "attention.sliding_window", 0, minimum=0),
        )

    def is_sliding(self, layer: int) -> bool:
        return self.window > 0 and (layer + 1) % SWA_PATTERN != 0


@attrs.define
class Gemma3Block:
    attn_norm: torch.Tensor
    wq: object
    wk: object
    wv: object
    wo: object
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: object
    w_up: object
    w_down: object
    post_ffn_norm: torch.Tensor


class Gemma3Model(DecoderModel):
    @classmethod
    def load(cls, gguf, backend, progress=None) -> "Gemma3Model":
        tokenizer = Tokenizer.from_metadata(gguf.metadata, gguf.path)
        cfg = Gemma3Config.from_gguf(gguf, n_vocab=vocab_size(gguf, tokenizer, hparam_int(gguf, "embedding_length")))
        w = WeightLoader(gguf, backend, progress)
        d, hd, q_dim, kv_dim = cfg.n_embd, cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        blocks = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            blocks.append(Gemma3Block(
                attn_norm=w.tensor(p + "attn_norm.weight", (d,)),
                wq=w.linear(p + "attn_q.weight", shape=(q_dim, d)), wk=w.linear(p + "attn_k.weight", shape=(kv_dim, d)),
                wv=w.linear(p + "attn_v.weight", shape=(kv_dim, d)), wo=w.linear(p + "attn_output.weight", shape=(d, q_dim)),
                q_norm=w.tensor(p + "attn_q_norm.weight", (hd,)), k_norm=w.tensor(p + "attn_k_norm.weight", (hd,)),
                post_attn_norm=w.tensor(p + "post_attention_norm.weight", (d,)),
                ffn_norm=w.tensor(p + "ffn_norm.weight", (d,)),
                w_gate=w.linear(p + "ffn_gate.weight", shape=(cfg.n_ff, d)), w_up=w.linear(p + "ffn_up.weight", shape=(cfg.n_ff, d)),
                w_down=w.linear(p + "ffn_down.weight", shape=(d, cfg.n_ff)),
                post_ffn_norm=w.tensor(p + "post_ffw_norm.weight", (d,)),
            ))
        output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight", shape=(cfg.n_vocab, d))
        return cls(cfg, model_info(gguf, cfg.n_vocab, cfg.n_embd, cfg.n_layers), tokenizer, backend,
                   w.embedding("token_embd.weight", (cfg.n_vocab, d)), blocks, w.tensor("output_norm.weight", (d,)), output)

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        c = self.config
        norm, rotate = norm_fn(self.backend), rotate_fn(self.backend)
        groups = reserve(batch, cache)
        positions = torch.tensor(batch.positions)
        rope_tables = rope_fn(self.backend)
        rope_global = rope_tables(positions, c.head_dim, c.rope_base, c.rope_scale)
        rope_local = rope_tables(positions, c.head_dim, SWA_ROPE_BASE)
        rows = len(batch)
        hidden = {}
        gelu = backend_kernel(self.backend, "gelu_tanh", gelu_tanh)

        x = self.embed(torch.tensor(batch.tokens)) * (c.n_embd**0.5)  # [rows, n_embd]
        with batch_scope(self.backend, batch):
            for i, blk in enumerate(self.blocks):
                sliding = c.is_sliding(i)
                cos, sin = rope_local if sliding else rope_global
                h = norm(x, blk.attn_norm, c.eps)
                q = norm(blk.wq(h).view(rows, c.n_head, c.head_dim), blk.q_norm, c.eps)
                k = norm(blk.wk(h).view(rows, c.n_kv_head, c.head_dim), blk.k_norm, c.eps)
                v = blk.wv(h).view(rows, c.n_kv_head, c.head_dim)
                q, k = rotate(q, cos, sin, neox=True), rotate(k, cos, sin, neox=True)
                # queries scaled before attention (scale 1 inside), as llama.cpp does: scaling after
                # the fp16 dot product differs where the scaled query is an fp16 subnormal
                attn = attend(self.backend, cache, i, groups, positions, q * c.head_dim**-0.5, k, v, 1.0,
                              window=c.window if sliding else 0)
                x = x + norm(blk.wo(attn.reshape(rows, c.n_head * c.head_dim)), blk.post_attn_norm, c.eps)

                h = norm(x, blk.ffn_norm, c.eps)
                with ffn_scope(self.backend, batch, i, c.n_layers):
                    h = blk.w_down(gelu(blk.w_gate(h)) * blk.w_up(h))
                x = x + norm(h, blk.post_ffn_norm, c.eps)
                if i in hidden_layers:
                    hidden[i] = x
        commit(batch, groups, cache)

        return self.head(batch, x, hidden, hidden_layers)
