"""Small pieces shared by the architectures: RMSNorm, rotary embeddings, the per-layer KV step."""
from __future__ import annotations

import torch

from speculant import Batch, ForwardOutput, KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As llama.cpp computes it: the float squares summed in double, the mean rounded to float,
    then x * (1 / sqrt(mean + eps)) and the weight in float. A float32 sum drifts from it where the
    activations are large (gemma's): teacher-forced on llama.cpp's outputs, gemma-3-270m's mean
    log-probability margin error fell from 0.83 to 0.28 with the double sum (qwen: ~0.07 either way)."""
    mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    return x * (1.0 / torch.sqrt(mean + eps)) * weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, head_dim/2] for the given absolute positions (linear position scaling `scale`)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim]. NEOX style pairs dimension i with i + d/2 (qwen, gemma);
    the original style pairs 2i with 2i+1 (llama, whose GGUF converter permutes q/k for it)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def reserve(batch: Batch, cache: KVCache) -> list[tuple[int, int, int]]:
    """Check each sequence's rows continue its cache and make room; returns batch.groups()."""
    groups = batch.groups()
    for seq_id, a, b in groups:
        if batch.positions[a] != cache.length(seq_id):
            raise ValueError(f"sequence {seq_id}: rows start at position {batch.positions[a]} but its cache holds {cache.length(seq_id)} tokens")
        cache.reserve(seq_id, batch.positions[b - 1] + 1)
    return groups


def attend(backend, cache: KVCache, layer: int, groups, positions: torch.Tensor,
           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Store this layer's k, v in the cache and attend each sequence's rows over its own cache."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for seq_id, a, b in groups:
        kc, vc = cache.write(layer, seq_id, int(positions[a]), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
        out[a:b] = backend.attention(q[a:b], kc, vc, positions[a:b], scale, window)
    return out


def commit(batch: Batch, groups, cache: KVCache) -> None:
    for seq_id, _, b in groups:
        cache.commit(seq_id, batch.positions[b - 1] + 1)


class DecoderModel:
    """What every decoder here shares: the parts it is built from, its KV cache, and the output head."""

    state_kind = "kv"

    def __init__(self, config, info, tokenizer, backend, embed, blocks, out_norm, output):
        self.config, self.info, self.tokenizer, self.backend = config, info, tokenizer, backend
        self.embed, self.blocks, self.out_norm, self.output = embed, blocks, out_norm, output

    def new_context(self, max_tokens: int) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype, device=self.backend.device)

    def head(self, batch: Batch, x: torch.Tensor, hidden: dict, hidden_layers: tuple[int, ...]) -> ForwardOutput:
        """Final norm and output projection for the rows that want logits (layer n_layers in
        `hidden_layers` asks for the final-normed state of every row)."""
        c = self.config
        if c.n_layers in hidden_layers:
            hidden[c.n_layers] = rms_norm(x, self.out_norm, c.eps)
        want = [i for i, w in enumerate(batch.want_logits) if w]
        if not want:  # a prompt chunk: skip the output head
            return ForwardOutput(x.new_empty(0, c.n_vocab), hidden)
        return ForwardOutput(self.output(rms_norm(x[want], self.out_norm, c.eps)), hidden)
