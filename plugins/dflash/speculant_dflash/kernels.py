"""Torch versions of the kernels a backend may have (`speculant.BackendKernels`), for the drafter
on a backend without them, and the rotary embedding as llama.cpp runs a DFlash drafter (NeoX
pairing, over the first n_rot dimensions, with optional frequency factors). The trainer's module
(train/net.py) uses the same functions."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def rope_tables_factors(positions: torch.Tensor, n_rot: int, base: float, scale: float, factors: torch.Tensor):
    """ggml's theta_i = p * base^(-2i/n_rot) / factor_i (rope_freqs)."""
    inv_freq = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot) / factors.to(torch.float64)
    angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [rows, heads, dims]; the pairing (i, i + dims/2) with neox, else (2i, 2i+1)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = (x.chunk(2, dim=-1) if neox else (x[..., 0::2], x[..., 1::2]))
    first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return torch.cat([first, second], dim=-1) if neox else torch.stack([first, second], dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, apply=apply_rope) -> torch.Tensor:
    """NeoX rotation of the first n_rot dimensions of x [rows, heads, head_dim]; the rest passes."""
    if n_rot >= x.shape[-1]:
        return apply(x.contiguous(), cos, sin, True)
    return torch.cat([apply(x[..., :n_rot].contiguous(), cos, sin, True), x[..., n_rot:]], dim=-1)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     scale: float, causal: bool, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: q [rows, n_head, d], k/v [n_kv, keys, d] at positions q_pos/k_pos. A row
    sees keys at or before it (causal) or all of them, only those less than `window` back (SWA);
    `sinks` [n_head]: per-head logits in the softmax's denominator only (attention sinks)."""
    rows, n_head, d = q.shape
    n_kv = k.shape[0]
    group = n_head // n_kv
    kf, vf = k.float().repeat_interleave(group, 0), v.float().repeat_interleave(group, 0)
    s = torch.einsum("rhd,hkd->hrk", q.float(), kf) * scale
    allowed = torch.ones(rows, k.shape[1], dtype=torch.bool)
    if causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    s = s.masked_fill(~allowed[None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(n_head, rows, 1)], dim=-1)
    w = torch.softmax(s, dim=-1)
    if sinks is not None:
        w = w[..., :-1]
    return torch.einsum("hrk,hkd->rhd", w, vf)
