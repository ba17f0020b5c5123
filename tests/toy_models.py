"""Tiny pure-torch models for engine tests: no GGUF, no kernels, fully deterministic.

ToyModel's next-token logits are a fixed random function of the whole history (a rolling hash),
so any mistake in what the engine feeds or keeps changes the output. ToyRecurrentModel keeps
that hash as a state that cannot be truncated, only saved and restored.
"""
from __future__ import annotations

import torch

from speculant import Batch, ForwardOutput, ModelInfo

N_VOCAB = 32
EOS = 31
MOD = 1_000_003


class ToyTokenizer:
    eog_ids = frozenset({EOS})


def _logits(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    logits = torch.randn(N_VOCAB, generator=g) * 3
    logits[EOS] -= 2  # end of generation is possible but rare
    return logits


def _next_hash(h: int, token: int) -> int:
    return (h * 131 + token + 7) % MOD


class ListContext:
    """A truncatable per-sequence state: the list of rolling hashes."""

    state_kind = "kv"

    def __init__(self):
        self.hashes: dict[int, list[int]] = {}

    def length(self, seq_id):
        return len(self.hashes.get(seq_id, []))

    def truncate(self, seq_id, n):
        if seq_id in self.hashes:
            del self.hashes[seq_id][n:]

    def drop(self, seq_id):
        self.hashes.pop(seq_id, None)


class ToyModel:
    info = ModelInfo("toy", "toy", N_VOCAB, 8, 2, 1 << 16)
    tokenizer = ToyTokenizer()

    def __init__(self):
        self.rows_seen = 0
        self.forward_calls = 0

    def new_context(self, max_tokens):
        return ListContext()

    def forward(self, batch: Batch, ctx, hidden_layers=()):
        self.forward_calls += 1
        self.rows_seen += len(batch)
        logits, hidden = [], []
        for seq_id, pos, tok, want in zip(batch.seq_ids, batch.positions, batch.tokens, batch.want_logits):
            hs = ctx.hashes.setdefault(seq_id, [])
            assert pos == len(hs), f"row at position {pos} but state has {len(hs)}"
            h = _next_hash(hs[-1] if hs else 0, tok)
            hs.append(h)
            hidden.append(torch.full((8,), float(h)))
            if want:
                logits.append(_logits(h))
        out = torch.stack(logits) if logits else torch.empty(0, N_VOCAB)
        return ForwardOutput(out, {l: torch.stack(hidden) for l in hidden_layers})


class RecurrentContext:
    """State that cannot be cut: one hash and a length per sequence."""

    state_kind = "recurrent"

    def __init__(self):
        self.state: dict[int, tuple[int, int]] = {}
        self.saves = self.restores = 0

    def length(self, seq_id):
        return self.state.get(seq_id, (0, 0))[1]

    def truncate(self, seq_id, n):
        if n != self.length(seq_id):
            raise AssertionError("recurrent state cannot be truncated")

    def drop(self, seq_id):
        self.state.pop(seq_id, None)

    def save(self, seq_id):
        self.saves += 1
        return self.state.get(seq_id, (0, 0))

    def restore(self, seq_id, handle):
        self.restores += 1
        self.state[seq_id] = handle


class ToyRecurrentModel(ToyModel):
    def new_context(self, max_tokens):
        return RecurrentContext()

    def forward(self, batch, ctx, hidden_layers=()):
        self.forward_calls += 1
        logits = []
        for seq_id, pos, tok, want in zip(batch.seq_ids, batch.positions, batch.tokens, batch.want_logits):
            h, n = ctx.state.get(seq_id, (0, 0))
            assert pos == n
            h = _next_hash(h, tok)
            ctx.state[seq_id] = (h, n + 1)
            if want:
                logits.append(_logits(h))
        return ForwardOutput(torch.stack(logits) if logits else torch.empty(0, N_VOCAB), {})


class ToyHybridModel(ToyModel):
    """One recurrent layer (the rolling hash, a float64 state in a HybridCache that keeps the
    state after each row) and one attention-like layer (each token stored as a KV row, summed):
    the logits depend on both, so a wrong cut of either side changes the output."""

    def new_context(self, max_tokens):
        from speculant import HybridCache, KVCache

        return HybridCache(KVCache(1, 1, 1, max_tokens, dtype=torch.float64), {0: ((1,),)}, dtype=torch.float64)

    def forward(self, batch, ctx, hidden_layers=()):
        self.forward_calls += 1
        self.rows_seen += len(batch)
        logits, hidden = [], []
        for seq_id, a, b in batch.groups():
            start = batch.positions[a]
            assert start == ctx.length(seq_id) == ctx.kv.length(seq_id)
            ctx.reserve(seq_id, batch.positions[b - 1] + 1)
            h = int(ctx.read(seq_id, 0)[0].item())
            toks = torch.tensor(batch.tokens[a:b], dtype=torch.float64)
            _, vc = ctx.kv.write(0, seq_id, start, toks.view(1, -1, 1), toks.view(1, -1, 1))
            sums = vc[0, :, 0].cumsum(0)[start:]
            states = []
            for i in range(a, b):
                h = _next_hash(h, batch.tokens[i])
                states.append(h)
                hidden.append(torch.full((8,), float(h)))
                if batch.want_logits[i]:
                    logits.append(_logits(_next_hash(h, int(sums[i - a].item()) % MOD)))
            rows = torch.tensor(states, dtype=torch.float64).view(-1, 1)
            ctx.write(seq_id, 0, [rows[-1].clone()], [rows] if ctx.wants_rows(seq_id) else None)
            ctx.commit(seq_id, start, batch.positions[b - 1] + 1)
        out = torch.stack(logits) if logits else torch.empty(0, N_VOCAB)
        return ForwardOutput(out, {l: torch.stack(hidden) for l in hidden_layers})
