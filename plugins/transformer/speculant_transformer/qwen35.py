"""Qwen3.5 (`qwen35`): Gated DeltaNet linear-attention layers interleaved with gated full attention,
read from llama.cpp's GGUF layout (src/models/qwen35.cpp, delta-net-base.cpp) and computed as its
CPU backend computes it.

Every layer: x += mixer(n(x)); x += ffn(n'(x)) with RMSNorms `attn_norm` and `post_attention_norm`
and a SiLU-gated FFN. The mixer is one of:

- Gated DeltaNet (the recurrent layers, `attention.recurrent_layers` or every layer but each
  `full_attention_interval`-th): qkv = attn_qkv·h goes through a causal depthwise conv1d of
  `ssm.conv_kernel` taps (its state: the last conv_kernel-1 inputs) and SiLU, then splits into q, k
  (`ssm.group_count` heads of `ssm.state_size`, L2-normed) and v (`ssm.time_step_rank` heads; v head
  h reads k/q head h % group_count, llama.cpp's tiled broadcast, for which the converter reorders
  the V heads). Per token and head, with g = softplus(ssm_alpha·h + ssm_dt.bias) * ssm_a (ssm_a is
  -exp(A_log)) and beta = sigmoid(ssm_beta·h), the state S [d_v, d_k] (llama.cpp's transposed
  layout, row j = value channel j) does
      S *= exp(g);  d = (v - S k) * beta;  S += d k^T;  o = (S q) / sqrt(d_k)
  (ggml_gated_delta_net, the fused op llama.cpp runs on CPU for prompts and decode alike). Then
  o = rms_norm(o, ssm_norm) * silu(attn_gate·h) per head, and ssm_out.
- gated attention: attn_q gives per head [query | gate]; q and k RMSNormed per head, rotary on the
  first `rope.dimension_count` dims (NEOX halves, IMROPE sections `rope.dimension_sections`: for
  text the t/h/w sections all take the token position, a fourth section position 0), attention
  scaled 1/sqrt(head_dim), times sigmoid(gate), then attn_output.

`nextn_predict_layers` trailing blocks (counted in block_count) are the NextN/MTP head: loaded and
kept on `model.nextn`, not run in this forward (a draft head runs them).

The recurrence runs row by row over each sequence's rows, the arithmetic of every row the same
whatever else is in the batch, and hands the HybridCache the state after each row when it asks.
Its rounding is ggml's (the dot products' order, the FMAs of ggml_ssm_conv and ggml_vec_mad_f32,
libm's expf and logf), so with the CPU backend's native kernels the logits are llama.cpp's bit for
bit (tests/test_hybrid_qwen35.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math

import attrs
import numpy as np
import torch

from speculant import Batch, ForwardOutput, HybridCache, KVCache, ModelFileError, backend_kernel, kv_layers
from speculant.gguf import Tokenizer

from speculant_transformer.layers import DecoderModel, attend, recurrent_batch_scope, norm_fn, reserve, rope_fn, rotate_fn
from speculant_transformer.llama import silu_times
from speculant_transformer.loading import WeightLoader, attention_shape, hparam_float, hparam_int, model_info, vocab_size

DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the file has neither key


def _arr(gguf, key: str) -> list | None:
    value = gguf.arch_key(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be an array, got {value!r:.40}")
    return list(value)


@attrs.frozen
class Qwen35Config:
    n_vocab: int
    n_embd: int
    n_layers: int  # the trunk's layers (block_count less the NextN ones)
    n_nextn: int
    recurrent: tuple[bool, ...]  # per trunk layer
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    rope_base: float
    rope_scale: float
    eps: float
    d_conv: int  # conv taps
    d_state: int  # head size of k, q and v in the recurrent layers
    n_k_heads: int
    n_v_heads: int

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.d_state * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_gguf(cls, gguf, n_vocab: int) -> "Qwen35Config":
        path, arch = gguf.path, gguf.architecture
        n_embd = hparam_int(gguf, "embedding_length")
        n_all = hparam_int(gguf, "block_count")
        n_nextn = hparam_int(gguf, "nextn_predict_layers", 0, minimum=0)
        if n_nextn >= n_all:
            raise ModelFileError(f"{path}: metadata '{arch}.nextn_predict_layers' ({n_nextn}) leaves no trunk layers "
                                 f"of block_count {n_all} (a NextN-only file is a draft head, not a target)")
        n_layers = n_all - n_nextn
        n_head, n_kv_head, head_dim = attention_shape(gguf, n_embd)
        n_rot = hparam_int(gguf, "rope.dimension_count", head_dim)
        if n_rot % 2 or n_rot > head_dim:
            raise ModelFileError(f"{path}: metadata '{arch}.rope.dimension_count' is {n_rot}: it must be even and at most "
                                 f"the head size {head_dim}")
        sections = _arr(gguf, "rope.dimension_sections")
        if sections is None:
            raise ModelFileError(f"{path}: metadata '{arch}.rope.dimension_sections' is missing")
        if len(sections) > 4 or not all(isinstance(s, int) and s >= 0 for s in sections) or not any(sections[:3]):
            raise ModelFileError(f"{path}: metadata '{arch}.rope.dimension_sections' must be up to 4 non-negative "
                                 f"integers, one of the first three positive, got {sections}")
        sections = tuple(sections) + (0,) * (4 - len(sections))
        if sum(sections) > head_dim:
            raise ModelFileError(f"{path}: metadata '{arch}.rope.dimension_sections' {list(sections)} add up to more than "
                                 f"the head size {head_dim}")
        rec = _arr(gguf, "attention.recurrent_layers")
        if rec is not None:
            if len(rec) != n_all:
                raise ModelFileError(f"{path}: metadata '{arch}.attention.recurrent_layers' has {len(rec)} entries, "
                                     f"block_count is {n_all}")
            recurrent = tuple(bool(r) for r in rec[:n_layers])
        else:
            interval = hparam_int(gguf, "full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
        d_state = hparam_int(gguf, "ssm.state_size")
        n_k_heads, n_v_heads = hparam_int(gguf, "ssm.group_count"), hparam_int(gguf, "ssm.time_step_rank")
        d_inner = hparam_int(gguf, "ssm.inner_size")
        if n_v_heads % n_k_heads:
            raise ModelFileError(f"{path}: metadata '{arch}.ssm.time_step_rank' ({n_v_heads} value heads) is not a multiple "
                                 f"of '{arch}.ssm.group_count' ({n_k_heads} key heads)")
        if d_inner != d_state * n_v_heads:
            raise ModelFileError(f"{path}: metadata '{arch}.ssm.inner_size' ({d_inner}) is not ssm.state_size * "
                                 f"ssm.time_step_rank ({d_state} * {n_v_heads})")
        scaling = gguf.arch_key("rope.scaling.type")
        return cls(
            n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, n_nextn=n_nextn, recurrent=recurrent,
            n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, n_ff=hparam_int(gguf, "feed_forward_length"),
            n_rot=n_rot, rope_sections=sections,
            rope_base=hparam_float(gguf, "rope.freq_base", 10000.0),
            rope_scale=hparam_float(gguf, "rope.scaling.factor", 1.0) if scaling == "linear" else 1.0,
            eps=hparam_float(gguf, "attention.layer_norm_rms_epsilon", 1e-6),
            d_conv=hparam_int(gguf, "ssm.conv_kernel", minimum=2), d_state=d_state,
            n_k_heads=n_k_heads, n_v_heads=n_v_heads,
        )

    def rope_unrotated_pairs(self) -> list[int]:
        """The rotary pairs whose IMROPE section is the fourth one (position 0 for text: cos 1,
        sin 0), as ggml_mrope_cache_init assigns sections to pairs."""
        s = self.rope_sections
        total = sum(s)
        out = []
        for i in range(self.n_rot // 2):
            sector = i % total
            if not ((sector % 3 == 1 and sector < 3 * s[1]) or (sector % 3 == 2 and sector < 3 * s[2])
                    or (sector % 3 == 0 and sector < 3 * s[0])):
                out.append(i)
        return out


@attrs.define
class AttentionMixer:
    wq: object  # [n_head * head_dim * 2, n_embd]: per head [query | gate]
    wk: object
    wv: object
    wo: object
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@attrs.define
class DeltaNetMixer:
    wqkv: object  # [conv_dim, n_embd]
    wgate: object  # z: [value_dim, n_embd]
    conv: torch.Tensor  # [conv_dim, d_conv]
    dt_bias: torch.Tensor  # [n_v_heads]
    a: torch.Tensor  # [n_v_heads], -exp(A_log)
    w_beta: object  # [n_v_heads, n_embd]
    w_alpha: object
    norm: torch.Tensor  # [d_state]
    wout: object  # [n_embd, value_dim]


@attrs.define
class Qwen35Block:
    attn_norm: torch.Tensor
    mixer: AttentionMixer | DeltaNetMixer
    post_norm: torch.Tensor  # post_attention_norm: the FFN's input norm
    w_gate: object
    w_up: object
    w_down: object


@attrs.define
class NextNBlock:
    """One NextN/MTP block (llama.cpp's graph_mtp): h' = eh_proj·[enorm(embed(t)) | hnorm(h)], then a
    full-attention block as the trunk's, then shared_head_norm (else output_norm) and
    shared_head_head (else the output head). embed_tokens, shared_head_* may be absent."""

    layer: int  # its index in the file (block_count counts it)
    block: Qwen35Block
    eh_proj: object  # [n_embd, 2 * n_embd]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    embed_tokens: object | None
    shared_head_head: object | None
    shared_head_norm: torch.Tensor | None


def _libm():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("expf", "logf"):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
        return lib
    except (OSError, AttributeError):
        return None


LIBM = _libm()  # the C library's expf and logf, which llama.cpp's CPU ops call


def _exp(x: torch.Tensor) -> torch.Tensor:
    """expf as the C library computes it. glibc's expf is within 0.502 ulp (its error before the
    final rounding is under 0.002 ulp), so it is the correctly rounded value (exp in double,
    rounded) except where that lies within a hair of the midpoint between two floats: those few
    values (about 2 in 100) are taken from libm's expf itself."""
    yd = torch.exp(x.double())
    y = yd.float()
    if LIBM is None or y.numel() == 0:
        return y
    yb = y.double()
    gap = torch.where(yd >= yb, torch.nextafter(y, y.new_tensor(math.inf)).double() - yb,
                      yb - torch.nextafter(y, y.new_tensor(-math.inf)).double())
    near = ((yd - yb).abs() > 0.49 * gap) & torch.isfinite(gap)
    if near.any():
        flat, xs = y.view(-1), x.reshape(-1)
        for i in near.view(-1).nonzero()[:, 0].tolist():
            flat[i] = LIBM.expf(float(xs[i]))
    return y


def _log(x: torch.Tensor) -> torch.Tensor:
    """logf as the C library computes it (glibc's is within 0.82 ulp: not the correctly rounded
    value often enough that every value is libm's own; only small tensors come here)."""
    if LIBM is None:
        return torch.log(x.double()).float()
    return torch.tensor([LIBM.logf(v) for v in x.reshape(-1).tolist()], dtype=torch.float32).view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """ggml_sigmoid: 1 / (1 + expf(-x)) in float."""
    return 1.0 / (1.0 + _exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ggml_softplus: x above 20, else logf(1 + expf(x)) in float."""
    return torch.where(x > 20.0, x, _log(1.0 + _exp(x)))


def _fma_double(acc: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """acc + x * y rounded once: float products are exact in double, so the double sum rounded
    to float is the FMA (a double rounding in about 2^-29 of cases)."""
    return (acc.double() + x.double() * y.double()).float()


def _addcmul_is_fma() -> bool:
    """Whether torch.addcmul computes acc + x * y with one rounding here (its vector kernel uses
    FMAs on this build), checked on the broadcasts used below, odd lengths included."""
    g = torch.Generator().manual_seed(0)
    for acc_shape, x_shape, y_shape in (((4, 37, 37), (4, 37, 1), (4, 1, 37)), ((3, 16, 2, 4, 16), (3, 16, 2, 4, 16), (3, 1, 2, 4, 16)),
                                       ((5, 129), (5, 129), (1, 129))):
        acc, x, y = (torch.randn(shape, generator=g) for shape in (acc_shape, x_shape, y_shape))
        if not torch.equal(torch.addcmul(acc, x, y), _fma_double(acc, x, y)):
            return False
    return True


_fma = torch.addcmul if _addcmul_is_fma() else _fma_double

# ggml_vec_dot_f32 as llama.cpp's AVX-512 build computes it, on every CPU (as the CPU backend's
# native recurrence does, whatever ISA it was built for: the project's kernels all compute that
# build's bits): GGML_F32_ARR = 4 vector accumulators of GGML_F32_EPR = 16 lanes take the first
# n - n % 64 values with FMAs, element i into lane i % 16 of accumulator (i // 16) % 4; the
# accumulators are added pairwise (0+2, 1+3, then the two), the lanes summed by halves down to
# four, and those as GCC's _mm512_reduce_add_ps does ((0+2) + (1+3)); the rest of the values are
# added one by one, product and sum each rounded (that loop is not contracted to FMAs: checked
# against llama.cpp's tensors, AVX-512 build). (Its AVX2 build sums 8 lanes and ends with two
# hadds; it also differs in attention's fp16 dots and SwiGLU's exp, where the CPU backend follows
# the AVX-512 build, so following the AVX2 order here alone matched neither build.)
GGML_F32_EPR, GGML_F32_ARR = 16, 4


def ggml_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum(x * y) over the last dimension (y broadcast against x) with ggml_vec_dot_f32's rounding."""
    n = x.shape[-1]
    step = GGML_F32_EPR * GGML_F32_ARR
    n_simd = n - n % step
    if n_simd:
        xs = x[..., :n_simd].unflatten(-1, (n_simd // step, GGML_F32_ARR, GGML_F32_EPR))
        ys = y[..., :n_simd].unflatten(-1, (n_simd // step, GGML_F32_ARR, GGML_F32_EPR))
        acc = xs[..., 0, :, :] * ys[..., 0, :, :]  # an FMA onto zero: the product rounded
        for b in range(1, n_simd // step):
            acc = _fma(acc, xs[..., b, :, :], ys[..., b, :, :])
        a = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
        while a.shape[-1] > 4:
            half = a.shape[-1] // 2
            a = a[..., half:] + a[..., :half]
        s = (a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])
    else:
        s = torch.zeros(torch.broadcast_shapes(x.shape, y.shape)[:-1], dtype=torch.float32, device=x.device)
    for i in range(n_simd, n):
        s = s + x[..., i] * y[..., i]
    return s


def delta_net_scan(s, q, k, v, decay, beta, scale: float, out, per_row) -> None:
    """The Gated DeltaNet recurrence in torch, for backends without `gated_delta_net` (see
    BackendKernels): one token at a time, the same arithmetic for any row count, s [hv, dv, dk]
    updated in place."""
    for t in range(q.shape[0]):
        s.mul_(decay[t][:, None, None])  # ggml_vec_scale_f32
        kt = k[t][:, None, :]
        delta = (v[t] - ggml_dot(s, kt)) * beta[t][:, None]  # [hv, dv]
        s.copy_(_fma(s, delta[:, :, None], kt))  # ggml_vec_mad_f32: S[j] += delta[j] k, FMAs
        out[t] = ggml_dot(s, q[t][:, None, :]) * scale
        if per_row is not None:
            per_row[t] = s


class Qwen35Model(DecoderModel):
    state_kind = "recurrent"

    def __init__(self, config, info, tokenizer, backend, embed, blocks, out_norm, output, nextn):
        super().__init__(config, info, tokenizer, backend, embed, blocks, out_norm, output)
        self.nextn: list[NextNBlock] = nextn
        self.kv_index = kv_layers(list(config.recurrent))
        self._unrotated = config.rope_unrotated_pairs()

    @classmethod
    def load(cls, gguf, backend, progress=None) -> "Qwen35Model":
        tokenizer = Tokenizer.from_metadata(gguf.metadata, gguf.path)
        cfg = Qwen35Config.from_gguf(gguf, n_vocab=vocab_size(gguf, tokenizer, hparam_int(gguf, "embedding_length")))
        w = WeightLoader(gguf, backend, progress)
        d = cfg.n_embd

        def attention(p: str) -> AttentionMixer:
            hd, q_dim, kv_dim = cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
            return AttentionMixer(
                wq=w.linear(p + "attn_q.weight", p + "attn_q.bias", (2 * q_dim, d)),
                wk=w.linear(p + "attn_k.weight", p + "attn_k.bias", (kv_dim, d)),
                wv=w.linear(p + "attn_v.weight", p + "attn_v.bias", (kv_dim, d)),
                wo=w.linear(p + "attn_output.weight", shape=(d, q_dim)),
                q_norm=w.tensor(p + "attn_q_norm.weight", (hd,)), k_norm=w.tensor(p + "attn_k_norm.weight", (hd,)))

        def block(p: str, mixer) -> Qwen35Block:
            return Qwen35Block(
                attn_norm=w.tensor(p + "attn_norm.weight", (d,)), mixer=mixer(p),
                post_norm=w.tensor(p + "post_attention_norm.weight", (d,)),
                w_gate=w.linear(p + "ffn_gate.weight", shape=(cfg.n_ff, d)),
                w_up=w.linear(p + "ffn_up.weight", shape=(cfg.n_ff, d)),
                w_down=w.linear(p + "ffn_down.weight", shape=(d, cfg.n_ff)))

        def delta_net(p: str) -> DeltaNetMixer:
            hv = cfg.n_v_heads
            return DeltaNetMixer(
                wqkv=w.linear(p + "attn_qkv.weight", shape=(cfg.conv_dim, d)),
                wgate=w.linear(p + "attn_gate.weight", shape=(cfg.value_dim, d)),
                conv=w.tensor(p + "ssm_conv1d.weight", (cfg.conv_dim, cfg.d_conv)),
                dt_bias=w.tensor(p + "ssm_dt.bias", (hv,)), a=w.tensor(p + "ssm_a", (hv,)),
                w_beta=w.linear(p + "ssm_beta.weight", shape=(hv, d)),
                w_alpha=w.linear(p + "ssm_alpha.weight", shape=(hv, d)),
                norm=w.tensor(p + "ssm_norm.weight", (cfg.d_state,)),
                wout=w.linear(p + "ssm_out.weight", shape=(d, cfg.value_dim)))

        blocks = [block(f"blk.{i}.", delta_net if cfg.recurrent[i] else attention) for i in range(cfg.n_layers)]
        output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight", shape=(cfg.n_vocab, d))
        embed = w.embedding("token_embd.weight", (cfg.n_vocab, d))
        nextn = []
        for i in range(cfg.n_layers, cfg.n_layers + cfg.n_nextn):
            p = f"blk.{i}."
            nextn.append(NextNBlock(
                layer=i, block=block(p, attention),
                eh_proj=w.linear(p + "nextn.eh_proj.weight", shape=(d, 2 * d)),
                enorm=w.tensor(p + "nextn.enorm.weight", (d,)), hnorm=w.tensor(p + "nextn.hnorm.weight", (d,)),
                embed_tokens=w.embedding(p + "nextn.embed_tokens.weight", (cfg.n_vocab, d))
                if w.has(p + "nextn.embed_tokens.weight") else None,
                shared_head_head=w.linear(p + "nextn.shared_head_head.weight", shape=(cfg.n_vocab, d))
                if w.has(p + "nextn.shared_head_head.weight") else None,
                shared_head_norm=w.tensor(p + "nextn.shared_head_norm.weight", (d,))
                if w.has(p + "nextn.shared_head_norm.weight") else None,
            ))
        return cls(cfg, model_info(gguf, cfg.n_vocab, cfg.n_embd, cfg.n_layers), tokenizer, backend,
                   embed, blocks, w.tensor("output_norm.weight", (d,)), output, nextn)

    # --- state -------------------------------------------------------------------------------
    def state_shapes(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """Per recurrent layer: the conv state [conv_dim, d_conv - 1] (the last inputs, oldest
        first) and the DeltaNet state [n_v_heads, d_state (value), d_state (key)]."""
        c = self.config
        return {i: ((c.conv_dim, c.d_conv - 1), (c.n_v_heads, c.d_state, c.d_state))
                for i in range(c.n_layers) if c.recurrent[i]}

    def new_context(self, max_tokens: int) -> HybridCache:
        c = self.config
        kv = KVCache(len(self.kv_index), c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype,
                     device=self.backend.device)
        return HybridCache(kv, self.state_shapes())

    # --- forward -----------------------------------------------------------------------------
    def _silu(self, x: torch.Tensor) -> torch.Tensor:
        """ggml_silu over rows of x's last dimension (the backend's swiglu with an up of ones: the
        same vector code, times 1)."""
        swiglu = backend_kernel(self.backend, "swiglu", silu_times)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return swiglu(flat, torch.ones_like(flat)).view(x.shape)

    def _l2_norm(self, x: torch.Tensor) -> torch.Tensor:
        """llama.cpp's build_gdn_l2_norm: rms_norm(x, eps / n) * (1 / sqrtf(n)) over the last dim."""
        n = x.shape[-1]
        eps = float(np.float32(self.config.eps) / np.float32(n))
        inv = float(np.float32(1.0) / np.sqrt(np.float32(n)))
        return norm_fn(self.backend)(x, torch.ones(n, dtype=x.dtype, device=x.device), eps) * inv

    def _attention(self, mx: AttentionMixer, layer: int, h, cache: KVCache, groups, positions, rope) -> torch.Tensor:
        c = self.config
        norm, rotate = norm_fn(self.backend), rotate_fn(self.backend)
        rows, hd = h.shape[0], c.head_dim
        qg = mx.wq(h).view(rows, c.n_head, 2, hd)
        q = norm(qg[:, :, 0].contiguous(), mx.q_norm, c.eps)
        gate = qg[:, :, 1].reshape(rows, c.n_head * hd)
        k = norm(mx.wk(h).view(rows, c.n_kv_head, hd), mx.k_norm, c.eps)
        v = mx.wv(h).view(rows, c.n_kv_head, hd)
        cos, sin = rope
        if c.n_rot == hd:
            q, k = rotate(q, cos, sin, True), rotate(k, cos, sin, True)
        else:  # partial rotary: the first n_rot dims turn, the rest pass through
            r = c.n_rot
            q = torch.cat([rotate(q[..., :r].contiguous(), cos, sin, True), q[..., r:]], dim=-1)
            k = torch.cat([rotate(k[..., :r].contiguous(), cos, sin, True), k[..., r:]], dim=-1)
        out = attend(self.backend, cache, self.kv_index[layer], groups, positions, q, k, v, hd**-0.5)
        return mx.wo(out.reshape(rows, c.n_head * hd) * sigmoid(gate))

    def _delta_net(self, mx: DeltaNetMixer, layer: int, h, cache: HybridCache, groups) -> torch.Tensor:
        c = self.config
        rows, dk, hk, hv = h.shape[0], c.d_state, c.n_k_heads, c.n_v_heads
        qkv = mx.wqkv(h)  # [rows, conv_dim]
        z = mx.wgate(h)  # [rows, value_dim]
        beta = sigmoid(mx.w_beta(h))  # [rows, hv]
        g = softplus(mx.w_alpha(h) + mx.dt_bias) * mx.a  # [rows, hv]
        decay = _exp(g)
        scale = float(np.float32(1.0) / np.sqrt(np.float32(dk)))
        wants_rows = getattr(cache, "wants_rows", None)
        native_scan = backend_kernel(self.backend, "gated_delta_net")
        out = h.new_empty(rows, hv, dk)
        for seq_id, a, b in groups:
            n = b - a
            conv_state, state = cache.read(seq_id, layer)
            x = torch.cat([conv_state, qkv[a:b].t()], dim=1)  # [conv_dim, d_conv - 1 + n], oldest first
            # ggml_ssm_conv: each output the taps summed in order, one FMA each (compiled so)
            acc = x[:, 0:n] * mx.conv[:, 0:1]
            for t in range(1, c.d_conv):
                acc = _fma(acc, x[:, t:t + n], mx.conv[:, t:t + 1])
            mixed = self._silu(acc.t().contiguous())  # [n, conv_dim]
            q = self._l2_norm(mixed[:, :c.key_dim].reshape(n, hk, dk))
            k = self._l2_norm(mixed[:, c.key_dim:2 * c.key_dim].reshape(n, hk, dk))
            v = mixed[:, 2 * c.key_dim:].reshape(n, hv, dk)
            if hv != hk:  # value head j reads key head j % hk (ggml's tiled broadcast)
                q, k = q.repeat(1, hv // hk, 1), k.repeat(1, hv // hk, 1)
            keep = cache.keep_rows if wants_rows is None else wants_rows(seq_id)
            s = state.clone()  # [hv, dv, dk]: row j is value channel j; `state` stays the state before
            scan = self._scan(native_scan)
            out[a:b] = scan(s, q, k, v, decay[a:b], beta[a:b], scale)
            if keep:
                # Row j's state, when a verification keeps rows up to j, made only then: the conv
                # window is columns j+1.. of [state | inputs]; the DeltaNet state (hv x dv x dk
                # floats, 19 MiB a row over a 0.8B's layers) is recomputed from the state before
                # and this forward's q, k, v, decay, beta: the recurrence alone, no projection.
                def row_state(j: int, state=state, q=q, k=k, v=v, d=decay[a:b], bt=beta[a:b], x=x, scan=scan):
                    s_j = state.clone()
                    scan(s_j, q[: j + 1], k[: j + 1], v[: j + 1], d[: j + 1], bt[: j + 1], scale)
                    return [x[:, j + 1 : j + c.d_conv].contiguous(), s_j]
            cache.write(seq_id, layer, [x[:, n:].contiguous(), s], row_state if keep else None)
        o = norm_fn(self.backend)(out, mx.norm, c.eps) * self._silu(z.view(rows, hv, dk))
        return mx.wout(o.view(rows, c.value_dim))

    @staticmethod
    def _scan(native_scan):
        """scan(s, q, k, v, decay, beta, scale) -> out: the backend's gated_delta_net, else torch's."""
        if native_scan is not None:
            return native_scan

        def scan(s, q, k, v, decay, beta, scale):
            out = q.new_empty(q.shape[0], s.shape[0], s.shape[1])
            delta_net_scan(s, q, k, v, decay, beta, scale, out, None)
            return out
        return scan

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        cos, sin = rope_fn(self.backend)(positions, c.n_rot, c.rope_base, c.rope_scale)
        if self._unrotated:
            cos, sin = cos.clone(), sin.clone()
            cos[:, self._unrotated], sin[:, self._unrotated] = 1.0, 0.0
        return cos, sin

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: HybridCache, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        c = self.config
        norm = norm_fn(self.backend)
        swiglu = backend_kernel(self.backend, "swiglu", silu_times)
        groups = reserve(batch, cache)
        positions = torch.tensor(batch.positions)
        rope = self._rope(positions)
        hidden = {}

        x = self.embed(torch.tensor(batch.tokens))  # [rows, n_embd]
        # llama.cpp computes every layer, the last one's FFN included, over all rows; only the
        # output head takes the logit rows alone (DecoderModel.head).
        with recurrent_batch_scope(self.backend, batch):
            for i, blk in enumerate(self.blocks):
                h = norm(x, blk.attn_norm, c.eps)
                if isinstance(blk.mixer, DeltaNetMixer):
                    x = x + self._delta_net(blk.mixer, i, h, cache, groups)
                else:
                    x = x + self._attention(blk.mixer, i, h, cache.kv, groups, positions, rope)
                h = norm(x, blk.post_norm, c.eps)
                x = x + blk.w_down(swiglu(blk.w_gate(h), blk.w_up(h)))
                if i in hidden_layers:
                    hidden[i] = x
        for seq_id, a, b in groups:
            cache.commit(seq_id, batch.positions[a], batch.positions[b - 1] + 1)

        return self.head(batch, x, hidden, hidden_layers)

