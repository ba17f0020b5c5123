"""The active chain of speculators (``--spec-type a,b,c``) behind the lifecycle hooks.

Each chain has its own pluggy manager holding only its speculators, so a hook call reaches
exactly them. pluggy calls the last registered first, so they are registered in reverse user
order; `propose` is firstresult, so the first speculator that returns a draft (not None) wins;
an empty draft counts as no draft for the step.
"""
from __future__ import annotations

import time
from typing import Any

import pluggy

from speculant import hookspecs
from speculant.types import Draft, DraftLimits, SequenceView


class SpeculatorChain:
    def __init__(self, speculators: list[Any]):
        self.speculators = list(speculators)
        self.pm = pluggy.PluginManager("speculant")
        self.pm.add_hookspecs(hookspecs.SpeculatorSpec)
        for i, spec in reversed(list(enumerate(self.speculators))):
            self.pm.register(spec, name=f"{i}:{getattr(spec, 'spec_type', type(spec).__name__)}")
        self.pm.check_pending()
        self.hook = self.pm.hook
        # Hidden states any speculator asked for (MTP, EAGLE3, DFlash), requested from the target.
        self.hidden_layers = tuple(sorted({l for s in self.speculators for l in getattr(s, "hidden_layers", ())}))
        self.hook_seconds = 0.0  # time spent inside hook dispatch and speculators, for the overhead check
        self._subsets: dict[frozenset, Any] = {}  # propose callers over part of the chain, by spec types kept

    def __bool__(self) -> bool:
        return bool(self.speculators)

    def _call(self, name: str, caller=None, **kwargs):
        t = time.perf_counter()
        try:
            return (caller or getattr(self.hook, name))(**kwargs)
        finally:
            self.hook_seconds += time.perf_counter() - t

    def _propose_caller(self, only: tuple[str, ...]):
        """`propose` over the chain's speculators whose spec type is in `only` (still in chain order)."""
        key = frozenset(only)
        caller = self._subsets.get(key)
        if caller is None:
            drop = [s for s in self.speculators if getattr(s, "spec_type", None) not in key]
            caller = self._subsets[key] = self.pm.subset_hook_caller("propose", drop)
        return caller

    def begin(self, seq: SequenceView) -> None:
        self._call("begin", seq=seq)

    def propose(self, seq: SequenceView, limits: DraftLimits, only: tuple[str, ...] | None = None) -> Draft | None:
        """The first draft of the chain (of its spec types in `only`, when given)."""
        if limits.n_max <= 0:
            return None
        caller = None if only is None else self._propose_caller(only)
        draft = self._call("propose", caller, seq=seq, limits=limits)
        if draft is None or len(draft) == 0:
            return None
        if len(draft) > limits.n_max:  # a speculator may not exceed the limit; trim rather than overrun the context
            draft = Draft(draft.tokens[: limits.n_max], draft.spec_type,
                          None if draft.probs is None else draft.probs[: limits.n_max])
        return draft

    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict) -> None:
        self._call("accept", seq=seq, draft=draft, n_accepted=n_accepted, hidden=hidden)

    def truncate(self, seq: SequenceView, n: int) -> None:
        self._call("truncate", seq=seq, n=n)

    def checkpoint(self, seq: SequenceView, action: str) -> None:
        self._call("checkpoint", seq=seq, action=action)

    def end(self, seq_id: int) -> None:
        self._call("end", seq_id=seq_id)
