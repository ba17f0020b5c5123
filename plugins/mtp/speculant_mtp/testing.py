"""Random MTP blocks for tests: a sidecar for any (tiny) target, in llama.cpp's layout."""
from __future__ import annotations

import attrs
import torch

from speculant.gguf import open_gguf
from speculant.training import target_tensor

from speculant_mtp.layout import ARCHS, GATED_ARCHS, MtpConfig, imrope_unrotated, write_sidecar
from speculant_mtp.train.net import MtpNet


def _widest(value) -> int:
    """A head count, or the largest of a hybrid's per-layer counts (0 marks a recurrent layer)."""
    return max(int(v) for v in value) if isinstance(value, (list, tuple)) else int(value)


def config_for(target_path: str, *, n_ff: int | None = None) -> MtpConfig:
    """An MTP block's hyperparameters for the target at `target_path` (a block appended to its
    trunk, shaped as its own attention layers; `n_ff` may differ from the trunk's)."""
    g = open_gguf(target_path)
    arch = g.architecture
    if arch not in ARCHS:
        raise ValueError(f"{target_path}: MTP blocks for architecture '{arch}' are not supported ({', '.join(ARCHS)})")
    n_embd = int(g.arch_key("embedding_length"))
    n_trunk = int(g.arch_key("block_count")) - int(g.arch_key("nextn_predict_layers", 0) or 0)
    n_head, n_kv = _widest(g.arch_key("attention.head_count")), _widest(g.arch_key("attention.head_count_kv"))
    head_dim = int(g.arch_key("attention.key_length", n_embd // n_head))
    n_rot = int(g.arch_key("rope.dimension_count", head_dim))
    gated = arch in GATED_ARCHS
    sections = tuple(int(s) for s in g.arch_key("rope.dimension_sections", ()) or ())
    emb = g.tensors["token_embd.weight"]
    scaling = g.arch_key("rope.scaling.type")
    return MtpConfig(arch=arch, n_vocab=int(emb.shape[0]), n_embd=n_embd, n_trunk=n_trunk, n_nextn=1, n_head=n_head,
                     n_kv_head=n_kv, head_dim=head_dim, n_ff=int(n_ff or g.arch_key("feed_forward_length")), n_rot=n_rot,
                     neox=arch != "llama", rope_base=float(g.arch_key("rope.freq_base", 10000.0)),
                     rope_scale=float(g.arch_key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
                     eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)), gated=gated,
                     unrotated=imrope_unrotated(n_rot, sections) if gated else (),
                     n_ctx=int(g.arch_key("context_length", 4096)))


def target_parts(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and lm_head [n_vocab, n_embd] (the embedding when tied), float32."""
    embed = target_tensor(target_path, "token_embd.weight")
    out = target_tensor(target_path, "output.weight")
    return embed, (embed if out is None else out)


def random_net(target_path: str, *, seed: int = 0, n_ff: int | None = None, **kw) -> MtpNet:
    torch.manual_seed(seed)
    cfg = config_for(target_path, n_ff=n_ff)
    if kw:
        cfg = attrs.evolve(cfg, **kw)
    embed, head = target_parts(target_path)
    net = MtpNet(cfg, embed, head, bias=not cfg.gated)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1:  # norms and biases off their defaults, so a test sees them used
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return net


def write_random_sidecar(path, target_path: str, *, seed: int = 0, qtype: str = "F32", n_ff: int | None = None,
                         shared: bool | None = None, draft_vocab=None, extra: dict[str, str] | None = None) -> tuple[str, MtpNet]:
    """A random MTP sidecar for the target at `target_path` (with `draft_vocab`, the token ids it
    drafts from; `extra`: more metadata). Returns (path, the net)."""
    net = random_net(target_path, seed=seed, n_ff=n_ff)
    write_sidecar(str(path), target_path, net.gguf_weights(), qtype=qtype, shared=shared, draft_vocab=draft_vocab,
                  extra=extra)
    return str(path), net
