"""The drafter as a torch module for training: the same math as head.py (llama.cpp's graph),
over many blocks of one window at once.

A window holds the target's taps of positions 0..T-1 and the text. Each block j is anchored at a
position a_j (1 <= a_j <= T): its rows are [x_{a_j}, MASK x (B-1)] at positions a_j..a_j+B-1, and
they attend to the context of positions 0..a_j-1 (what the drafter's KV holds when the target has
committed a_j tokens and sampled x_{a_j}) and to the block's own rows, both ways (non-causal).
Row i of block j is trained to predict the token at a_j + i: the target's distribution there.
All blocks of a window are one masked attention, so a training step costs one forward.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from speculant_dflash.kernels import apply_rope, rope_tables
from speculant_dflash.layout import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        H = c.n_embd
        self.attn_norm = RMSNorm(H, c.eps)
        self.q = nn.Linear(H, c.n_head * c.head_dim, bias=False)
        self.k = nn.Linear(H, c.n_kv_head * c.head_dim, bias=False)
        self.v = nn.Linear(H, c.n_kv_head * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_head * c.head_dim, H, bias=False)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.eps), RMSNorm(c.head_dim, c.eps)
        self.ffn_norm = RMSNorm(H, c.eps)
        self.gate = nn.Linear(H, c.n_ff, bias=False)
        self.up = nn.Linear(H, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, H, bias=False)


def _rope(x: torch.Tensor, positions: torch.Tensor, c: DFlashConfig) -> torch.Tensor:
    """x [B, T, heads, d] at positions [B, T]: NeoX rotation of the first n_rot dims."""
    B, T, nh, d = x.shape
    cos, sin = rope_tables(positions.reshape(-1), c.rot, c.rope_base, c.rope_scale)
    flat = x.reshape(B * T, nh, d)
    r = apply_rope(flat[..., : c.rot], cos, sin, True)
    if c.rot < d:
        r = torch.cat([r, flat[..., c.rot :]], dim=-1)
    return r.reshape(B, T, nh, d)


class DFlashNet(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed: torch.Tensor):
        """`embed`: the target's token embedding table [n_vocab, n_embd] (frozen, not saved)."""
        super().__init__()
        H, c = cfg.n_embd, cfg
        self.cfg = cfg
        self.register_buffer("embed", embed, persistent=False)
        self.fc = nn.Linear(c.n_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.out_norm = RMSNorm(H, c.eps)
        self.lm_head = nn.Linear(H, c.n_draft_vocab, bias=False)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(taps))

    def forward(self, taps: torch.Tensor, anchors: torch.Tensor, block_tokens: torch.Tensor) -> torch.Tensor:
        """taps [B, T, K*H] of positions 0..T-1; anchors [B, nb] (block starts, 0 < a <= T);
        block_tokens [B, nb, Bs] (the anchor token, then MASKs). Returns the logits [B, nb, Bs-1,
        n_draft_vocab] of rows 1..Bs-1 of every block."""
        c = self.cfg
        B, T = taps.shape[:2]
        nb, Bs = block_tokens.shape[1:]
        rep = c.n_head // c.n_kv_head
        g = self.context(taps)
        ctx_pos = torch.arange(T).expand(B, T)
        blk_pos = (anchors[:, :, None] + torch.arange(Bs)).reshape(B, nb * Bs)
        x = self.embed[block_tokens.reshape(B, nb * Bs)].to(g.dtype)
        if c.embedding_scale:
            x = x * c.embedding_scale
        # who sees what: block j's rows see context t < a_j and block j's own rows
        blk_of = torch.arange(nb).repeat_interleave(Bs)
        see_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(Bs, dim=1)[:, :, None]  # [B, nb*Bs, T]
        see_blk = (blk_of[:, None] == blk_of[None, :]).expand(B, -1, -1)
        if c.causal:
            see_blk = see_blk & (torch.arange(Bs).repeat(nb)[None, :] <= torch.arange(Bs).repeat(nb)[:, None])
        mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [B, 1, nb*Bs, T + nb*Bs]
        scale = c.attention_scale or 1.0 / math.sqrt(c.head_dim)
        shape = lambda t, h: t.view(B, -1, h, c.head_dim)
        for layer in self.layers:
            kc = _rope(layer.k_norm(shape(layer.k(g), c.n_kv_head)), ctx_pos, c)
            vc = shape(layer.v(g), c.n_kv_head)
            h = layer.attn_norm(x)
            q = _rope(layer.q_norm(shape(layer.q(h), c.n_head)), blk_pos, c)
            kb = _rope(layer.k_norm(shape(layer.k(h), c.n_kv_head)), blk_pos, c)
            vb = shape(layer.v(h), c.n_kv_head)
            k = torch.cat([kc, kb], dim=1).transpose(1, 2).repeat_interleave(rep, 1)
            v = torch.cat([vc, vb], dim=1).transpose(1, 2).repeat_interleave(rep, 1)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale)
            x = x + layer.o(attn.transpose(1, 2).reshape(B, nb * Bs, c.n_head * c.head_dim))
            hh = layer.ffn_norm(x)
            act = F.gelu(layer.gate(hh), approximate="tanh") if c.activation == "gelu" else F.silu(layer.gate(hh))
            x = x + layer.down(act * layer.up(hh))
        x = x.view(B, nb, Bs, -1)[:, :, 1:]
        return self.lm_head(self.out_norm(x))

    # --- export -----------------------------------------------------------------------------------
    def gguf_modules(self) -> dict:
        """llama.cpp's dflash tensor names -> the modules whose weights they are (export, and
        starting from a trained drafter)."""
        m = {"fc.weight": self.fc, "enc.output_norm.weight": self.hidden_norm, "output_norm.weight": self.out_norm,
             "output.weight": self.lm_head}
        for i, l in enumerate(self.layers):
            for name, mod in (("attn_norm", l.attn_norm), ("attn_q", l.q), ("attn_k", l.k), ("attn_v", l.v),
                              ("attn_output", l.o), ("attn_q_norm", l.q_norm), ("attn_k_norm", l.k_norm),
                              ("ffn_norm", l.ffn_norm), ("ffn_gate", l.gate), ("ffn_up", l.up), ("ffn_down", l.down)):
                m[f"blk.{i}.{name}.weight"] = mod
        return m

    def gguf_weights(self) -> dict:
        """Tensor name -> float32 numpy array, in llama.cpp's dflash names."""
        return {name: mod.weight.detach().float().cpu().numpy() for name, mod in self.gguf_modules().items()}
