"""The EAGLE3 head at inference, on the target's backend: llama.cpp's two graphs.

    encode(taps)  g = fc([norm](cat(h_lo, h_mid, h_hi)))             per row, no state
    decode(...)   at position P, the pair (token t_{P+1}, g_P):
                  a = cat(attn_norm(embed(t)), attn_norm_2(g)); attention over a (one layer,
                  RoPE at P, its own KV cache); residual g (or the normed g); SwiGLU FFN with
                  residual; that pre-norm state is the next draft step's g; output_norm, then
                  the lm_head over the draft vocabulary.

Token embeddings (and the lm_head, when the file has none) are borrowed from the target, as
llama.cpp does. The weights stay in the file's quantized form behind `backend.linear`.
"""
from __future__ import annotations

import numpy as np
import torch

from speculant import Batch, KVCache, ModelFileError, ModelInfo, SpeculantError, backend_kernel
from speculant.drafting import trained_window

from speculant_eagle3.layout import ARCH, LAYER_TENSORS, HeadConfig, expected_shapes, read_config
from speculant_eagle3.kernels import apply_rope, rms_norm, rope_tables, silu_times


class Eagle3Head:
    """A loaded head (what the `eagle3` architecture builder returns). It drafts only with a
    target: `Model.forward` on its own has no meaning and says so."""

    state_kind = "kv"
    tokenizer = None

    def __init__(self, config: HeadConfig, info: ModelInfo, backend, parts: dict, d2t: torch.Tensor | None):
        self.config, self.info, self.backend, self.parts, self.d2t = config, info, backend, parts, d2t
        self.trained_window = 0  # the positions it attended over in training (0: not recorded)
        self.norm = backend_kernel(backend, "rms_norm", rms_norm)
        self.rope = backend_kernel(backend, "rope_tables", rope_tables)
        self.rotate = backend_kernel(backend, "apply_rope", apply_rope)
        self.swiglu = backend_kernel(backend, "swiglu", silu_times)

    @classmethod
    def load(cls, gguf, backend, progress) -> "Eagle3Head":
        import os

        cfg = read_config(gguf)
        if cfg.n_embd != cfg.target_hidden:
            # The decoder concatenates the (borrowed) target embedding with g: both n_embd wide.
            raise ModelFileError(f"{gguf.path}: the head's n_embd {cfg.n_embd} differs from the target's {cfg.target_hidden}")

        shapes = expected_shapes(cfg)

        def get(name, optional=False):
            info = gguf.tensors.get(name)
            if info is None and not optional:
                raise ModelFileError(f"{gguf.path}: tensor '{name}' is missing")
            if info is not None:
                # A wrong shape would fail in the first draft, costing every request its
                # speculation with no word why; here it is one line naming the tensor.
                if tuple(info.shape) != shapes[name]:
                    raise ModelFileError(f"{gguf.path}: tensor '{name}' has shape {list(info.shape)}, expected "
                                         f"{list(shapes[name])} from the '{ARCH}.*' hyperparameters")
                progress(info.data.nbytes)
            return info

        parts = {"fc": backend.linear(get("fc.weight"))}
        if cfg.norm_before_fc:
            parts["enc_norm"] = backend.tensor(get("enc.output_norm.weight"))
        for t in LAYER_TENSORS:
            info = get(f"blk.0.{t}.weight")
            parts[t] = backend.tensor(info) if t.endswith("norm") or t == "attn_norm_2" else backend.linear(info)
        parts["output_norm"] = backend.tensor(get("output_norm.weight"))
        out = get("output.weight", optional=True)
        parts["output"] = backend.linear(out) if out is not None else None
        emb = get("token_embd.weight", optional=True)
        parts["token_embd"] = backend.embedding(emb) if emb is not None else None
        d2t = None
        d2t_info = get("d2t", optional=True)
        if d2t_info is not None:
            d2t = torch.from_numpy(np.asarray(d2t_info.data, dtype=np.int64).reshape(-1).copy())
            if len(set(d2t.tolist())) != len(d2t) or int(d2t.min()) < 0:
                raise ModelFileError(f"{gguf.path}: 'd2t' must hold distinct target ids")
        info = ModelInfo(path=gguf.path, architecture=ARCH, n_vocab=cfg.n_target_vocab, n_embd=cfg.n_embd, n_layers=1,
                         n_ctx_train=cfg.n_ctx, file_bytes=os.path.getsize(gguf.path))
        head = cls(cfg, info, backend, parts, d2t)
        head.trained_window = trained_window(gguf.metadata)
        return head

    # --- the Model protocol, as far as it applies ---------------------------------------------
    def new_context(self, max_tokens: int) -> KVCache:
        c = self.config
        return KVCache(1, c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype, device=self.backend.device)

    def forward(self, batch, context, hidden_layers=()):
        raise SpeculantError(f"{self.info.path} is an EAGLE3 head: it drafts for a target model (--spec-type eagle3 -md HEAD.gguf)")

    # --- the two graphs ------------------------------------------------------------------------
    def encode(self, taps: torch.Tensor) -> torch.Tensor:
        """[rows, 3 * target n_embd] -> g [rows, n_embd]."""
        x = taps.float().contiguous()
        if self.config.norm_before_fc:
            x = self.norm(x, self.parts["enc_norm"], self.config.eps)
        return self.parts["fc"](x)

    @torch.inference_mode()
    def decode(self, batch: Batch, cache: KVCache, g: torch.Tensor, embed, output=None,
               window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token, g) at the batch's positions, appended to `cache`; with `window`, a row
        attends over the last `window` rows only. `embed`: token ids ->
        [rows, n_embd] (the target's, unless the head has its own); `output`: the target's lm_head
        for a head without one. Returns (logits of the rows that want them, over the draft
        vocabulary; the pre-norm state of every row)."""
        c, p = self.config, self.parts
        rows = len(batch)
        tokens = torch.tensor(batch.tokens)
        e = p["token_embd"](tokens) if p["token_embd"] is not None else embed(tokens)
        g = g.float()
        gn = self.norm(g, p["attn_norm_2"], c.eps)
        a = torch.cat([self.norm(e.float(), p["attn_norm"], c.eps), gn], dim=-1).contiguous()
        positions = torch.tensor(batch.positions)
        cos, sin = self.rope(positions, c.head_dim, c.rope_base, 1.0)
        q = self.rotate(p["attn_q"](a).view(rows, c.n_head, c.head_dim), cos, sin, False)
        k = self.rotate(p["attn_k"](a).view(rows, c.n_kv_head, c.head_dim), cos, sin, False)
        v = p["attn_v"](a).view(rows, c.n_kv_head, c.head_dim)
        attn = q.new_empty(rows, c.n_head, c.head_dim)
        groups = batch.groups()
        for seq_id, lo, hi in groups:
            if batch.positions[lo] != cache.length(seq_id):
                raise ValueError(f"sequence {seq_id}: head rows start at {batch.positions[lo]}, its cache holds {cache.length(seq_id)}")
            cache.reserve(seq_id, batch.positions[hi - 1] + 1)
            kc, vc = cache.write(0, seq_id, batch.positions[lo], k[lo:hi].transpose(0, 1).to(cache.dtype),
                                 v[lo:hi].transpose(0, 1).to(cache.dtype))
            attn[lo:hi] = self.backend.attention(q[lo:hi].contiguous(), kc, vc, positions[lo:hi], c.head_dim ** -0.5, window)
        for seq_id, _, hi in groups:
            cache.commit(seq_id, batch.positions[hi - 1] + 1)
        x = (gn if c.norm_before_residual else g) + p["attn_output"](attn.reshape(rows, c.n_head * c.head_dim))
        h = self.norm(x, p["ffn_norm"], c.eps)
        x = x + p["ffn_down"](self.swiglu(p["ffn_gate"](h), p["ffn_up"](h)).contiguous())
        want = [i for i, w in enumerate(batch.want_logits) if w]
        head = p["output"] if p["output"] is not None else output
        if head is None:
            raise SpeculantError(f"{self.info.path}: the head has no lm_head and the target lends none")
        logits = head(self.norm(x[want], p["output_norm"], c.eps)) if want else x.new_empty(0, c.n_draft_vocab)
        return logits, x
