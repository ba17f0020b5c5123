"""The active chain of speculators (``--spec-type a,b,c``) behind the lifecycle hooks.

Each chain has its own pluggy manager holding only its speculators, so a hook call reaches
exactly them. pluggy calls the last registered first, so they are registered in reverse user
order.

Proposals are made for all active sequences at once (`propose_batch`): the speculators are
asked in chain order, each for the sequences still without a draft. A speculator implementing
the ``propose_batch`` hook gets all of them in one call (a draft model batches its forwards
across sequences); one with only ``propose`` is asked per sequence. Per sequence this is
``propose``'s firstresult rule: the first speculator that returns a draft (not None) wins, and
an empty draft counts as no draft for the step (it still ends the search for that sequence).
"""
from __future__ import annotations

import operator
import time
from typing import Any, Callable, Sequence

import attrs
import pluggy
import torch

from speculant import hookspecs
from speculant.logs import get_logger
from speculant.types import Draft, DraftLimits, DraftRequest, SequenceView

log = get_logger(__name__)


@attrs.define
class Proposal:
    """The chain's answer for one request: the draft (None: no draft), the exception a speculator
    raised for this sequence (the search stopped there), and per speculator asked, (spec type,
    seconds, tokens it produced). A batched call's time is shared evenly by its sequences."""

    draft: Draft | None = None
    error: BaseException | None = None
    costs: list[tuple[str, float, int]] = attrs.field(factory=list)


# plan(request, spec_type) -> the limits to ask that speculator with; n_max <= 0 skips it for the request.
Plan = Callable[[DraftRequest, str], DraftLimits]


class SpeculatorFault(Exception):
    """A speculator raised a BaseException that is not an Exception (SystemExit, GeneratorExit, a
    subclass of its own). Carried as an Exception so that every handler of speculator failures
    treats it alike: only its sequences lose speculation, the engine thread goes on.
    KeyboardInterrupt is not converted: it is the user's, not the speculator's."""


class SpeculatorTimeout(Exception):
    """A speculator's propose call took longer than the chain's per-call deadline: its answer is
    dropped and the sequences of the call lose speculation, so that a slow plugin slows the engine
    once, not at every step. (A call cannot be pre-empted: one that never returns still holds the
    engine thread; see SpeculatorChain.deadline.)"""


def _fault(e: BaseException) -> Exception:
    """The exception to handle for what a speculator raised (see SpeculatorFault)."""
    if isinstance(e, Exception):
        return e
    if isinstance(e, KeyboardInterrupt):
        raise e
    return SpeculatorFault(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _checked(name: str, draft: Any) -> Draft | None:
    """A speculator's answer as a Draft of plain int tokens, or TypeError naming the speculator:
    anything else would fail later, in the step every sequence of the batch shares."""
    if draft is None:
        return None
    if not isinstance(draft, Draft):
        raise TypeError(f"{name}: a draft must be a speculant.Draft, got {type(draft).__name__}")
    try:
        if isinstance(draft.tokens, (str, bytes)):
            raise TypeError
        tokens = tuple(draft.tokens)
        if any(isinstance(t, bool) for t in tokens):
            raise TypeError
        tokens = tuple(operator.index(t) for t in tokens)  # numpy and torch integers are fine
    except TypeError:
        raise TypeError(f"{name}: the draft's tokens must be a sequence of ints, got {draft.tokens!r:.80}") from None
    probs = draft.probs
    if probs is not None and not (isinstance(probs, torch.Tensor) and probs.dim() == 2 and probs.shape[0] >= len(tokens)):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise TypeError(f"{name}: the draft's probs must be a tensor [{len(tokens)}, n_vocab], got {shape}")
    if type(draft.tokens) is tuple and all(type(t) is int for t in draft.tokens):  # the usual case: as it is
        return draft
    return Draft(tokens, draft.spec_type, probs)


def _trim(draft: Draft, n_max: int) -> Draft:
    """A speculator may not exceed the limit; trim rather than overrun the context."""
    if len(draft) <= n_max:
        return draft
    return Draft(draft.tokens[:n_max], draft.spec_type, None if draft.probs is None else draft.probs[:n_max])


class SpeculatorChain:
    """``deadline``: seconds a propose (or propose_batch) call may take (None: no limit). A call
    over it is measured, not interrupted: its draft is dropped and SpeculatorTimeout is the error
    of each of its sequences. A speculator's first call for a sequence after `begin` or `truncate`
    is not held to it: it may catch up on the prompt there (a draft model feeds it lazily)."""

    def __init__(self, speculators: list[Any], deadline: float | None = None):
        self.speculators = list(speculators)
        self.deadline = deadline
        self._asked: dict[int, set[str]] = {}  # seq_id -> speculators asked since its begin or truncate
        self.pm = pluggy.PluginManager("speculant")
        self.pm.add_hookspecs(hookspecs.SpeculatorSpec)
        for i, spec in reversed(list(enumerate(self.speculators))):
            self.pm.register(spec, name=f"{i}:{getattr(spec, 'spec_type', type(spec).__name__)}")
        self.pm.check_pending()
        self.hook = self.pm.hook
        # Hidden states any speculator asked for (MTP, EAGLE3, DFlash), requested from the target.
        self.hidden_layers = tuple(sorted({l for s in self.speculators for l in getattr(s, "hidden_layers", ())}))
        self.hook_seconds = 0.0  # time spent inside hook dispatch and speculators, for the overhead check
        # Per speculator, in chain order: (spec type, caller of its propose_batch or None, of its propose or None).
        batched = {id(h.plugin) for h in self.hook.propose_batch.get_hookimpls()}
        single = {id(h.plugin) for h in self.hook.propose.get_hookimpls()}
        self._proposers: list[tuple[str, Any, Any]] = []
        for spec in self.speculators:
            others = [s for s in self.speculators if s is not spec]
            name = getattr(spec, "spec_type", type(spec).__name__)
            if id(spec) in batched:
                self._proposers.append((name, self.pm.subset_hook_caller("propose_batch", others), None))
            elif id(spec) in single:
                self._proposers.append((name, None, self.pm.subset_hook_caller("propose", others)))

    def __bool__(self) -> bool:
        return bool(self.speculators)

    def _call(self, name: str, **kwargs):
        t = time.perf_counter()
        try:
            return getattr(self.hook, name)(**kwargs)
        except BaseException as e:
            fault = _fault(e)
            if fault is e:
                raise
            raise fault from e
        finally:
            self.hook_seconds += time.perf_counter() - t

    def begin(self, seq: SequenceView) -> None:
        self._asked.pop(seq.seq_id, None)
        self._call("begin", seq=seq)

    def propose_batch(self, requests: Sequence[DraftRequest], only: Sequence[tuple[str, ...] | None] | None = None,
                      plan: Plan | None = None) -> list[Proposal]:
        """A Proposal per request. ``only[i]``: the spec types that may draft for request i (None:
        all). ``plan``, if given, picks the limits each speculator is asked with, per request
        (the engine's cost model: a costly draft model is not run when its draft would not pay)."""
        t_start = time.perf_counter()
        out = [Proposal() for _ in requests]
        pending = [i for i, r in enumerate(requests) if r.limits.n_max > 0]
        for name, batch_caller, caller in self._proposers:
            if not pending:
                break
            asked: list[tuple[int, DraftLimits]] = []
            for i in pending:
                if only is not None and only[i] is not None and name not in only[i]:
                    continue
                limits = requests[i].limits if plan is None else plan(requests[i], name)
                if limits.n_max > 0:
                    asked.append((i, limits))
            if not asked:
                continue
            answered: set[int] = set()
            if batch_caller is not None:
                t = time.perf_counter()
                try:
                    drafts = batch_caller(requests=[DraftRequest(requests[i].seq, lim) for i, lim in asked])
                    if drafts is not None and not isinstance(drafts, list):
                        raise TypeError(f"{name}: propose_batch returned {type(drafts).__name__}, not a list of drafts")
                    if drafts is not None and len(drafts) != len(asked):
                        raise ValueError(f"{name}: propose_batch returned {len(drafts)} drafts for {len(asked)} requests")
                    if drafts is not None:
                        drafts = [_checked(name, d) for d in drafts]
                    error = None
                except BaseException as e:  # every sequence of the call loses speculation; the others go on
                    drafts, error = None, _fault(e)
                seconds = time.perf_counter() - t
                seq_ids = [requests[i].seq.seq_id for i, _ in asked]
                if error is None and self._timed(name, seq_ids):
                    error = self.late(f"{name}: propose_batch", seconds, seq_ids)
                    drafts = None if error is not None else drafts
                share = seconds / len(asked)
                for j, (i, lim) in enumerate(asked):
                    d = None if drafts is None else drafts[j]
                    answered.update(self._record(out[i], name, share, d, lim, error, i))
            else:
                for i, lim in asked:
                    t = time.perf_counter()
                    try:
                        d, error = _checked(name, caller(seq=requests[i].seq, limits=lim)), None
                    except BaseException as e:
                        d, error = None, _fault(e)
                    seconds = time.perf_counter() - t
                    if error is None and self._timed(name, [requests[i].seq.seq_id]):
                        error = self.late(f"{name}: propose", seconds, [requests[i].seq.seq_id])
                        d = None if error is not None else d
                    answered.update(self._record(out[i], name, seconds, d, lim, error, i))
            if answered:
                pending = [i for i in pending if i not in answered]
        self.hook_seconds += time.perf_counter() - t_start
        return out

    def _timed(self, name: str, seq_ids: list[int]) -> bool:
        """Whether a call of `name` for these sequences is held to the deadline: not when it is
        its first for one of them since that sequence's begin or truncate. Notes the call."""
        timed = True
        for seq_id in seq_ids:
            asked = self._asked.setdefault(seq_id, set())
            timed = timed and name in asked
            asked.add(name)
        return timed

    def late(self, what: str, seconds: float, seq_ids: list[int]) -> SpeculatorTimeout | None:
        """SpeculatorTimeout when a call (`what`: "SPEC_TYPE: propose", ...) that took `seconds`
        ran past the deadline, logged; None when it did not."""
        if self.deadline is None or seconds <= self.deadline:
            return None
        log.warning("speculator call past its deadline; its sequences go on without speculation", call=what,
                    seconds=round(seconds, 3), deadline=self.deadline, seq_ids=seq_ids)
        return SpeculatorTimeout(f"{what} took {seconds:.2f} s, more than the {self.deadline:g} s deadline")

    @staticmethod
    def _record(p: Proposal, name: str, seconds: float, draft: Draft | None, limits: DraftLimits,
                error: BaseException | None, i: int) -> tuple[int, ...]:
        """Note one speculator's answer for a request; returns (i,) when the search for it ends."""
        p.costs.append((name, seconds, 0 if draft is None else len(draft)))
        if error is not None:
            p.error = error
            return (i,)
        if draft is None:
            return ()
        if len(draft):
            p.draft = _trim(draft, limits.n_max)
        return (i,)

    def propose(self, seq: SequenceView, limits: DraftLimits, only: tuple[str, ...] | None = None) -> Draft | None:
        """The first draft of the chain for one sequence (of its spec types in `only`, when given)."""
        p = self.propose_batch([DraftRequest(seq, limits)], [only])[0]
        if p.error is not None:
            raise p.error
        return p.draft

    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict, hidden_start: int = 0) -> None:
        self._call("accept", seq=seq, draft=draft, n_accepted=n_accepted, hidden=hidden, hidden_start=hidden_start)

    def prefill(self, seq: SequenceView, start: int, hidden: dict) -> None:
        self._call("prefill", seq=seq, start=start, hidden=hidden)

    def truncate(self, seq: SequenceView, n: int) -> None:
        self._asked.pop(seq.seq_id, None)
        self._call("truncate", seq=seq, n=n)

    def checkpoint(self, seq: SequenceView, action: str) -> None:
        self._call("checkpoint", seq=seq, action=action)

    def end(self, seq_id: int) -> None:
        self._asked.pop(seq_id, None)
        self._call("end", seq_id=seq_id)
