"""Random heads for tests: a head for any (tiny) target, written in llama.cpp's layout."""
from __future__ import annotations

import numpy as np
import torch

from speculant.gguf import dequantize, open_gguf

from speculant_eagle3.layout import HeadConfig, default_target_layers, write_head
from speculant_eagle3.train.net import Eagle3Net


def target_embedding(target_path: str) -> torch.Tensor:
    """The target's token embedding table [n_vocab, n_embd], float32."""
    g = open_gguf(target_path)
    t = g.tensor("token_embd.weight")
    return dequantize(t.data, t.qtype, t.shape)


def _widest(value) -> int:
    """A head count, or the largest of a hybrid's per-layer counts (0 marks a recurrent layer)."""
    return max(int(v) for v in value) if isinstance(value, (list, tuple)) else int(value)


def head_config_for(target_path: str, *, n_draft_vocab: int | None = None, n_ff: int | None = None,
                    target_layers=None) -> HeadConfig:
    g = open_gguf(target_path)
    n_embd, n_layers = int(g.arch_key("embedding_length")), int(g.arch_key("block_count"))
    n_head, n_kv = _widest(g.arch_key("attention.head_count")), _widest(g.arch_key("attention.head_count_kv"))
    n_vocab = len(g.metadata["tokenizer.ggml.tokens"])
    return HeadConfig(n_embd=n_embd, n_head=n_head, n_kv_head=n_kv, head_dim=n_embd // n_head,
                      n_ff=n_ff or int(g.arch_key("feed_forward_length")), n_draft_vocab=n_draft_vocab or n_vocab,
                      n_target_vocab=n_vocab, target_layers=tuple(target_layers or default_target_layers(n_layers)),
                      target_hidden=n_embd, eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
                      rope_base=float(g.arch_key("rope.freq_base", 10000.0)), n_ctx=int(g.arch_key("context_length", 4096)))


def random_net(target_path: str, *, seed: int = 0, n_draft_vocab: int | None = None, **kw) -> Eagle3Net:
    torch.manual_seed(seed)
    cfg = head_config_for(target_path, n_draft_vocab=n_draft_vocab, **kw)
    net = Eagle3Net(cfg, target_embedding(target_path))
    with torch.no_grad():  # norms off 1, so a test sees them used
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return net


def write_random_head(path, target_path: str, *, seed: int = 0, n_draft_vocab: int | None = None,
                      qtype: str = "F32", extra: dict[str, str] | None = None, **kw) -> tuple[str, Eagle3Net, np.ndarray | None]:
    """A random head for the target at `target_path`; with n_draft_vocab, d2t holds that many
    distinct target ids; `extra`: more metadata. Returns (path, the net, d2t)."""
    net = random_net(target_path, seed=seed, n_draft_vocab=n_draft_vocab, **kw)
    d2t = None
    if n_draft_vocab:
        rng = np.random.default_rng(seed)
        d2t = np.sort(rng.choice(net.cfg.n_target_vocab, n_draft_vocab, replace=False)).astype(np.int64)
    write_head(str(path), net.cfg, net.gguf_weights(), target_path=target_path, d2t=d2t, qtype=qtype, extra=extra)
    return str(path), net, d2t
