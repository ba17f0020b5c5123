"""llama.cpp's NextN / MTP layout: where the block sits in a GGUF, its hyperparameters, and writing
a sidecar.

In a target GGUF (llama.cpp `src/llama-model.cpp`, gguf-py `constants.py`):

    {arch}.block_count           the trunk's layers plus K
    {arch}.nextn_predict_layers  K, the MTP blocks, at block indices trunk .. trunk+K-1
    blk.{i}.nextn.eh_proj        [2 n_embd -> n_embd], reading [enorm(embed(x)) | hnorm(h)]
    blk.{i}.nextn.enorm, .hnorm  RMSNorm weights
    blk.{i}.nextn.embed_tokens      optional (else token_embd)
    blk.{i}.nextn.shared_head_norm  optional (else output_norm)
    blk.{i}.nextn.shared_head_head  optional (else output, else token_embd)
    blk.{i}.<the architecture's ordinary attention and FFN tensors>

A sidecar (`convert_hf_to_gguf.py --mtp`, file name `mtp-...gguf`, passed as `-md`) has the same
architecture and metadata (block_count still counts the trunk) and holds only the MTP block plus
the shared token_embd / output_norm / output: llama.cpp's qwen35 loader makes the trunk tensors
optional when `blk.0.attn_norm` is absent but still requires token_embd and output_norm
(src/models/qwen35.cpp, `mtp_only`). speculant reads either; in a sidecar without token_embd,
output_norm or output it borrows the target's.

Block kinds (how the block's attention and FFN tensors are named and computed):

    gated   qwen35 (Qwen3.5's dense MTP block, llama.cpp's graph_mtp): attn_q holds [query | gate]
            per head, per-head q/k RMSNorm, IMROPE over rope.dimension_count dims (NeoX halves),
            output * sigmoid(gate); post_attention_norm before the FFN
    plain   qwen2, qwen3, llama (speculant's trained sidecars): q/k/v with optional biases,
            optional q/k norms, RoPE over the whole head (NeoX but for llama); ffn_norm

llama.cpp runs MTP only for architectures with an MTP graph (qwen35, qwen35moe, qwen3next, glm4-moe,
deepseek2, ...); for qwen2 / qwen3 / llama it has none (its draft-mtp also needs the target to
export h_nextn, which those graphs do not), so a sidecar for those is read by speculant alone.
The target state h the block reads is the target's final hidden state after output_norm, what
llama.cpp exports as h_nextn for qwen35 (and glm4-moe, deepseek2).
"""
from __future__ import annotations

import attrs
import numpy as np

from speculant import ModelFileError

GATED_ARCHS = ("qwen35",)
# speculant's own key (llama.cpp ignores it): the token ids the block drafts from, by default; the
# trainer stores its training vocabulary here. The lm_head over these rows costs a fraction of the
# whole vocabulary's (on a 150k-token target, the lm_head is three quarters of a draft step).
VOCAB_KEY = "speculant.mtp.draft_vocab"
PLAIN_ARCHS = ("qwen2", "qwen3", "llama")
ARCHS = GATED_ARCHS + PLAIN_ARCHS
NEXTN = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


@attrs.frozen
class MtpConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_trunk: int  # the target's layers (block_count less K)
    n_nextn: int  # K
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_rot: int  # rotary dims of a head (the first n_rot)
    neox: bool
    rope_base: float
    rope_scale: float
    eps: float
    gated: bool  # qwen35's block: [query | gate] rows, q/k norms, sigmoid(gate) on the output
    unrotated: tuple[int, ...] = ()  # rotary pairs that IMROPE's fourth section leaves at position 0
    n_ctx: int = 4096

    @property
    def ffn_norm(self) -> str:
        return "post_attention_norm" if self.gated else "ffn_norm"

    def block(self, k: int = 0) -> int:
        """The block index of MTP block k."""
        return self.n_trunk + k


def _int(gguf, key: str, default=None) -> int:
    value = gguf.arch_key(key, default)
    if value is None:
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' is missing")
    if isinstance(value, (list, tuple)):  # per-layer arrays (hybrids): the MTP block's is the last
        value = value[-1]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelFileError(f"{gguf.path}: metadata '{gguf.architecture}.{key}' must be an integer, got {value!r:.40}") from None


def imrope_unrotated(n_rot: int, sections: tuple[int, ...]) -> tuple[int, ...]:
    """The rotary pairs whose IMROPE section is the fourth one (position 0 for text), as
    ggml_mrope_cache_init assigns sections to pairs (sector i % sum(sections), interleaved t/h/w)."""
    s = tuple(sections) + (0,) * (4 - len(sections))
    total = sum(s)
    if not total:
        return ()
    out = []
    for i in range(n_rot // 2):
        sector = i % total
        if not ((sector % 3 == 1 and sector < 3 * s[1]) or (sector % 3 == 2 and sector < 3 * s[2])
                or (sector % 3 == 0 and sector < 3 * s[0])):
            out.append(i)
    return tuple(out)


def has_nextn(gguf) -> bool:
    """Whether the file holds an MTP block (llama.cpp's auto-detection: the last block's eh_proj)."""
    k = gguf.arch_key("nextn_predict_layers", 0) or 0
    n = gguf.arch_key("block_count", 0) or 0
    return int(k) > 0 and f"blk.{int(n) - 1}.nextn.eh_proj.weight" in gguf.tensors


def read_config(gguf, n_vocab: int | None = None) -> MtpConfig:
    """The MTP block's hyperparameters from an opened GGUF (a target with NextN layers or a
    sidecar), checked. `n_vocab`: the vocabulary when the file has no token_embd (else its rows)."""
    arch, path = gguf.architecture, gguf.path
    if arch not in ARCHS:
        raise ModelFileError(f"{path}: MTP blocks of architecture '{arch}' are not supported (supported: {', '.join(ARCHS)})")
    n_all = _int(gguf, "block_count")
    k = _int(gguf, "nextn_predict_layers", 0)
    if k <= 0:
        raise ModelFileError(f"{path}: no MTP block ('{arch}.nextn_predict_layers' is {k or 'missing'})")
    if k >= n_all:
        raise ModelFileError(f"{path}: '{arch}.nextn_predict_layers' ({k}) leaves no trunk of block_count {n_all}")
    n_embd = _int(gguf, "embedding_length")
    n_head = _int(gguf, "attention.head_count")
    n_kv = _int(gguf, "attention.head_count_kv", n_head)
    if n_head <= 0 or n_kv <= 0 or n_head % n_kv:
        raise ModelFileError(f"{path}: bad attention shape (heads {n_head}, kv heads {n_kv})")
    head_dim = _int(gguf, "attention.key_length", n_embd // n_head)
    n_rot = _int(gguf, "rope.dimension_count", head_dim)
    if n_rot % 2 or n_rot > head_dim:
        raise ModelFileError(f"{path}: '{arch}.rope.dimension_count' is {n_rot}: it must be even and at most {head_dim}")
    gated = arch in GATED_ARCHS
    unrotated: tuple[int, ...] = ()
    if gated:
        sections = gguf.arch_key("rope.dimension_sections")
        if sections is None:
            raise ModelFileError(f"{path}: metadata '{arch}.rope.dimension_sections' is missing")
        unrotated = imrope_unrotated(n_rot, tuple(int(s) for s in sections))
    emb = gguf.tensors.get("token_embd.weight")
    if n_vocab is None:
        if emb is None:
            tokens = gguf.metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFileError(f"{path}: neither token_embd nor a tokenizer tells the vocabulary size")
            n_vocab = len(tokens)
        else:
            n_vocab = int(emb.shape[0])
    scaling = gguf.arch_key("rope.scaling.type")
    return MtpConfig(
        arch=arch, n_vocab=int(n_vocab), n_embd=n_embd, n_trunk=n_all - k, n_nextn=k, n_head=n_head, n_kv_head=n_kv,
        head_dim=head_dim, n_ff=_int(gguf, "feed_forward_length"), n_rot=n_rot, neox=arch != "llama",
        rope_base=float(gguf.arch_key("rope.freq_base", 10000.0)),
        rope_scale=float(gguf.arch_key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        eps=float(gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)), gated=gated, unrotated=unrotated,
        n_ctx=int(gguf.arch_key("context_length", 4096)),
    )


def block_shapes(c: MtpConfig, k: int = 0) -> dict[str, tuple[int, ...]]:
    """Every tensor of MTP block k (required or optional) and its shape in PyTorch order."""
    b, d = f"blk.{c.block(k)}.", c.n_embd
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    out = {
        b + "nextn.eh_proj.weight": (d, 2 * d), b + "nextn.enorm.weight": (d,), b + "nextn.hnorm.weight": (d,),
        b + "nextn.embed_tokens.weight": (c.n_vocab, d), b + "nextn.shared_head_head.weight": (c.n_vocab, d),
        b + "nextn.shared_head_norm.weight": (d,),
        b + "attn_norm.weight": (d,), b + "attn_q.weight": ((2 if c.gated else 1) * q, d), b + "attn_k.weight": (kv, d),
        b + "attn_v.weight": (kv, d), b + "attn_output.weight": (d, q),
        b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
        b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,),
        b + f"{c.ffn_norm}.weight": (d,), b + "ffn_gate.weight": (c.n_ff, d), b + "ffn_up.weight": (c.n_ff, d),
        b + "ffn_down.weight": (d, c.n_ff),
    }
    return out


def required(c: MtpConfig, k: int = 0) -> list[str]:
    b = f"blk.{c.block(k)}."
    names = [b + n for n in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight",
                             "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                             f"{c.ffn_norm}.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    if c.gated:
        names += [b + "attn_q_norm.weight", b + "attn_k_norm.weight"]
    return names


SHARED = ("token_embd.weight", "output_norm.weight", "output.weight")


def _copy_metadata(reader, writer, arch: str, n_trunk: int, n_nextn: int, n_ff: int | None = None) -> None:
    """The target's metadata for a file of n_trunk + n_nextn blocks: block_count and
    nextn_predict_layers set; every per-layer array (llama.cpp checks their length against
    block_count: attention.recurrent_layers, per-layer head counts, ...) cut to the trunk and
    extended for the MTP blocks (False, or the array's largest value: an attention layer's);
    feed_forward_length per layer where the block's FFN (`n_ff`) differs from the trunk's."""
    from gguf import GGUFValueType

    from speculant.gguf import field_value

    n_target = None
    for name, field in reader.fields.items():
        if name == f"{arch}.block_count":
            n_target = int(field_value(field)[0])
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.name", f"{arch}.block_count",
                                                f"{arch}.nextn_predict_layers"):
            continue
        value, vtype, sub = field_value(field)
        if vtype == GGUFValueType.ARRAY and name.startswith(arch + ".") and len(value) == n_target \
                and sub != GGUFValueType.STRING:
            trunk = list(value)[:n_trunk]
            extra = False if sub == GGUFValueType.BOOL else max(trunk)
            value = trunk + [extra] * n_nextn
        elif name == f"{arch}.feed_forward_length" and n_ff is not None and vtype != GGUFValueType.ARRAY and value != n_ff:
            value, vtype, sub = [value] * n_trunk + [n_ff] * n_nextn, GGUFValueType.ARRAY, vtype
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.add_block_count(n_trunk + n_nextn)
    writer.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)


def _copy_tensor(writer, info) -> None:
    """A tensor of an opened GGUF into a GGUFWriter, as it is (quantized blocks stay blocks)."""
    data = np.asarray(info.data)
    if data.dtype == np.uint8:  # the raw blocks, [rows, bytes per row]
        writer.add_tensor(info.name, data, raw_dtype=info.qtype)
    else:
        writer.add_tensor(info.name, data)


def write_sidecar(path: str, target_path: str, weights: dict[str, np.ndarray], *, n_nextn: int = 1, qtype: str = "F16",
                  shared: bool | None = None, name: str = "speculant MTP head", extra: dict[str, str] | None = None,
                  draft_vocab: np.ndarray | None = None) -> str:
    """Write an MTP sidecar for the target at `target_path` in llama.cpp's layout: the target's
    metadata (tokenizer included) with block_count = trunk + n_nextn and nextn_predict_layers =
    n_nextn, and the tensors `weights` (GGUF names -> float arrays, PyTorch order; matrices stored
    as `qtype`, 1-D tensors as F32). `shared`: copy token_embd, output_norm and output from the
    target as llama.cpp's sidecar loader requires (default: for the architectures llama.cpp can
    run MTP for, qwen35; others borrow the target's at load and keep the file small).
    `draft_vocab`: token ids to draft from by default (VOCAB_KEY)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from speculant.gguf import open_gguf

    tg = open_gguf(target_path)
    arch = tg.architecture
    if arch not in ARCHS:
        raise ModelFileError(f"{target_path}: MTP sidecars for architecture '{arch}' are not supported ({', '.join(ARCHS)})")
    n_trunk = int(tg.arch_key("block_count")) - int(tg.arch_key("nextn_predict_layers", 0) or 0)
    if shared is None:
        shared = arch in GATED_ARCHS
    w = GGUFWriter(str(path), arch)
    gates = [a.shape[0] for n, a in weights.items() if n.endswith(".ffn_gate.weight")]
    _copy_metadata(GGUFReader(target_path), w, arch, n_trunk, n_nextn, n_ff=gates[0] if gates else None)
    w.add_name(name)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    if draft_vocab is not None:
        w.add_array(VOCAB_KEY, [int(t) for t in np.asarray(draft_vocab).reshape(-1)])
    q = GGMLQuantizationType[qtype]
    if shared:
        for tname in SHARED:
            info = tg.tensors.get(tname)
            if info is not None and tname not in weights:
                _copy_tensor(w, info)
    for tname, arr in weights.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or q == GGMLQuantizationType.F32:
            w.add_tensor(tname, arr)
        elif q == GGMLQuantizationType.F16:
            w.add_tensor(tname, arr.astype(np.float16))
        else:
            w.add_tensor(tname, quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def split_sidecar(target_path: str, out_path: str, *, shared: bool = True) -> str:
    """A sidecar holding the MTP block(s) of a target GGUF that has them, as
    `convert_hf_to_gguf.py --mtp` writes one: the target's metadata, the nextn blocks' tensors
    as they are (same types), and with `shared` token_embd / output_norm / output."""
    from gguf import GGUFReader, GGUFWriter

    from speculant.gguf import copy_fields, open_gguf

    tg = open_gguf(target_path)
    arch = tg.architecture
    k = int(tg.arch_key("nextn_predict_layers", 0) or 0)
    if k <= 0:
        raise ModelFileError(f"{target_path}: no MTP block to split off")
    n_trunk = int(tg.arch_key("block_count")) - k
    keep = [n for n in tg.tensors if any(n.startswith(f"blk.{i}.") for i in range(n_trunk, n_trunk + k))]
    if shared:
        keep += [n for n in SHARED if n in tg.tensors]
    w = GGUFWriter(str(out_path), arch)
    copy_fields(GGUFReader(target_path), w, keep=lambda key: not key.startswith("GGUF.") and key != "general.architecture")
    for n in keep:
        _copy_tensor(w, tg.tensors[n])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out_path)
