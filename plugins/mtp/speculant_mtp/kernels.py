"""Torch versions of the kernels a backend may have (`speculant.BackendKernels`), for the head on
a backend without them. The same math as the trainer's module (train/net.py)."""
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
    """x [rows, heads, dims]; NeoX pairs i with i + dims/2, else (2i, 2i+1)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = (x.chunk(2, dim=-1) if neox else (x[..., 0::2], x[..., 1::2]))
    first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return torch.cat([first, second], dim=-1) if neox else torch.stack([first, second], dim=-1).flatten(-2)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope_for(config, positions: torch.Tensor, tables=rope_tables) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, n_rot / 2] of the block's rotary embedding: IMROPE's unrotated pairs (its
    fourth section, position 0 for text) get cos 1, sin 0."""
    cos, sin = tables(positions, config.n_rot, config.rope_base, config.rope_scale)
    if config.unrotated:
        cos, sin = cos.clone(), sin.clone()
        cos[:, list(config.unrotated)], sin[:, list(config.unrotated)] = 1.0, 0.0
    return cos, sin


def rotate_partial(x: torch.Tensor, cos, sin, n_rot: int, neox: bool, rotate=apply_rope) -> torch.Tensor:
    """Rotate the first n_rot dims of each head, pass the rest through."""
    if n_rot == x.shape[-1]:
        return rotate(x, cos, sin, neox)
    return torch.cat([rotate(x[..., :n_rot].contiguous(), cos, sin, neox), x[..., n_rot:]], dim=-1)
