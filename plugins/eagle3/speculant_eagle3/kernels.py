"""Torch versions of the kernels a backend may have (`speculant.BackendKernels`), for the head
on a backend without them. The same math as the trainer's module (train/net.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [rows, heads, head_dim]; llama.cpp's original pairing (2i, 2i+1) unless neox."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = (x.chunk(2, dim=-1) if neox else (x[..., 0::2], x[..., 1::2]))
    first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return torch.cat([first, second], dim=-1) if neox else torch.stack([first, second], dim=-1).flatten(-2)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
