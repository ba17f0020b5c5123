"""The MTP block as a torch module for training: the same math as head.py (llama.cpp's graph_mtp),
unrolled over several draft steps.

Unrolled training (as EAGLE3's training-time test, with MTP's inputs): step 0 computes every
row q = (x_q, h_{q-1}) of a window with causal attention, as the head's KV holds a committed
history. Step j >= 1 computes, for every anchor q at once, the row a draft of depth j computes at
position q + j: token x_{q+j} (the token the draft should have proposed), the previous step's
output state, and attention over step 0's keys of positions ..q plus the anchor's own rows of
steps 1..j (what the head's KV holds while drafting). Step j's logits at anchor q are trained
against the target's distribution of token x_{q+j+1}.

The target's token embedding and lm_head are frozen buffers (borrowed at inference, not saved);
eh_proj, the norms, the attention block and the FFN are trained. `gguf_weights()` names them as
llama.cpp's NextN block at block index `n_trunk`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from speculant_mtp.kernels import apply_rope, rope_for, rope_tables
from speculant_mtp.layout import MtpConfig


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight.to(x.dtype)


class MtpNet(nn.Module):
    def __init__(self, cfg: MtpConfig, embed: torch.Tensor, lm_head: torch.Tensor, bias: bool = False):
        """`embed` [n_vocab, n_embd] and `lm_head` [n_vocab, n_embd]: the target's, frozen, not
        saved. `bias`: q/k/v biases (as the qwen2 trunk's layers have)."""
        super().__init__()
        c, H = cfg, cfg.n_embd
        self.cfg = cfg
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.enorm, self.hnorm = RMSNorm(H, c.eps), RMSNorm(H, c.eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.attn_norm = RMSNorm(H, c.eps)
        self.q = nn.Linear(H, (2 if c.gated else 1) * c.n_head * c.head_dim, bias=bias)
        self.k = nn.Linear(H, c.n_kv_head * c.head_dim, bias=bias)
        self.v = nn.Linear(H, c.n_kv_head * c.head_dim, bias=bias)
        self.q_norm = RMSNorm(c.head_dim, c.eps) if c.gated else None
        self.k_norm = RMSNorm(c.head_dim, c.eps) if c.gated else None
        self.o = nn.Linear(c.n_head * c.head_dim, H, bias=False)
        self.ffn_norm = RMSNorm(H, c.eps)
        self.gate = nn.Linear(H, c.n_ff, bias=False)
        self.up = nn.Linear(H, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, H, bias=False)
        self.head_norm = RMSNorm(H, c.eps)

    # --- pieces ---------------------------------------------------------------------------------
    def _rotate(self, x, cos, sin):
        c = self.cfg
        if c.n_rot == c.head_dim:
            return apply_rope(x, cos, sin, c.neox)
        return torch.cat([apply_rope(x[..., : c.n_rot], cos, sin, c.neox), x[..., c.n_rot :]], dim=-1)

    def _qkv(self, tokens, h, positions):
        """tokens [B, T], h [B, T, H] (h_{q-1} of each row), positions [T] -> q [B, nh, T, d],
        k, v [B, nkv, T, d], the gate (or None) and the residual."""
        c = self.cfg
        B, T = tokens.shape
        e = self.embed[tokens].to(h.dtype)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        y = self.attn_norm(x)
        cos, sin = rope_for(c, positions, rope_tables)
        cos, sin = cos.repeat(B, 1), sin.repeat(B, 1)
        if c.gated:
            qg = self.q(y).view(B * T, c.n_head, 2, c.head_dim)
            q, gate = qg[:, :, 0], qg[:, :, 1].reshape(B, T, c.n_head * c.head_dim)
            q = self.q_norm(q)
        else:
            q, gate = self.q(y).view(B * T, c.n_head, c.head_dim), None
        k = self.k(y).view(B * T, c.n_kv_head, c.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        v = self.v(y).view(B * T, c.n_kv_head, c.head_dim)
        shape = lambda t, n: t.view(B, T, n, c.head_dim).transpose(1, 2)
        return shape(q, c.n_head), shape(k, c.n_kv_head), shape(v, c.n_kv_head), gate, x

    def _finish(self, attn, gate, residual):
        B, nh, T, d = attn.shape
        o = attn.transpose(1, 2).reshape(B, T, nh * d)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        x = residual + self.o(o)
        y = self.ffn_norm(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.head_norm(x)  # the output state: the next step's h, and the lm_head's input

    def logits(self, state, vocab: torch.Tensor | None = None):
        """Logits over the target's vocabulary, or over the rows `vocab` of it (a training subset)."""
        w = self.lm_head if vocab is None else self.lm_head[vocab]
        return state @ w.to(state.dtype).t()

    # --- unrolled steps -------------------------------------------------------------------------
    def unrolled(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int, start: int = 1,
                 vocab: torch.Tensor | None = None) -> list[torch.Tensor]:
        """tokens [B, T + steps - 1] (x_q of the window's rows q, then steps - 1 more), hidden
        [B, T, H] (h_{q-1} of each row), the rows at positions start.. . Returns per step j the
        logits [B, T, V] of the rows anchored at each q (step j's row predicts x_{q+j+1})."""
        c = self.cfg
        B, T = hidden.shape[:2]
        rep = c.n_head // c.n_kv_head
        positions = torch.arange(start, start + T)
        q, k0, v0, gate, res = self._qkv(tokens[:, :T], hidden, positions)
        k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scale = 1.0 / math.sqrt(c.head_dim)
        s = self._finish(F.scaled_dot_product_attention(q, k0, v0, attn_mask=causal, scale=scale), gate, res)
        out = [self.logits(s, vocab)]
        chain_k, chain_v = [], []
        for j in range(1, steps):
            q, kj, vj, gate, res = self._qkv(tokens[:, j : j + T], s, positions + j)
            chain_k.append(kj.repeat_interleave(rep, 1))
            chain_v.append(vj.repeat_interleave(rep, 1))
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = torch.stack([(q * kk).sum(-1) for kk in chain_k], dim=-1) * scale  # [B, nh, T, j]
            w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
            attn = w[..., :T] @ v0 + sum(w[..., T + i, None] * vv for i, vv in enumerate(chain_v))
            s = self._finish(attn, gate, res)
            out.append(self.logits(s, vocab))
        return out

    # --- export -----------------------------------------------------------------------------------
    def gguf_weights(self) -> dict:
        """Tensor name -> float32 numpy array, llama.cpp's NextN block at index n_trunk."""
        b = f"blk.{self.cfg.block()}."
        m = {
            "nextn.eh_proj.weight": self.eh_proj.weight, "nextn.enorm.weight": self.enorm.weight,
            "nextn.hnorm.weight": self.hnorm.weight, "nextn.shared_head_norm.weight": self.head_norm.weight,
            "attn_norm.weight": self.attn_norm.weight, "attn_q.weight": self.q.weight, "attn_k.weight": self.k.weight,
            "attn_v.weight": self.v.weight, "attn_output.weight": self.o.weight,
            f"{self.cfg.ffn_norm}.weight": self.ffn_norm.weight, "ffn_gate.weight": self.gate.weight,
            "ffn_up.weight": self.up.weight, "ffn_down.weight": self.down.weight,
        }
        if self.q.bias is not None:
            m.update({"attn_q.bias": self.q.bias, "attn_k.bias": self.k.bias, "attn_v.bias": self.v.bias})
        if self.q_norm is not None:
            m.update({"attn_q_norm.weight": self.q_norm.weight, "attn_k_norm.weight": self.k_norm.weight})
        return {b + name: p.detach().float().cpu().numpy() for name, p in m.items()}
