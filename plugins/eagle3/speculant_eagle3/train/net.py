"""The head as a torch module for training: the same math as head.py (llama.cpp's graph), with
EAGLE3's training-time test.

Training-time test (k unrolled steps): step 0 computes every position p's row (t_{p+1}, g_p)
with causal attention, as the head's KV holds it for a committed history. Step j >= 1 computes,
for every anchor p at once, the row a draft of depth j would compute at position p + j: token
t_{p+j+1} (the token the draft should have proposed), the previous step's pre-norm state, and
attention over step 0's keys of positions 0..p plus the anchor's own rows of steps 1..j (what the
head's KV holds while drafting). Each step's logits are trained against the target's distribution
of the token after.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from speculant_eagle3.kernels import apply_rope, rope_tables
from speculant_eagle3.layout import HeadConfig


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight.to(x.dtype)


class Eagle3Net(nn.Module):
    def __init__(self, cfg: HeadConfig, embed: torch.Tensor):
        """`embed`: the target's token embedding table [n_vocab, n_embd] (frozen, not saved)."""
        super().__init__()
        H, c = cfg.n_embd, cfg
        self.cfg = cfg
        self.register_buffer("embed", embed, persistent=False)
        self.fc = nn.Linear(c.n_taps * c.target_hidden, H, bias=False)
        self.attn_norm, self.hidden_norm = RMSNorm(H, c.eps), RMSNorm(H, c.eps)
        self.q = nn.Linear(2 * H, c.n_head * c.head_dim, bias=False)
        self.k = nn.Linear(2 * H, c.n_kv_head * c.head_dim, bias=False)
        self.v = nn.Linear(2 * H, c.n_kv_head * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_head * c.head_dim, H, bias=False)
        self.ffn_norm = RMSNorm(H, c.eps)
        self.gate = nn.Linear(H, c.n_ff, bias=False)
        self.up = nn.Linear(H, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, H, bias=False)
        self.out_norm = RMSNorm(H, c.eps)
        self.lm_head = nn.Linear(H, c.n_draft_vocab, bias=False)

    # --- pieces ---------------------------------------------------------------------------------
    def encode(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc(taps)

    def _qkv(self, tokens, g, positions):
        """tokens [B, T], g [B, T, H], positions [T] -> q [B, nh, T, d], k, v [B, nkv, T, d], the residual."""
        c = self.cfg
        B, T = tokens.shape
        gn = self.hidden_norm(g)
        a = torch.cat([self.attn_norm(self.embed[tokens].to(g.dtype)), gn], dim=-1)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_base)
        cos, sin = cos.repeat(B, 1), sin.repeat(B, 1)
        q = apply_rope(self.q(a).view(B * T, c.n_head, c.head_dim), cos, sin, False)
        k = apply_rope(self.k(a).view(B * T, c.n_kv_head, c.head_dim), cos, sin, False)
        v = self.v(a).view(B * T, c.n_kv_head, c.head_dim)
        shape = lambda t, h: t.view(B, T, h, c.head_dim).transpose(1, 2)
        return shape(q, c.n_head), shape(k, c.n_kv_head), shape(v, c.n_kv_head), (gn if c.norm_before_residual else g)

    def _finish(self, attn, residual):
        B, nh, T, d = attn.shape
        x = residual + self.o(attn.transpose(1, 2).reshape(B, T, nh * d))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def logits(self, prenorm):
        return self.lm_head(self.out_norm(prenorm))

    # --- training-time test -----------------------------------------------------------------------
    def unrolled(self, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T + steps] (t_1 .. : the token after each position, then `steps` more),
        taps [B, T, 3 * H_target] of positions 0..T-1. Returns per step j the logits [B, T, Vd]
        of the rows anchored at each p (row j of anchor p predicts the token at p + j + 2)."""
        c = self.cfg
        B, T = taps.shape[:2]
        rep = c.n_head // c.n_kv_head
        g = self.encode(taps)
        positions = torch.arange(T)
        q, k0, v0, res = self._qkv(tokens[:, :T], g, positions)
        k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scale = 1.0 / math.sqrt(c.head_dim)
        x = self._finish(F.scaled_dot_product_attention(q, k0, v0, attn_mask=causal, scale=scale), res)
        out = [self.logits(x)]
        chain_k, chain_v = [], []
        for j in range(1, steps):
            q, kj, vj, res = self._qkv(tokens[:, j : j + T], x, positions + j)
            chain_k.append(kj.repeat_interleave(rep, 1))
            chain_v.append(vj.repeat_interleave(rep, 1))
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = torch.stack([(q * kk).sum(-1) for kk in chain_k], dim=-1) * scale  # [B, nh, T, j]
            w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
            attn = w[..., :T] @ v0 + sum(w[..., T + i, None] * vv for i, vv in enumerate(chain_v))
            x = self._finish(attn, res)
            out.append(self.logits(x))
        return out

    # --- export -----------------------------------------------------------------------------------
    def gguf_weights(self) -> dict:
        """Tensor name -> float32 numpy array, in llama.cpp's eagle3 names."""
        return {name: getattr(self, module).weight.detach().float().cpu().numpy() for name, module in GGUF_TO_NET.items()}


# llama.cpp's eagle3 tensor names -> the net's modules (export, and starting from a trained head).
GGUF_TO_NET = {
    "fc.weight": "fc", "blk.0.attn_norm.weight": "attn_norm", "blk.0.attn_norm_2.weight": "hidden_norm",
    "blk.0.attn_q.weight": "q", "blk.0.attn_k.weight": "k", "blk.0.attn_v.weight": "v",
    "blk.0.attn_output.weight": "o", "blk.0.ffn_norm.weight": "ffn_norm", "blk.0.ffn_gate.weight": "gate",
    "blk.0.ffn_up.weight": "up", "blk.0.ffn_down.weight": "down", "output_norm.weight": "out_norm",
    "output.weight": "lm_head",
}
