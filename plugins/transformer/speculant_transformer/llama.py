"""The llama family: llama, qwen2 (q/k/v biases) and qwen3 (per-head q/k RMSNorm).

Pre-norm decoder blocks: x += Wo·attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)); x += Wd·(silu(Wg·n(x)) * Wu·n(x)).
"""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from speculant import Batch, DecoderLayerSpec, ForwardOutput, KVCache, LayerRows, ModelFileError, backend_kernel
from speculant.gguf import Tokenizer

from speculant_transformer.layers import DecoderModel, attend, batch_scope, commit, ffn_scope, norm_fn, reserve, rope_fn, rotate_fn
from speculant_transformer.loading import WeightLoader, attention_shape, hparam_float, hparam_int, model_info, vocab_size


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """For backends without their own `swiglu` (the Backend protocol's optional kernel)."""
    return F.silu(gate) * up


@attrs.frozen
class LlamaConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layers: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_scale: float
    eps: float
    neox: bool  # qwen2/qwen3 rotate halves; llama rotates adjacent pairs

    @classmethod
    def from_gguf(cls, gguf, n_vocab: int) -> "LlamaConfig":
        n_embd = hparam_int(gguf, "embedding_length")
        n_head, n_kv_head, head_dim = attention_shape(gguf, n_embd)
        scaling = gguf.arch_key("rope.scaling.type")
        return cls(
            arch=gguf.architecture, n_vocab=n_vocab, n_embd=n_embd, n_layers=hparam_int(gguf, "block_count"),
            n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
            n_ff=hparam_int(gguf, "feed_forward_length"),
            rope_base=hparam_float(gguf, "rope.freq_base", 10000.0),
            rope_scale=hparam_float(gguf, "rope.scaling.factor", 1.0) if scaling == "linear" else 1.0,
            eps=hparam_float(gguf, "attention.layer_norm_rms_epsilon", 1e-5),
            neox=gguf.architecture != "llama",
        )


@attrs.define
class LlamaBlock:
    attn_norm: torch.Tensor
    wq: object
    wk: object
    wv: object
    wo: object
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate: object  # None where w_gate_up holds both
    w_up: object
    w_down: object
    w_gate_up: object = None  # gate and up rows in one product, where the file holds them back to back


class LlamaModel(DecoderModel):
    @classmethod
    def load(cls, gguf, backend, progress=None) -> "LlamaModel":
        tokenizer = Tokenizer.from_metadata(gguf.metadata, gguf.path)
        cfg = LlamaConfig.from_gguf(gguf, n_vocab=vocab_size(gguf, tokenizer, hparam_int(gguf, "embedding_length")))
        w = WeightLoader(gguf, backend, progress)
        d, q_dim, kv_dim = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        blocks = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            # one call for the FFN's gate and up products where it can be (one pass over the
            # activations, one thread hand-off less a layer); the same rows, the same bits
            gate_up = w.joined_linear([p + "ffn_gate.weight", p + "ffn_up.weight"], (cfg.n_ff, d))
            blocks.append(LlamaBlock(
                attn_norm=w.tensor(p + "attn_norm.weight", (d,)),
                wq=w.linear(p + "attn_q.weight", p + "attn_q.bias", (q_dim, d)),
                wk=w.linear(p + "attn_k.weight", p + "attn_k.bias", (kv_dim, d)),
                wv=w.linear(p + "attn_v.weight", p + "attn_v.bias", (kv_dim, d)),
                wo=w.linear(p + "attn_output.weight", shape=(d, q_dim)),
                q_norm=w.tensor(p + "attn_q_norm.weight", (cfg.head_dim,)) if w.has(p + "attn_q_norm.weight") else None,
                k_norm=w.tensor(p + "attn_k_norm.weight", (cfg.head_dim,)) if w.has(p + "attn_k_norm.weight") else None,
                ffn_norm=w.tensor(p + "ffn_norm.weight", (d,)),
                w_gate=None if gate_up else w.linear(p + "ffn_gate.weight", shape=(cfg.n_ff, d)),
                w_up=None if gate_up else w.linear(p + "ffn_up.weight", shape=(cfg.n_ff, d)),
                w_down=w.linear(p + "ffn_down.weight", shape=(d, cfg.n_ff)),
                w_gate_up=gate_up,
            ))
            if (blocks[-1].q_norm is None) != (blocks[-1].k_norm is None):
                raise ModelFileError(f"{gguf.path}: layer {i} has only one of attn_q_norm and attn_k_norm")
        # Tied embeddings: the output projection reuses token_embd when output.weight is absent.
        output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight", shape=(cfg.n_vocab, d))
        model = cls(cfg, model_info(gguf, cfg.n_vocab, cfg.n_embd, cfg.n_layers), tokenizer, backend,
                    w.embedding("token_embd.weight", (cfg.n_vocab, d)), blocks, w.tensor("output_norm.weight", (d,)), output)
        model.fused = model.fused_layers()
        return model

    def fused_layers(self) -> list:
        """Per layer, the backend's fused kernel for it, or None (run piece by piece). The last
        layer's runs only batches without prompt rows (see forward)."""
        c, fuse = self.config, backend_kernel(self.backend, "fused_layer")
        out = [None] * c.n_layers
        for i, blk in enumerate(self.blocks):
            if fuse is not None and blk.q_norm is None and blk.w_gate_up is not None:
                out[i] = fuse(DecoderLayerSpec(
                    attn_norm=blk.attn_norm, ffn_norm=blk.ffn_norm, wq=blk.wq, wk=blk.wk, wv=blk.wv, wo=blk.wo,
                    w_gate_up=blk.w_gate_up, w_down=blk.w_down, n_head=c.n_head, n_kv_head=c.n_kv_head,
                    head_dim=c.head_dim, n_ff=c.n_ff, eps=c.eps, neox=c.neox, scale=c.head_dim**-0.5))
        return out

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        c = self.config
        norm, rotate = norm_fn(self.backend), rotate_fn(self.backend)
        groups = reserve(batch, cache)
        positions = torch.tensor(batch.positions)
        cos, sin = rope_fn(self.backend)(positions, c.head_dim, c.rope_base, c.rope_scale)
        rows = len(batch)
        hidden = {}
        swiglu = backend_kernel(self.backend, "swiglu", silu_times)

        x = self.embed(torch.tensor(batch.tokens))  # [rows, n_embd]
        fused = list(getattr(self, "fused", None) or [None] * c.n_layers)
        if batch.prompt_lens and any(p < n for p, n in zip(batch.positions, batch.prompt_lens)):
            # The last layer's FFN computes every row as a decode row (ffn_scope), which for a
            # prompt row is not how the rest of its layer computes it: piece by piece then.
            # Decode and verification batches (no prompt rows) are marked the same either way.
            fused[-1] = None
        with batch_scope(self.backend, batch):
            for i, blk in enumerate(self.blocks):
                if fused[i] is not None:  # the whole layer in one backend call
                    x = fused[i](x, LayerRows(cos, sin, positions, [(a, b, *cache.buffers(i, s)) for s, a, b in groups]))
                    if i in hidden_layers:
                        hidden[i] = x
                    continue
                h = norm(x, blk.attn_norm, c.eps)
                q = blk.wq(h).view(rows, c.n_head, c.head_dim)
                k = blk.wk(h).view(rows, c.n_kv_head, c.head_dim)
                v = blk.wv(h).view(rows, c.n_kv_head, c.head_dim)
                if blk.q_norm is not None:
                    q, k = norm(q, blk.q_norm, c.eps), norm(k, blk.k_norm, c.eps)
                q, k = rotate(q, cos, sin, c.neox), rotate(k, cos, sin, c.neox)
                attn = attend(self.backend, cache, i, groups, positions, q, k, v, c.head_dim**-0.5)
                x = x + blk.wo(attn.reshape(rows, c.n_head * c.head_dim))

                h = norm(x, blk.ffn_norm, c.eps)
                with ffn_scope(self.backend, batch, i, c.n_layers):
                    if blk.w_gate_up is not None:
                        gu = blk.w_gate_up(h)
                        x = x + blk.w_down(swiglu(gu[:, : c.n_ff], gu[:, c.n_ff :]))
                    else:
                        x = x + blk.w_down(swiglu(blk.w_gate(h), blk.w_up(h)))
                if i in hidden_layers:
                    hidden[i] = x
        commit(batch, groups, cache)

        return self.head(batch, x, hidden, hidden_layers)
