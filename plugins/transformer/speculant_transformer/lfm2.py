"""LFM2 (LiquidAI): short-convolution blocks interleaved with attention blocks, as llama.cpp runs
it (src/models/lfm2.cpp, its GGUF layout read exactly).

Every block: x += mixer(n(x)); x += Wd·(silu(Wg·n(x)) * Wu·n(x)), the mixer either
- attention (the blocks whose `attention.head_count_kv` entry is non-zero): per-head RMSNorm of
  q and k, NEOX rotary embeddings, scale 1/sqrt(head_dim), a sliding window where the file has
  `attention.sliding_window` > 0; or
- a short convolution (the blocks whose entry is 0): B, C, x = in_proj·h (three n_embd chunks),
  Bx = B*x, a causal depthwise convolution of kernel `shortconv.l_cache` over [state | Bx],
  y = out_proj·(C * conv). The state of a conv block is the last l_cache-1 rows of Bx
  ([l_cache-1, n_embd] per sequence), kept in a HybridCache.
The final norm is the tensor `token_embd_norm` (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2); the
output head is `output` or, absent (as converted files have it), the tied `token_embd`.

The convolution runs over every row of every sequence of a forward at once, and each row's sum
is llama.cpp's (ggml_ssm_conv: the taps in order from 0.0f, each one a fused multiply-add in its
compiled CPU code), whatever rows it is computed with. The state after each row is a view of
[state | Bx], so a verification step keeps them all for free (HybridCache per-row states).
"""
from __future__ import annotations

import attrs
import torch

from speculant import Batch, ForwardOutput, HybridCache, KVCache, ModelFileError, backend_kernel, kv_layers
from speculant.gguf import Tokenizer

from speculant_transformer.layers import DecoderModel, attend, recurrent_batch_scope, ffn_scope, norm_fn, reserve, rope_fn, rotate_fn
from speculant_transformer.llama import silu_times
from speculant_transformer.loading import WeightLoader, hparam_float, hparam_int, model_info, require, vocab_size


@attrs.frozen
class Lfm2Config:
    n_vocab: int
    n_embd: int
    n_layers: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_scale: float
    eps: float
    l_cache: int
    window: int
    recurrent: tuple[bool, ...]  # per layer: a short-conv block (head_count_kv 0)

    @classmethod
    def from_gguf(cls, gguf, n_vocab: int) -> "Lfm2Config":
        n_embd = hparam_int(gguf, "embedding_length")
        n_layers = hparam_int(gguf, "block_count")
        prefix = f"{gguf.path}: metadata '{gguf.architecture}."
        n_head = hparam_int(gguf, "attention.head_count")
        kv = gguf.arch_key("attention.head_count_kv", n_head)
        if isinstance(kv, list):  # the converter's form: per layer, 0 for the conv blocks
            if len(kv) != n_layers or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in kv):
                raise ModelFileError(f"{prefix}attention.head_count_kv' must hold {n_layers} non-negative integers, got {kv!r:.80}")
            per_layer = kv
        else:  # one number: every block is an attention block (llama.cpp's get_key_or_arr)
            per_layer = [hparam_int(gguf, "attention.head_count_kv", n_head)] * n_layers
        attn = sorted({n for n in per_layer if n > 0})
        if len(attn) > 1:
            raise ModelFileError(f"{prefix}attention.head_count_kv' differs between attention layers ({attn}), "
                                 f"which this architecture does not support")
        n_kv_head = attn[0] if attn else n_head
        if n_head % n_kv_head:
            raise ModelFileError(f"{prefix}attention.head_count' ({n_head}) is not a multiple of 'head_count_kv' ({n_kv_head})")
        if n_embd % n_head:
            raise ModelFileError(f"{prefix}attention.head_count' ({n_head}) does not divide the embedding length ({n_embd})")
        head_dim = hparam_int(gguf, "attention.key_length", n_embd // n_head)
        if head_dim * n_head != n_embd or hparam_int(gguf, "attention.value_length", head_dim) != head_dim:
            raise ModelFileError(f"{prefix}attention.key_length' ({head_dim}) times the heads ({n_head}) must be the "
                                 f"embedding length ({n_embd}), with equal value length: llama.cpp's LFM2 needs both")
        if hparam_int(gguf, "rope.dimension_count", head_dim) != head_dim:
            raise ModelFileError(f"{prefix}rope.dimension_count' differs from the head size ({head_dim}), "
                                 f"which this architecture does not support")
        l_cache = require(gguf, "shortconv.l_cache")
        if isinstance(l_cache, bool) or not isinstance(l_cache, int) or l_cache < 2:
            raise ModelFileError(f"{prefix}shortconv.l_cache' must be an integer of at least 2, got {l_cache!r:.40}")
        require(gguf, "attention.layer_norm_rms_epsilon")  # llama.cpp's loader requires it too
        scaling = gguf.arch_key("rope.scaling.type")
        return cls(
            n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
            n_ff=hparam_int(gguf, "feed_forward_length"),
            rope_base=hparam_float(gguf, "rope.freq_base", 10000.0),
            rope_scale=hparam_float(gguf, "rope.scaling.factor", 1.0) if scaling in (None, "linear") else 1.0,
            eps=hparam_float(gguf, "attention.layer_norm_rms_epsilon", 1e-5),
            l_cache=l_cache, window=hparam_int(gguf, "attention.sliding_window", 0, minimum=0),
            recurrent=tuple(n == 0 for n in per_layer),
        )


@attrs.define
class Lfm2Block:
    attn_norm: torch.Tensor  # the "operator norm", before either mixer
    # attention blocks
    wq: object = None
    wk: object = None
    wv: object = None
    wo: object = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # short-conv blocks
    in_proj: object = None
    conv: torch.Tensor | None = None  # [n_embd, l_cache] float32
    out_proj: object = None
    ffn_norm: torch.Tensor | None = None
    w_gate: object = None
    w_up: object = None
    w_down: object = None


def fma_conv(padded: torch.Tensor, starts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[r, ch] = sum over k of padded[starts[r] + k, ch] * weight[ch, k], as ggml_ssm_conv's CPU
    code computes it: from 0.0f, tap after tap, each tap one fused multiply-add (GCC contracts
    `sumf += s*c` with -mfma; the first one is just the rounded product). The fused step is done
    in float64, where the product is exact, and rounded to float: the same bits but at a float64
    tie (about 2^-29 of cases). Each row's arithmetic is its own, whatever rows come with it."""
    acc = padded[starts] * weight[:, 0]
    for k in range(1, weight.shape[1]):
        acc = torch.addcmul(acc.double(), padded[starts + k].double(), weight[:, k].double()).float()
    return acc


def _wants_rows(cache: HybridCache, seq_id: int) -> bool:
    wants = getattr(cache, "wants_rows", None)
    return wants(seq_id) if wants is not None else cache.keep_rows


class Lfm2Model(DecoderModel):
    state_kind = "recurrent"

    @classmethod
    def load(cls, gguf, backend, progress=None) -> "Lfm2Model":
        tokenizer = Tokenizer.from_metadata(gguf.metadata, gguf.path)
        cfg = Lfm2Config.from_gguf(gguf, n_vocab=vocab_size(gguf, tokenizer, hparam_int(gguf, "embedding_length")))
        w = WeightLoader(gguf, backend, progress)
        d, hd, kv_dim = cfg.n_embd, cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        blocks = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            blk = Lfm2Block(attn_norm=w.tensor(p + "attn_norm.weight", (d,)))
            if cfg.recurrent[i]:
                blk.in_proj = w.linear(p + "shortconv.in_proj.weight", shape=(3 * d, d))
                blk.conv = w.tensor(p + "shortconv.conv.weight", (d, cfg.l_cache))
                blk.out_proj = w.linear(p + "shortconv.out_proj.weight", shape=(d, d))
            else:
                blk.wq = w.linear(p + "attn_q.weight", shape=(d, d))
                blk.wk = w.linear(p + "attn_k.weight", shape=(kv_dim, d))
                blk.wv = w.linear(p + "attn_v.weight", shape=(kv_dim, d))
                blk.q_norm = w.tensor(p + "attn_q_norm.weight", (hd,))
                blk.k_norm = w.tensor(p + "attn_k_norm.weight", (hd,))
                blk.wo = w.linear(p + "attn_output.weight", shape=(d, d))
            blk.ffn_norm = w.tensor(p + "ffn_norm.weight", (d,))
            blk.w_gate = w.linear(p + "ffn_gate.weight", shape=(cfg.n_ff, d))
            blk.w_up = w.linear(p + "ffn_up.weight", shape=(cfg.n_ff, d))
            blk.w_down = w.linear(p + "ffn_down.weight", shape=(d, cfg.n_ff))
            blocks.append(blk)
        output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight", shape=(cfg.n_vocab, d))
        model = cls(cfg, model_info(gguf, cfg.n_vocab, cfg.n_embd, cfg.n_layers), tokenizer, backend,
                    w.embedding("token_embd.weight", (cfg.n_vocab, d)), blocks, w.tensor("token_embd_norm.weight", (d,)), output)
        model.kv_index = kv_layers(list(cfg.recurrent))
        return model

    def new_context(self, max_tokens: int) -> HybridCache:
        c = self.config
        kv = KVCache(len(self.kv_index), c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype, device=self.backend.device)
        shapes = {i: ((c.l_cache - 1, c.n_embd),) for i, rec in enumerate(c.recurrent) if rec}
        return HybridCache(kv, shapes, dtype=torch.float32)

    def _conv(self, blk: Lfm2Block, layer: int, h: torch.Tensor, groups, cache: HybridCache) -> torch.Tensor:
        """The short-conv mixer for all rows; hands each sequence's states to the cache."""
        d, s = self.config.n_embd, self.config.l_cache - 1
        bcx = blk.in_proj(h)
        b, c, x = bcx[:, :d], bcx[:, d : 2 * d], bcx[:, 2 * d :]
        bx = b * x
        # [state | Bx] of every sequence, one after the other; row r's window starts at starts[r].
        pieces, starts, offsets = [], [], []
        off = 0
        for seq_id, a, e in groups:
            pieces += [cache.read(seq_id, layer)[0].to(bx.dtype), bx[a:e]]
            offsets.append(off)
            starts.append(torch.arange(off, off + e - a))
            off += s + e - a
        padded = torch.cat(pieces).contiguous()
        y = c * fma_conv(padded, torch.cat(starts), blk.conv)
        for (seq_id, a, e), o in zip(groups, offsets):
            n = e - a
            final = padded[o + n : o + n + s].clone()
            # the state after row j is rows j+1 .. j+s of the sequence's [state | Bx]: a view
            rows = padded.as_strided((n, s, d), (d, d, 1), (o + 1) * d) if _wants_rows(cache, seq_id) else None
            cache.write(seq_id, layer, [final], None if rows is None else [rows])
        return blk.out_proj(y)

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: HybridCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        c = self.config
        norm, rotate = norm_fn(self.backend), rotate_fn(self.backend)
        groups = reserve(batch, cache)
        positions = torch.tensor(batch.positions)
        cos, sin = rope_fn(self.backend)(positions, c.head_dim, c.rope_base, c.rope_scale)
        rows = len(batch)
        hidden = {}
        swiglu = backend_kernel(self.backend, "swiglu", silu_times)

        x = self.embed(torch.tensor(batch.tokens))  # [rows, n_embd]
        with recurrent_batch_scope(self.backend, batch):
            for i, blk in enumerate(self.blocks):
                h = norm(x, blk.attn_norm, c.eps)
                if blk.conv is not None:
                    x = x + self._conv(blk, i, h, groups, cache)
                else:
                    q = blk.wq(h).view(rows, c.n_head, c.head_dim)
                    k = blk.wk(h).view(rows, c.n_kv_head, c.head_dim)
                    v = blk.wv(h).view(rows, c.n_kv_head, c.head_dim)
                    q, k = norm(q, blk.q_norm, c.eps), norm(k, blk.k_norm, c.eps)
                    q, k = rotate(q, cos, sin, True), rotate(k, cos, sin, True)
                    attn = attend(self.backend, cache.kv, self.kv_index[i], groups, positions, q, k, v,
                                  c.head_dim**-0.5, c.window)
                    x = x + blk.wo(attn.reshape(rows, c.n_head * c.head_dim))

                h = norm(x, blk.ffn_norm, c.eps)
                with ffn_scope(self.backend, batch, i, c.n_layers):
                    x = x + blk.w_down(swiglu(blk.w_gate(h), blk.w_up(h)))
                if i in hidden_layers:
                    hidden[i] = x
        for seq_id, a, e in groups:
            cache.commit(seq_id, batch.positions[a], batch.positions[e - 1] + 1)

        return self.head(batch, x, hidden, hidden_layers)
