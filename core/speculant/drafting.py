"""Bookkeeping for speculators that draft from the target's hidden states (EAGLE3, MTP, DFlash
and third-party heads): what they keep per sequence between hook calls, and how a chain of
draft tokens is picked from a head's logits. The head's math stays in its plugin.

Such a speculator keeps one vector per position of each sequence (the target's hidden state, or
its own encoding of it: :class:`PositionStates`), handed over by the engine's ``prefill`` and
``accept`` hooks (:func:`committed_rows` says how many of an ``accept``'s rows belong to the
history that happened), and writes rows of its own KV cache from them lazily, at the next
proposal. ``written`` tracks how far those KV rows are still right, given the rule the head
builds row q by: from the state of position q + ``state_offset`` and, for heads that also read a
token, the token at q + ``token_offset``.

A head trained on windows of W positions (``speculant train``'s ``--window``, recorded in the
file: :func:`trained_window`) attends over its last W rows only; its rows further back are then
never read, and a long prompt's catch-up writes its last W rows alone (:func:`skip_unread_rows`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

import attrs
import torch

from speculant.types import Draft, DraftLimits, SequenceView, SpeculatorState

__all__ = ["DraftChain", "PositionStates", "committed_rows", "draft_generator", "export_positions", "file_key",
           "held_bytes", "import_positions", "pick_token", "skip_unread_rows", "store_encoded_taps", "trained_window"]

TRAINING_KEY = "speculant.training"  # what `speculant train` records about a head's training (JSON)


@attrs.define
class PositionStates:
    """The states of positions [0, n) of one sequence, float16, and the head's KV rows [0,
    written) still valid. `state_offset`, `token_offset`: head row q reads the state of position
    q + state_offset and (None: no token) the token at q + token_offset. EAGLE3 pairs (t_{q+1},
    g_q): 0 and 1; MTP pairs (x_q, h_{q-1}): -1 and 0; DFlash's context rows read g_q alone: 0
    and None."""

    width: int
    state_offset: int = 0
    token_offset: int | None = None
    data: torch.Tensor = attrs.field(default=None)
    n: int = 0
    written: int = 0
    # Head rows below this were skipped, never computed (skip_unread_rows): a windowed head whose
    # history is cut back far enough to read them computes them first.
    computed_from: int = 0

    def __attrs_post_init__(self):
        if self.data is None:
            self.data = torch.zeros(256, self.width, dtype=torch.float16)

    def put(self, start: int, rows: torch.Tensor) -> bool:
        """Store the states of positions start.. (later ones are forgotten); False, and nothing
        stored, where that would leave a gap."""
        if start > self.n:
            return False
        end = start + len(rows)
        if end > len(self.data):
            grown = self.data.new_zeros(max(end, 2 * len(self.data)), self.width)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[start:end] = rows.to(self.data.dtype)
        self.n = end
        # Rows built from a replaced state were built for a history that did not happen.
        self.written = min(self.written, max(0, start - self.state_offset))
        return True

    def cut(self, n: int) -> None:
        """The history is cut back to n tokens: states of positions >= n are gone, and so are
        rows that read them or a token at n or later."""
        self.n = min(self.n, n)
        limit = n - self.state_offset if self.token_offset is None else min(n - self.state_offset, n - self.token_offset)
        self.written = min(self.written, max(0, limit))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The states head rows [start, end) read, float32; a position before 0 reads zeros (MTP's
        first row, as llama.cpp's first batch)."""
        lo, hi = start + self.state_offset, end + self.state_offset
        out = self.data[max(0, lo) : hi].float()
        if lo < 0:
            out = torch.cat([out.new_zeros(min(-lo, hi - lo), self.width), out])
        return out


def held_bytes(context, state: PositionStates | None, seq_id: int) -> int:
    """What a head holds for one sequence (its ``state_nbytes``): its KV rows in `context` and
    its position states."""
    nbytes = getattr(context, "nbytes", None)
    return (0 if nbytes is None else nbytes(seq_id)) + (0 if state is None else state.nbytes)


def committed_rows(seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict, hidden_start: int) -> int:
    """How many of the rows an ``accept`` hook hands over (starting at position `hidden_start`)
    belong to the history: the rows fed before the draft, plus those of accepted draft tokens.
    Rows of rejected draft tokens computed states for a history that did not happen."""
    rows = len(next(iter(hidden.values()))) if hidden else 0
    n_pending = rows - (len(draft) if draft is not None else 0)
    return max(0, min(n_pending + n_accepted, len(seq.tokens) - hidden_start))


# Rows of tap states encoded at once. A 935-token prompt's three taps of the 1.5B concatenated
# whole were 17 MB of floats on top of the states the target hands over (as much again where
# a head norms them first): after its weights, the largest part of an EAGLE3 head's memory over plain.
ENCODE_ROWS = 128


def store_encoded_taps(state: PositionStates, start: int, hidden: dict, taps: tuple[int, ...], n_valid: int, encode) -> None:
    """state.put(start, encode(the tap layers' states side by side)) for the first `n_valid`
    rows of `hidden`, ENCODE_ROWS rows at a time (the linear layers give a row the same bits
    in a call of any size); nothing where a tap is missing or the rows would leave a gap (the
    drafter waits for states it can use)."""
    if n_valid <= 0 or start > state.n or any(layer not in hidden for layer in taps):
        return
    for lo in range(0, n_valid, ENCODE_ROWS):
        hi = min(n_valid, lo + ENCODE_ROWS)
        if not state.put(start + lo, encode(torch.cat([hidden[layer][lo:hi] for layer in taps], dim=-1))):
            return


def export_positions(state: PositionStates | None, n: int, key: str) -> SpeculatorState | None:
    """A copy of the states of positions [0, n) (an ``export_state`` hook's answer), None where
    fewer are held. The head's KV rows are not taken: the next proposal writes them again from
    the states, as after a cold prefill."""
    if state is None or state.n < n or n <= 0:
        return None
    return SpeculatorState(key, {"states": state.data[:n].clone()})


def import_positions(state: PositionStates, saved: SpeculatorState, n: int, key: str) -> bool:
    """Put the first n positions of an exported state into a sequence's fresh `state` (an
    ``import_state`` hook); False, taking nothing, where the key or the shape does not fit."""
    rows = saved.tensors.get("states")
    if (saved.key != key or not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != state.width
            or len(rows) < n or not rows.dtype.is_floating_point):
        return False
    state.cut(0)
    return n <= 0 or state.put(0, rows[:n])


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:32]


def file_key(kind: str, path: str) -> str:
    """A state key for states a head's weights made (its encoding of the target's hidden
    states): the kind and the digest of the head's file (read once per file, ~0.1 s for 50 MB)."""
    st = os.stat(path)
    return f"{kind}:{_digest(os.path.realpath(path), st.st_size, st.st_mtime_ns)}"


def trained_window(metadata: dict) -> int:
    """The most positions a head attended over in training (the `window` `speculant train`
    records under TRAINING_KEY), or 0 where the file does not say (a head from elsewhere:
    attend over the whole context, as llama.cpp does)."""
    raw = metadata.get(TRAINING_KEY)
    try:
        window = int(json.loads(raw).get("window", 0)) if raw else 0
    except (TypeError, ValueError, AttributeError):
        return 0
    return max(0, window)


def skip_unread_rows(context, seq_id: int, first_read: int, state: PositionStates) -> int:
    """Where a head's catch-up starts for a sequence whose first row to compute reads keys from
    position `first_read` on (a windowed head's: the row at p reads p - window + 1 .. p): rows
    below it are never read, so the cache is moved up to it without computing them (they hold
    zeros or stale rows, outside every later row's window; `state.computed_from` remembers where
    the computed rows start). Rows this window reads that an earlier skip left uncomputed (the
    history was cut back since) are computed again. Returns the cache's length."""
    first_read = max(0, first_read)
    start = context.length(seq_id)
    if state.computed_from > first_read and start > first_read:
        context.truncate(seq_id, first_read)
        start = first_read
    if first_read > start:
        context.reserve(seq_id, first_read)
        context.commit(seq_id, first_read)
        start = first_read
    if start == first_read:
        state.computed_from = first_read
    return start


def draft_generator(seed: int, seq: SequenceView) -> torch.Generator | None:
    """The random stream a draft at temperature > 0 samples from, fixed by the sequence's state
    (the same history drafts the same tokens); None at temperature 0."""
    if float(getattr(seq, "temperature", 0.0) or 0.0) <= 0:
        return None
    return torch.Generator().manual_seed(hash((seed, seq.seq_id, len(seq.tokens), seq.tokens[-1])) & (2**63 - 1))


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, columns: torch.Tensor | None,
               n_vocab: int) -> tuple[int, float, torch.Tensor | None]:
    """The next draft token from one row of a head's logits: (target token id, its probability
    under the head, and at temperature > 0 the head's distribution over the target's vocabulary
    that it was sampled from, for the engine's rejection sampling). `columns`: the target id of
    each logit column (a draft vocabulary), or None where column i is token i."""
    logits = logits.float() if columns is not None else logits[:n_vocab].float()
    token = (lambda c: int(columns[c])) if columns is not None else int
    if temperature <= 0:
        top = int(torch.argmax(logits))
        return token(top), float(torch.exp(logits[top] - torch.logsumexp(logits, -1))), None
    q = torch.softmax(logits / temperature, -1)
    pick = int(torch.multinomial(q, 1, generator=generator))
    full = torch.zeros(n_vocab)
    if columns is None:
        full[: len(q)] = q
    else:
        full[columns] = q  # tokens outside the draft vocabulary are never drafted
    return token(pick), float(q[pick]), full


@attrs.define
class DraftChain:
    """One sequence's draft being built a token at a time (EAGLE3's and MTP's draft steps):
    `add` takes each pick and says whether to go on; `draft` is the result."""

    index: int  # the request's place in propose_batch's list
    seq_id: int
    limits: DraftLimits
    temperature: float
    generator: torch.Generator | None
    tokens: list[int] = attrs.field(factory=list)
    probs: list[torch.Tensor] = attrs.field(factory=list)
    confidence: list[float] = attrs.field(factory=list)

    def add(self, token: int, p: float, probs: torch.Tensor | None) -> bool:
        """Append a pick; False when the chain ends (below p_min, the pick is dropped; at n_max)."""
        if p < self.limits.p_min:
            return False
        self.tokens.append(token)
        self.confidence.append(p)
        if probs is not None:
            self.probs.append(probs)
        return len(self.tokens) < self.limits.n_max

    def draft(self, spec_type: str) -> Draft | None:
        if not self.tokens or len(self.tokens) < self.limits.n_min:
            return None
        probs = torch.stack(self.probs) if self.probs and len(self.probs) == len(self.tokens) else None
        return Draft(tuple(self.tokens), spec_type, probs, tuple(self.confidence))
