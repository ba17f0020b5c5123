"""The DFlash drafter at inference, on the target's backend: llama.cpp's graphs.

    encode(taps)   g = hidden_norm(fc(cat(taps)))                       per row, no state
    inject(...)    every layer's keys and values of g at its positions, into the drafter's KV
                   cache: K = rope(k_norm(W_k g)), V = W_v g (or, without W_v, rms_norm(W_k g))
    draft(...)     the block [last token, MASK x (B-1)] at positions P..P+B-1 through every
                   layer: pre-norm attention (q/k norms, NeoX RoPE) over the injected context of
                   positions 0..P-1 and the block itself, both ways (non-causal, unless the file
                   says causal); SwiGLU FFN; final norm; the lm_head on the rows asked for.

Token embeddings and the lm_head are the drafter's own where the file has them, else borrowed
from the target, as llama.cpp does. Weights stay in the file's quantized form behind
`backend.linear`. Every batch holds the blocks of several sequences, each attending over its own
context only.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from speculant import KVCache, ModelFileError, ModelInfo, SpeculantError, backend_kernel
from speculant.drafting import trained_window

from speculant_dflash.kernels import (apply_rope, attention_masked, gelu_times, rms_norm, rope_tables,
                                      rope_tables_factors, rotate, silu_times)
from speculant_dflash.layout import ARCH, LAYER_TENSORS, MATRICES, OPTIONAL_LAYER_TENSORS, DFlashConfig, expected_shapes, read_config


def _scaled(fn, scale):
    return fn if scale is None else (lambda x: fn(x) * scale)


class DFlashHead:
    """A loaded drafter (what the `dflash` architecture builder returns). It drafts only with a
    target: `Model.forward` on its own has no meaning and says so."""

    state_kind = "kv"
    tokenizer = None

    def __init__(self, config: DFlashConfig, info: ModelInfo, backend, parts: dict, layers: list[dict],
                 d2t: torch.Tensor | None):
        self.config, self.info, self.backend, self.parts, self.layers, self.d2t = config, info, backend, parts, layers, d2t
        self.trained_window = 0  # the positions a training window held (0: not recorded)
        self.norm = backend_kernel(backend, "rms_norm", rms_norm)
        self.rope = backend_kernel(backend, "rope_tables", rope_tables)
        self.rotate = backend_kernel(backend, "apply_rope", apply_rope)
        self.swiglu = backend_kernel(backend, "swiglu", silu_times)
        gelu = backend_kernel(backend, "gelu_tanh", None)
        self.geglu = (lambda g, u: gelu(g) * u) if gelu is not None else gelu_times

    @classmethod
    def load(cls, gguf, backend, progress) -> "DFlashHead":
        cfg = read_config(gguf)
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

        def linear(prefix):
            s = get(f"{prefix}.scale", optional=True)
            return _scaled(backend.linear(get(f"{prefix}.weight")), backend.tensor(s) if s is not None else None)

        parts = {"fc": linear("fc"), "enc_norm": backend.tensor(get("enc.output_norm.weight")),
                 "output_norm": backend.tensor(get("output_norm.weight"))}
        freqs = get("rope_freqs.weight", optional=True)
        parts["rope_freqs"] = backend.tensor(freqs).float() if freqs is not None else None
        layers = []
        for i in range(cfg.n_layers):
            layer = {}
            for t in LAYER_TENSORS + OPTIONAL_LAYER_TENSORS:
                name = f"blk.{i}.{t}"
                optional = t in OPTIONAL_LAYER_TENSORS
                if t in MATRICES:
                    layer[t] = linear(name) if not optional or f"{name}.weight" in gguf.tensors else None
                else:
                    info = get(f"{name}.weight", optional=optional)
                    layer[t] = backend.tensor(info) if info is not None else None
            layers.append(layer)
        emb = get("token_embd.weight", optional=True)
        parts["token_embd"] = backend.embedding(emb) if emb is not None else None
        d2t = None
        d2t_info = get("d2t", optional=True)
        if d2t_info is not None:
            d2t = torch.from_numpy(np.asarray(d2t_info.data, dtype=np.int64).reshape(-1).copy())
            if len(set(d2t.tolist())) != len(d2t) or int(d2t.min()) < 0:
                raise ModelFileError(f"{gguf.path}: 'd2t' must hold distinct target ids")
        out = gguf.tensors.get("output.weight")
        if out is not None:
            parts["output"] = linear("output")
        elif emb is not None and (d2t is None or cfg.n_draft_vocab == cfg.n_target_vocab):
            parts["output"] = backend.linear(emb)  # tied, as llama.cpp duplicates token_embd
        else:
            if d2t is not None:
                raise ModelFileError(f"{gguf.path}: 'd2t' maps the rows of an lm_head the file does not have ('output')")
            parts["output"] = None
        info = ModelInfo(path=gguf.path, architecture=ARCH, n_vocab=cfg.n_target_vocab, n_embd=cfg.n_embd,
                         n_layers=cfg.n_layers, n_ctx_train=cfg.n_ctx, file_bytes=os.path.getsize(gguf.path))
        head = cls(cfg, info, backend, parts, layers, d2t)
        head.trained_window = trained_window(gguf.metadata)
        return head

    def windowable(self) -> bool:
        """Can a block be limited to its last context rows (`draft`'s context_rows)? Not for a
        causal drafter, nor one with sliding-window layers or attention sinks (their own masks)."""
        c = self.config
        return not c.causal and not any(c.is_swa(i) for i in range(c.n_layers)) and \
            all(layer["attn_sinks"] is None for layer in self.layers)

    # --- the Model protocol, as far as it applies ---------------------------------------------
    def new_context(self, max_tokens: int) -> KVCache:
        """The injected context of every sequence, per layer; room for a block past its end."""
        c = self.config
        return KVCache(c.n_layers, c.n_kv_head, c.head_dim, max_tokens + c.block_size, dtype=self.backend.kv_dtype,
                       device=self.backend.device)

    def forward(self, batch, context, hidden_layers=()):
        raise SpeculantError(f"{self.info.path} is a DFlash drafter: it drafts for a target model (--spec-type dflash -md HEAD.gguf)")

    # --- pieces ----------------------------------------------------------------------------------
    def _tables(self, positions: torch.Tensor):
        c = self.config
        if self.parts["rope_freqs"] is not None:
            return rope_tables_factors(positions, c.rot, c.rope_base, c.rope_scale, self.parts["rope_freqs"])
        return self.rope(positions, c.rot, c.rope_base, c.rope_scale)

    def _rot(self, x, cos, sin):
        return rotate(x, cos, sin, self.config.rot, self.rotate)

    def _kv(self, layer: dict, h: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, not yet rotated) and values of rows h, as llama.cpp computes them."""
        c = self.config
        k = layer["attn_k"](h).view(rows, c.n_kv_head, c.head_dim)
        if layer["attn_v"] is None:  # K shared as V: V = rms_norm(K) without a weight
            v = self.norm(k, torch.ones(c.head_dim), c.eps)
        else:
            v = layer["attn_v"](h).view(rows, c.n_kv_head, c.head_dim)
        return self.norm(k, layer["attn_k_norm"], c.eps), v

    # --- the graphs --------------------------------------------------------------------------------
    def encode(self, taps: torch.Tensor) -> torch.Tensor:
        """[rows, K * n_embd] target states -> the fused context g [rows, n_embd]."""
        return self.norm(self.parts["fc"](taps.float().contiguous()), self.parts["enc_norm"], self.config.eps)

    @torch.inference_mode()
    def inject(self, parts: list[tuple[int, int, torch.Tensor]], cache: KVCache) -> None:
        """Write the keys and values of context rows into every layer: `parts` holds (seq_id,
        start position, g [rows, n_embd]); each sequence's cache must hold exactly `start` rows."""
        if not parts:
            return
        g = torch.cat([p[2] for p in parts]).float().contiguous()
        positions = torch.cat([torch.arange(s, s + len(x)) for _, s, x in parts])
        cos, sin = self._tables(positions)
        for seq_id, start, x in parts:
            if cache.length(seq_id) != start:
                raise ValueError(f"sequence {seq_id}: context rows start at {start}, the drafter's cache holds {cache.length(seq_id)}")
            cache.reserve(seq_id, start + len(x))
        rows = len(g)
        for il, layer in enumerate(self.layers):
            k, v = self._kv(layer, g, rows)
            k = self._rot(k, cos, sin)
            lo = 0
            for seq_id, start, x in parts:
                hi = lo + len(x)
                cache.write(il, seq_id, start, k[lo:hi].transpose(0, 1).to(cache.dtype), v[lo:hi].transpose(0, 1).to(cache.dtype))
                lo = hi
        for seq_id, start, x in parts:
            cache.commit(seq_id, start + len(x))

    @torch.inference_mode()
    def draft(self, blocks: list[tuple[int, list[int], int]], cache: KVCache, embed=None, output=None,
              context_rows: int = 0) -> list[torch.Tensor]:
        """One forward over several sequences' blocks: (seq_id, block tokens, rows wanting logits).
        Each block starts at its sequence's cache length P (the injected context: positions
        0..P-1) and is not kept in the cache; with `context_rows` (a non-causal drafter without
        sliding-window layers or sinks, `windowable`), it sees only the last that many of them.
        Returns, per block, the logits [n, draft vocabulary] of block rows 1..n (row i predicts
        the token at position P + i)."""
        c, p = self.config, self.parts
        starts = [cache.length(seq_id) for seq_id, _, _ in blocks]
        tokens = torch.tensor([t for _, toks, _ in blocks for t in toks])
        positions = torch.cat([torch.arange(s, s + len(toks)) for s, (_, toks, _) in zip(starts, blocks)])
        rows = len(tokens)
        x = (p["token_embd"](tokens) if p["token_embd"] is not None else embed(tokens)).float()
        if c.embedding_scale:
            x = x * c.embedding_scale
        cos, sin = self._tables(positions)
        scale = c.attention_scale or c.head_dim ** -0.5
        spans = []
        lo = 0
        for (seq_id, toks, _), start in zip(blocks, starts):
            cache.reserve(seq_id, start + len(toks))
            spans.append((seq_id, lo, lo + len(toks), start))
            lo += len(toks)
        for il, layer in enumerate(self.layers):
            h = self.norm(x, layer["attn_norm"], c.eps)
            q = self.norm(layer["attn_q"](h).view(rows, c.n_head, c.head_dim), layer["attn_q_norm"], c.eps)
            k, v = self._kv(layer, h, rows)
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            attn = q.new_empty(rows, c.n_head, c.head_dim)
            window = c.n_swa if c.is_swa(il) else 0
            for seq_id, a, b, start in spans:
                kc, vc = cache.write(il, seq_id, start, k[a:b].transpose(0, 1).to(cache.dtype), v[a:b].transpose(0, 1).to(cache.dtype))
                if layer["attn_sinks"] is None and not window:
                    # the backend's causal kernel: a row "at" the block's last position sees it all
                    mask_pos = positions[a:b] if c.causal else torch.full((b - a,), start + b - a - 1, dtype=positions.dtype)
                    # from the block's last position back over the block and its context rows
                    keys = context_rows + (b - a) if context_rows and not c.causal else 0
                    attn[a:b] = self.backend.attention(q[a:b].contiguous(), kc, vc, mask_pos, scale, keys)
                else:
                    attn[a:b] = attention_masked(q[a:b], kc, vc, positions[a:b], torch.arange(start + b - a), scale,
                                                 c.causal, window, layer["attn_sinks"])
            out = layer["attn_output"](attn.reshape(rows, c.n_head * c.head_dim).contiguous())
            if c.value_scale:
                out = out * c.value_scale
            if layer["post_attention_norm"] is not None:
                out = self.norm(out, layer["post_attention_norm"], c.eps)
            x = x + out
            h = self.norm(x, layer["ffn_norm"], c.eps)
            act = self.geglu if c.activation == "gelu" else self.swiglu
            out = layer["ffn_down"](act(layer["ffn_gate"](h), layer["ffn_up"](h)).contiguous())
            if layer["post_ffw_norm"] is not None:
                out = self.norm(out, layer["post_ffw_norm"], c.eps)
            x = x + out
            if layer["layer_output_scale"] is not None:
                x = x * layer["layer_output_scale"]
        want = [a + 1 + j for (_, a, b, _), (_, _, n) in zip(spans, blocks) for j in range(min(n, b - a - 1))]
        head = p["output"] if p["output"] is not None else output
        if head is None:
            raise SpeculantError(f"{self.info.path}: the drafter has no lm_head and the target lends none")
        logits = head(self.norm(x[want], p["output_norm"], c.eps)) if want else x.new_empty(0, c.n_draft_vocab)
        if c.logit_scale:
            logits = logits * c.logit_scale
        if c.softcap:
            logits = torch.tanh(logits / c.softcap) * c.softcap
        out, lo = [], 0
        for (_, a, b, _), (_, _, n) in zip(spans, blocks):
            m = min(n, b - a - 1)
            out.append(logits[lo : lo + m])
            lo += m
        return out
