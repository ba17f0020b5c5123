"""Drive a speculator through its hooks as the engine does, against a scripted target.

The contract's unit tests need no model: each sequence has a *script*, the text the target
"would generate". A draft is accepted up to its first token that differs from the script, the
target then adds the script's next token, exactly the bookkeeping of ``Engine.step`` (propose,
checkpoint save, verify, restore or discard, accept). Every draft is logged, so two runs can be
compared draft by draft.

Scripts are built from a small pool of segments repeated in random order, so every speculator
that looks for repetition finds some: at every n-gram length up to the segment length the text
repeats, yet the continuation after a segment varies.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

import attrs
import torch

from speculant.chain import SpeculatorChain
from speculant.types import Draft, DraftLimits, DraftRequest, SequenceView


def segment_pool(rng: random.Random, alphabet: Sequence[int], n: int = 5, lengths: tuple[int, int] = (4, 12)) -> list[list[int]]:
    return [[rng.choice(alphabet) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def script(rng: random.Random, pool: list[list[int]], length: int, alphabet: Sequence[int], noise: float = 0.1) -> list[int]:
    """`length` tokens: segments of `pool` in random order, with a random token now and then."""
    out: list[int] = []
    while len(out) < length:
        if rng.random() < noise:
            out.append(rng.choice(alphabet))
        else:
            out.extend(rng.choice(pool))
    return out[:length]


@attrs.define
class Step:
    """One logged proposal: the sequence, the history length it was made for, what came back
    (as returned, before any trimming) and how much of it the scripted target accepted."""

    seq_id: int
    at: int
    draft: Draft | None
    n_accepted: int

    def key(self) -> tuple:
        """What must be equal between two runs that must behave alike."""
        if self.draft is None:
            return self.seq_id, self.at, None
        probs = None if self.draft.probs is None else self.draft.probs.float().cpu()
        return self.seq_id, self.at, tuple(self.draft.tokens), probs


def same_steps(a: list[Step], b: list[Step]) -> str | None:
    """None if the two logs agree draft for draft, else a description of the first difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        kx, ky = x.key(), y.key()
        px, py = (kx[3], ky[3]) if len(kx) > 3 and len(ky) > 3 else (None, None)
        if kx[:3] != ky[:3] or (px is None) != (py is None) or (px is not None and not torch.allclose(px, py, atol=1e-6)):
            return (f"proposal {i} (sequence {x.seq_id}, history length {x.at}) differs: "
                    f"{None if x.draft is None else x.draft.tokens} vs {None if y.draft is None else y.draft.tokens}")
    if len(a) != len(b):
        return f"{len(a)} proposals vs {len(b)}"
    return None


class Driver:
    """Calls one speculator's hooks through pluggy (so its hookimpls are validated and dispatched
    exactly as in a chain), with the engine's order of calls and arguments."""

    def __init__(self, speculator: Any, n_vocab: int, n_embd: int = 16):
        self.spec = speculator
        self.hook = SpeculatorChain([speculator]).hook  # raw hooks: no trimming, no empty-draft mapping
        self.batched = bool(self.hook.propose_batch.get_hookimpls())  # the chain prefers propose_batch
        self.layers = tuple(getattr(speculator, "hidden_layers", ()))
        self.n_vocab = n_vocab
        # Speculators that read the target's hidden states get a fixed function of the tokens.
        self.embed = torch.randn(n_vocab, n_embd, generator=torch.Generator().manual_seed(0)) if self.layers else None
        self.tokens: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}  # tokens the target has computed (its state), as the engine's n_cached
        self.n_prompt: dict[int, int] = {}
        self.scripts: dict[int, list[int]] = {}
        self.log: list[Step] = []

    def view(self, seq_id: int) -> SequenceView:
        return SequenceView(seq_id, tuple(self.tokens[seq_id]), self.n_prompt[seq_id])

    def begin(self, seq_id: int, text: list[int], n_prompt: int) -> None:
        """Start `seq_id` with text[:n_prompt] as its prompt; the target will continue with text."""
        self.tokens[seq_id], self.n_prompt[seq_id], self.scripts[seq_id] = list(text[:n_prompt]), n_prompt, list(text)
        self.fed[seq_id] = 0
        self.hook.begin(seq=self.view(seq_id))

    def rescript(self, seq_id: int, text: list[int]) -> None:
        """From now on the target continues with `text` (which must extend the history)."""
        assert text[: len(self.tokens[seq_id])] == self.tokens[seq_id]
        self.scripts[seq_id] = list(text)

    def step(self, seq_id: int, n_max: int = 4, checkpoint: bool = False, meddle: bool = False) -> Step:
        return self.step_many([seq_id], n_max, checkpoint, meddle)[0]

    def step_many(self, seq_ids: list[int], n_max: int = 4, checkpoint: bool = False, meddle: bool = False) -> list[Step]:
        """One engine step for several sequences: proposals for all of them (one propose_batch
        call if the speculator has it, as the chain does), then per sequence verification and
        accept. `checkpoint`: the engine's recurrent-target path (save before the verification,
        then restore or discard); `meddle`: between save and restore, also feed the speculator
        a made-up continuation, which the restore must undo."""
        limits = DraftLimits(n_max=n_max)
        views = [self.view(i) for i in seq_ids]
        if self.batched:
            raws = self.hook.propose_batch(requests=[DraftRequest(v, limits) for v in views])
            raws = [None] * len(views) if raws is None else list(raws)
            assert len(raws) == len(views), f"propose_batch returned {len(raws)} drafts for {len(views)} requests"
        else:
            raws = [self.hook.propose(seq=v, limits=limits) for v in views]
        drafts = []
        for raw in raws:
            draft = raw if raw is not None and len(raw) > 0 else None
            if draft is not None and len(draft) > n_max:  # the chain trims an over-long draft
                draft = Draft(draft.tokens[:n_max], draft.spec_type, None if draft.probs is None else draft.probs[:n_max])
            drafts.append(draft)
        for view, draft in zip(views, drafts):
            if checkpoint and draft is not None:
                self.hook.checkpoint(seq=view, action="save")
                if meddle:
                    junk = SequenceView(view.seq_id, view.tokens + tuple(reversed(view.tokens[-5:])), view.n_prompt)
                    self.hook.accept(seq=junk, draft=None, n_accepted=0, hidden=self._hidden(junk.tokens[-6:]),
                                     hidden_start=len(junk.tokens) - 6)
                    if self.batched:
                        self.hook.propose_batch(requests=[DraftRequest(junk, limits)])
                    else:
                        self.hook.propose(seq=junk, limits=limits)
        steps = []
        for seq_id, raw, draft in zip(seq_ids, raws, drafts):
            toks, text = self.tokens[seq_id], self.scripts[seq_id]
            at = len(toks)
            n_acc = 0
            if draft is not None:
                while n_acc < len(draft) and at + n_acc < len(text) and draft.tokens[n_acc] == text[at + n_acc]:
                    n_acc += 1
            # The step's rows, as the engine feeds them: the tokens the target has not computed
            # (on the first step, the prompt), then the draft.
            start = self.fed[seq_id]
            rows = [*toks[start:], *(draft.tokens if draft is not None else ())]
            toks.extend(text[at : at + n_acc + 1])
            restored = checkpoint and draft is not None and n_acc < len(draft)
            if checkpoint and draft is not None:
                self.hook.checkpoint(seq=self.view(seq_id), action="restore" if restored else "discard")
            if not restored:  # a restored state computes the kept tokens again next step
                self.fed[seq_id] = len(toks) - 1
            self.hook.accept(seq=self.view(seq_id), draft=draft, n_accepted=n_acc, hidden=self._hidden(rows),
                             hidden_start=start)
            steps.append(Step(seq_id, at, raw, n_acc))
        self.log.extend(steps)
        return steps

    def run_all(self, **kwargs) -> None:
        """Steps all sequences together until each has reached the end of its script."""
        while True:
            ids = [i for i in self.tokens if len(self.tokens[i]) < len(self.scripts[i])]
            if not ids:
                return
            self.step_many(ids, **kwargs)

    def run(self, seq_id: int, until: int, **kwargs) -> None:
        """Steps until the history has at least `until` tokens (or the script ends)."""
        while len(self.tokens[seq_id]) < min(until, len(self.scripts[seq_id])):
            self.step(seq_id, **kwargs)

    def truncate(self, seq_id: int, n: int) -> None:
        del self.tokens[seq_id][n:]
        self.fed[seq_id] = min(self.fed[seq_id], n)
        self.hook.truncate(seq=self.view(seq_id), n=n)

    def resume(self, seq_id: int, text: list[int], n_prompt: int, n: int) -> None:
        """A new request continues the sequence (the prompt cache): its prompt text[:n_prompt]
        shares the first n tokens with the history; the target then continues with text."""
        assert text[:n] == self.tokens[seq_id][:n]
        self.tokens[seq_id], self.n_prompt[seq_id], self.scripts[seq_id] = list(text[:n_prompt]), n_prompt, list(text)
        self.fed[seq_id] = min(self.fed[seq_id], n)
        self.hook.truncate(seq=self.view(seq_id), n=n)

    def end(self, seq_id: int) -> None:
        self.hook.end(seq_id=seq_id)
        for d in (self.tokens, self.fed, self.n_prompt, self.scripts):
            d.pop(seq_id, None)

    def drafts(self, seq_id: int | None = None, since: int = 0) -> list[Step]:
        return [s for s in self.log[since:] if s.draft is not None and (seq_id is None or s.seq_id == seq_id)]

    def _hidden(self, rows) -> dict[int, torch.Tensor]:
        if not self.layers:
            return {}
        h = self.embed[torch.tensor([t % self.n_vocab for t in rows])]
        return {layer: h for layer in self.layers}
