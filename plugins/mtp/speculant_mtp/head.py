"""The MTP head at inference, on the target's backend: llama.cpp's graph_mtp.

    decode(rows)   at position q, the pair (token x_q, target state h_{q-1}):
                   x = eh_proj([enorm(embed(x_q)) | hnorm(h)])
                   x = x + attention(attn_norm(x))        (one layer, RoPE at q, its own KV cache)
                   x = x + FFN(ffn_norm(x))                (SwiGLU)
                   s = shared_head_norm(x)                 the row's output state, the next draft
                                                           step's h (llama.cpp's h_nextn)
                   logits = shared_head_head(s)            over the target's vocabulary

With the file's draft vocabulary (`speculant.mtp.draft_vocab`, which `speculant train mtp` writes)
the lm_head is those rows only: on a 150k-token target the whole lm_head is three quarters of a
draft step. The embedding, the head norm and the lm_head fall back as llama.cpp's do (nextn.embed_tokens ->
token_embd, shared_head_norm -> output_norm, shared_head_head -> output -> token_embd), and what a
file lacks, or holds identical to the target, is the target's own module (no second copy). The
weights stay in the file's quantized form behind `backend.linear`.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from speculant import Batch, KVCache, ModelFileError, SpeculantError, backend_kernel
from speculant.drafting import trained_window
from speculant.gguf import TensorInfo

from speculant_mtp.kernels import apply_rope, rms_norm, rope_for, rope_tables, rotate_partial, silu_times
from speculant_mtp.layout import VOCAB_KEY, MtpConfig, block_shapes, read_config, required


class MtpHead:
    """A loaded MTP block with what it borrows from its target."""

    def __init__(self, config: MtpConfig, path: str, backend, parts: dict, embed, head_norm, head, in_target: bool,
                 vocab: torch.Tensor | None = None, trained_window: int = 0):
        self.config, self.path, self.backend, self.parts = config, path, backend, parts
        self.trained_window = trained_window  # the positions it attended over in training (0: not recorded)
        self.embed, self.head_norm, self.head = embed, head_norm, head
        self.vocab = vocab  # the token id of each logit column, or None: the whole vocabulary
        self.in_target = in_target  # the block sits in the target's own file
        self.file_bytes = os.path.getsize(path)
        self.norm = backend_kernel(backend, "rms_norm", rms_norm)
        self.rope = backend_kernel(backend, "rope_tables", rope_tables)
        self.rotate = backend_kernel(backend, "apply_rope", apply_rope)
        self.swiglu = backend_kernel(backend, "swiglu", silu_times)

    @classmethod
    def load(cls, gguf, target, progress=None, full_vocab: bool = False) -> "MtpHead":
        """MTP block 0 of the opened GGUF `gguf` (the target's own file or a sidecar), on the
        target's backend, borrowing from `target` (a loaded model with `embed`, `out_norm`,
        `output`) what the file lacks or holds identical. The lm_head covers the file's draft
        vocabulary (VOCAB_KEY) where it has one, unless `full_vocab`."""
        backend = target.backend
        in_target = os.path.realpath(gguf.path) == os.path.realpath(target.info.path)
        cfg = read_config(gguf, n_vocab=target.info.n_vocab)
        if cfg.n_embd != target.info.n_embd:
            raise ModelFileError(f"{gguf.path}: the MTP block is {cfg.n_embd} wide, the target {target.info.path} "
                                 f"{target.info.n_embd}")
        if cfg.n_trunk != target.info.n_layers:
            raise ModelFileError(f"{gguf.path}: the MTP block follows a trunk of {cfg.n_trunk} layers, the target "
                                 f"{target.info.path} has {target.info.n_layers}")
        shapes = block_shapes(cfg)
        for name in required(cfg):
            if name not in gguf.tensors:
                raise ModelFileError(f"{gguf.path}: tensor '{name}' of the MTP block is missing")

        def info(name):
            t = gguf.tensors.get(name)
            if t is not None:
                want = shapes.get(name)
                if want is not None and tuple(t.shape) != want:
                    raise ModelFileError(f"{gguf.path}: tensor '{name}' has shape {list(t.shape)}, expected {list(want)}")
                if progress:
                    progress(t.data.nbytes)
            return t

        b = f"blk.{cfg.block()}."
        shared = _target_block(target) if in_target and gguf.metadata.get(VOCAB_KEY) is None else None
        if shared is not None:  # the target loaded its own NextN block: use those modules, no second copy
            parts, embed, head_norm, head = shared
            return cls(cfg, gguf.path, backend, parts, embed, head_norm, head, in_target)
        parts = {}
        for n in ("nextn.eh_proj", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            parts[n] = backend.linear(info(b + n + ".weight"))
        for n in ("attn_q", "attn_k", "attn_v"):
            parts[n] = backend.linear(info(b + n + ".weight"), info(b + n + ".bias"))
        for n in ("nextn.enorm", "nextn.hnorm", "attn_norm", cfg.ffn_norm, "attn_q_norm", "attn_k_norm"):
            t = info(b + n + ".weight")
            parts[n] = backend.tensor(t) if t is not None else None
        parts["ffn_norm"] = parts.pop(cfg.ffn_norm)
        if (parts["attn_q_norm"] is None) != (parts["attn_k_norm"] is None):
            raise ModelFileError(f"{gguf.path}: the MTP block has only one of attn_q_norm and attn_k_norm")

        target_file = None if in_target else _open(target.info.path)

        def own(name):
            """The file's tensor `name` unless it is the target's own (same file, or the same bytes)."""
            t = gguf.tensors.get(name)
            if t is None or in_target:
                return None
            if target_file is not None and _same(t, target_file.tensors.get(name)):
                return None
            return info(name)

        t = info(b + "nextn.embed_tokens.weight") or own("token_embd.weight")
        embed = backend.embedding(t) if t is not None else _borrow(target, "embed", gguf.path)
        t = info(b + "nextn.shared_head_norm.weight") or own("output_norm.weight")
        head_norm = backend.tensor(t) if t is not None else _borrow(target, "out_norm", gguf.path)
        t = info(b + "nextn.shared_head_head.weight")
        if t is None and not in_target:
            out = gguf.tensors.get("output.weight") or gguf.tensors.get("token_embd.weight")
            if out is not None and not (target_file is not None and _same(out, target_file.tensors.get("output.weight")
                                                                     or target_file.tensors.get("token_embd.weight"))):
                t = info(out.name)
        vocab = None
        ids = gguf.metadata.get(VOCAB_KEY)
        if ids is not None and not full_vocab:
            vocab = torch.tensor([int(i) for i in ids], dtype=torch.long)
            if vocab.dim() != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= cfg.n_vocab \
                    or len(torch.unique(vocab)) != len(vocab):
                raise ModelFileError(f"{gguf.path}: '{VOCAB_KEY}' must hold distinct token ids below {cfg.n_vocab}")
            if t is None:  # the rows of the target's own lm_head
                source = target_file or _open(target.info.path)
                t = source.tensors.get("output.weight") or source.tensors.get("token_embd.weight")
            else:
                source = gguf
            rows = source.read_rows(t, vocab.numpy())
            t = TensorInfo(t.name, t.qtype, (len(vocab),) + tuple(t.shape[1:]), rows)
        head = backend.linear(t) if t is not None else _borrow(target, "output", gguf.path)
        return cls(cfg, gguf.path, backend, parts, embed, head_norm, head, in_target, vocab, trained_window(gguf.metadata))

    def new_context(self, max_tokens: int) -> KVCache:
        c = self.config
        return KVCache(1, c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype, device=self.backend.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the block's own weights as the file holds them (what speculation adds)."""
        return self.file_bytes

    @torch.inference_mode()
    def decode(self, batch: Batch, cache: KVCache, h: torch.Tensor, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token, h) at the batch's positions, appended to `cache` (each sequence's rows must
        continue its cache); with `window`, a row attends over the last `window` rows only.
        Returns (logits of the rows that want them, over the target's vocabulary or the head's
        draft vocabulary `vocab`; the output state of every row, the next step's h)."""
        c, p = self.config, self.parts
        rows, hd = len(batch), c.head_dim
        e = self.embed(torch.tensor(batch.tokens)).float()
        a = torch.cat([self.norm(e, p["nextn.enorm"], c.eps), self.norm(h.float().contiguous(), p["nextn.hnorm"], c.eps)], -1)
        x = p["nextn.eh_proj"](a.contiguous())
        y = self.norm(x, p["attn_norm"], c.eps)
        if c.gated:
            qg = p["attn_q"](y).view(rows, c.n_head, 2, hd)
            q, gate = qg[:, :, 0].contiguous(), qg[:, :, 1].reshape(rows, c.n_head * hd)
        else:
            q, gate = p["attn_q"](y).view(rows, c.n_head, hd), None
        k = p["attn_k"](y).view(rows, c.n_kv_head, hd)
        v = p["attn_v"](y).view(rows, c.n_kv_head, hd)
        if p["attn_q_norm"] is not None:
            q, k = self.norm(q, p["attn_q_norm"], c.eps), self.norm(k, p["attn_k_norm"], c.eps)
        positions = torch.tensor(batch.positions)
        cos, sin = rope_for(c, positions, self.rope)
        q = rotate_partial(q, cos, sin, c.n_rot, c.neox, self.rotate)
        k = rotate_partial(k, cos, sin, c.n_rot, c.neox, self.rotate)
        attn = q.new_empty(rows, c.n_head, hd)
        groups = batch.groups()
        for seq_id, lo, hi in groups:
            if batch.positions[lo] != cache.length(seq_id):
                raise ValueError(f"sequence {seq_id}: MTP rows start at {batch.positions[lo]}, its cache holds {cache.length(seq_id)}")
            cache.reserve(seq_id, batch.positions[hi - 1] + 1)
            kc, vc = cache.write(0, seq_id, batch.positions[lo], k[lo:hi].transpose(0, 1).to(cache.dtype),
                                 v[lo:hi].transpose(0, 1).to(cache.dtype))
            attn[lo:hi] = self.backend.attention(q[lo:hi].contiguous(), kc, vc, positions[lo:hi], hd ** -0.5, window)
        for seq_id, _, hi in groups:
            cache.commit(seq_id, batch.positions[hi - 1] + 1)
        o = attn.reshape(rows, c.n_head * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        x = x + p["attn_output"](o.contiguous())
        y = self.norm(x, p["ffn_norm"], c.eps)
        x = x + p["ffn_down"](self.swiglu(p["ffn_gate"](y), p["ffn_up"](y)).contiguous())
        s = self.norm(x, self.head_norm, c.eps)
        want = [i for i, w in enumerate(batch.want_logits) if w]
        logits = self.head(s[want].contiguous()) if want else s.new_empty(0, c.n_vocab if self.vocab is None else len(self.vocab))
        return logits, s


def _target_block(target):
    """(parts, embed, head norm, lm_head) from the NextN block a target model loaded with its trunk
    (`target.nextn[0]`, as the transformer plugin's qwen35 keeps it: `eh_proj`, `enorm`, `hnorm`,
    `block` with `attn_norm`, `mixer` (`wq`, `wk`, `wv`, `wo`, `q_norm`, `k_norm`), `post_norm`,
    `w_gate`, `w_up`, `w_down`, and the optional `embed_tokens`, `shared_head_norm`,
    `shared_head_head`), or None when the target keeps none in that form."""
    blocks = getattr(target, "nextn", None)
    if not blocks:
        return None
    nb = blocks[0]
    try:
        blk, mx = nb.block, nb.block.mixer
        parts = {"nextn.eh_proj": nb.eh_proj, "nextn.enorm": nb.enorm, "nextn.hnorm": nb.hnorm, "attn_norm": blk.attn_norm,
                 "attn_q": mx.wq, "attn_k": mx.wk, "attn_v": mx.wv, "attn_output": mx.wo, "attn_q_norm": mx.q_norm,
                 "attn_k_norm": mx.k_norm, "ffn_norm": blk.post_norm, "ffn_gate": blk.w_gate, "ffn_up": blk.w_up,
                 "ffn_down": blk.w_down}
        embed = nb.embed_tokens if nb.embed_tokens is not None else target.embed
        head_norm = nb.shared_head_norm if nb.shared_head_norm is not None else target.out_norm
        head = nb.shared_head_head if nb.shared_head_head is not None else target.output
    except AttributeError:
        return None
    return parts, embed, head_norm, head


def _open(path: str):
    from speculant.gguf import open_gguf

    return open_gguf(path)


def _same(a, b) -> bool:
    """Whether two tensors of opened GGUFs hold the same type, shape and bytes."""
    return (b is not None and a.qtype == b.qtype and tuple(a.shape) == tuple(b.shape)
            and np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)))


def _borrow(target, attr: str, path: str):
    part = getattr(target, attr, None)
    if part is None:
        raise SpeculantError(f"{path}: the MTP block borrows the target's '{attr}', which {target.info.path} does not lend")
    return part
