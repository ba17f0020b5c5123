"""Small pieces shared by the architectures: RMSNorm, rotary embeddings, the per-layer KV step."""
from __future__ import annotations

import contextlib

import torch

from speculant import Batch, ForwardOutput, KVCache, backend_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As llama.cpp computes it: the float squares summed in double, one after the other (cumsum
    keeps that order), the mean rounded to float, then x * (1 / sqrtf(mean + eps)) and the weight
    in float. torch's float32 sqrt is not always correctly rounded (sqrtf is); the float64 sqrt
    rounded to float is. A float32 sum drifts from it where the activations are large (gemma's)."""
    mean = ((x * x).double().cumsum(-1)[..., -1:] / x.shape[-1]).float()
    return x * (1.0 / torch.sqrt((mean + eps).double()).float()) * weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, head_dim/2] for the given absolute positions (linear position scaling `scale`)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (positions.to(torch.float64) / scale)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def batch_scope(backend, batch: Batch, prompt: bool = True):
    """The backend's `batch(batch, prompt)` scope around a forward's layers, where it has one (the
    CPU backend computes prompt rows as llama.cpp does there). The last layer's FFN goes in a
    nested scope with prompt=False: llama.cpp keeps only the rows that want logits from there on,
    so their FFN is computed as decode rows are."""
    scope = backend_kernel(backend, "batch")
    return scope(batch, prompt) if scope is not None else contextlib.nullcontext()


# llama-server decodes a recurrent model's prompt of more than RECURRENT_TAIL tokens as two
# batches, the last RECURRENT_TAIL rows apart (it saves a checkpoint before them, to resume a
# later prompt there). A short prompt's rows take the arithmetic of the batch they fall in, so a
# hybrid model marks its rows by that split: rows before the tail as a prompt of n - TAIL rows,
# the tail's as a prompt of TAIL rows of its own. Prompts of SHORT_PROMPT tokens or more are left
# as they are (their rows take the backend's fast kernels either way).
RECURRENT_TAIL, SHORT_PROMPT = 4, 64


def recurrent_prompt_rows(positions, prompt_lens) -> tuple[list[int], list[int]]:
    """(positions, prompt lengths) as llama-server's split batches of a recurrent model see them."""
    pos, lens = [], []
    for p, n in zip(positions, prompt_lens):
        if RECURRENT_TAIL < n < SHORT_PROMPT and p < n:
            head = n - RECURRENT_TAIL
            pos.append(p if p < head else p - head)
            lens.append(head if p < head else RECURRENT_TAIL)
        else:
            pos.append(p)
            lens.append(n)
    return pos, lens


def recurrent_batch_scope(backend, batch: Batch):
    """batch_scope for a recurrent model: its prompt rows marked as llama-server's split batches."""
    if not batch.prompt_lens:
        return batch_scope(backend, batch)
    pos, lens = recurrent_prompt_rows(batch.positions, batch.prompt_lens)
    return batch_scope(backend, Batch(batch.seq_ids, tuple(pos), batch.tokens, batch.want_logits, tuple(lens)))


def ffn_scope(backend, batch: Batch, layer: int, n_layers: int):
    """Around layer `layer`'s FFN, inside the forward's batch_scope: the last layer's FFN computes
    its rows as decode rows (see batch_scope); the others keep the forward's scope as it is."""
    return batch_scope(backend, batch, prompt=False) if layer == n_layers - 1 else contextlib.nullcontext()


def rope_fn(backend):
    """The backend's `rope_tables` where it has one (the CPU backend builds them as llama.cpp does)."""
    return backend_kernel(backend, "rope_tables", rope_tables)


def norm_fn(backend):
    """The backend's `rms_norm` where it has one (the CPU backend's is one native call)."""
    return backend_kernel(backend, "rms_norm", rms_norm)


def rotate_fn(backend):
    """The backend's `apply_rope` where it has one."""
    return backend_kernel(backend, "apply_rope", apply_rope)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim]. NEOX style pairs dimension i with i + d/2 (qwen, gemma);
    the original style pairs 2i with 2i+1 (llama, whose GGUF converter permutes q/k for it).

    Rounded as llama.cpp's compiled code does it, with one FMA each: x1 cos - (x2 sin) and
    x1 sin + (x2 cos), the bracketed product rounded to float. The fused product is exact in
    float64, so the sum there rounds once more only at a float64 tie (about 2^-29 of cases)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    first = (x1.double() * cos.double() - (x2 * sin).double()).float()
    second = (x1.double() * sin.double() + (x2 * cos).double()).float()
    if neox:
        return torch.cat([first, second], dim=-1)
    return torch.stack([first, second], dim=-1).flatten(-2)


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
        argmax_head = backend_kernel(backend, "argmax_head")
        self.argmax_output = argmax_head(output) if argmax_head is not None else None  # for greedy rows

    def warm_up(self) -> None:
        """One greedy row through a scratch context, then wait for what the backend prepares
        in the background for such rows (the CPU backend's screened head: read back from its
        cache in about half a second, built in about 20 s the first time for the 1.5B's), so
        that a server's first requests neither run without it nor share the cores with it."""
        context = self.new_context(1)
        self.forward(Batch.for_sequence(0, 0, [0], logits="last", argmax_only=True), context)
        wait = getattr(self.argmax_output, "wait", None)
        if wait is not None:
            wait()

    def row_classes(self, positions, prompt_lens):
        """How the backend computes each row (None: every row alike), see Model.row_classes."""
        classes = backend_kernel(self.backend, "row_classes")
        if classes is None:
            return None
        if self.state_kind == "recurrent":
            positions, prompt_lens = recurrent_prompt_rows(positions, prompt_lens)
        return classes(positions, prompt_lens)

    def new_context(self, max_tokens: int) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_head, c.head_dim, max_tokens, dtype=self.backend.kv_dtype, device=self.backend.device)

    def head(self, batch: Batch, x: torch.Tensor, hidden: dict, hidden_layers: tuple[int, ...]) -> ForwardOutput:
        """Final norm and output projection for the rows that want logits (layer n_layers in
        `hidden_layers` asks for the final-normed state of every row)."""
        c = self.config
        rms_norm = norm_fn(self.backend)
        if c.n_layers in hidden_layers:
            hidden[c.n_layers] = rms_norm(x, self.out_norm, c.eps)
        want = [i for i, w in enumerate(batch.want_logits) if w]
        if not want:  # a prompt chunk: skip the output head
            return ForwardOutput(x.new_empty(0, c.n_vocab), hidden)
        # The head's rows are the logit rows, computed as decode rows (as the last layer's FFN).
        rows = batch.select(want)
        with batch_scope(self.backend, rows, prompt=False):
            h = rms_norm(x[want], self.out_norm, c.eps)
            if self.argmax_output is not None and rows.argmax_only and all(rows.argmax_only):
                logits = self.argmax_output(h)
                if logits is not None:
                    return ForwardOutput(logits, hidden)
            return ForwardOutput(self.output(h), hidden)
