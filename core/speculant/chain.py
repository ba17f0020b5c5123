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

With a deadline (the engine's ``spec_deadline``), each speculator's hook calls run on a thread of
its own, one call at a time, and the engine thread waits for each at most the deadline (a longer
grace for the calls where a speculator may catch up on a prompt). A call that does not return in
time is abandoned and its speculator quarantined: not called while its stuck thread may still
change its state. Once that thread has ended and ``revive`` seconds have passed, it is tried
again, its state for every live sequence rebuilt from scratch (``end`` then ``begin``); a third
quarantine is for good. See SpeculatorChain.
"""
from __future__ import annotations

import _thread
import ctypes
import operator
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import attrs
import pluggy
import torch

from speculant import hookspecs
from speculant.logs import get_logger
from speculant.types import Draft, DraftLimits, DraftRequest, SequenceView, SpeculatorState

log = get_logger(__name__)


@attrs.define
class Proposal:
    """The chain's answer for one request: the draft (None: no draft), the exception a speculator
    raised for this sequence (the search stopped there), and per speculator asked, (spec type,
    seconds, tokens it produced). A batched call's time is shared evenly by its sequences."""

    draft: Draft | None = None
    error: BaseException | None = None
    costs: list[tuple[str, float, int]] = attrs.field(factory=list)
    passed: list[Draft] = attrs.field(factory=list)  # drafts the judge passed over, in chain order


# plan(request, spec_type) -> the limits to ask that speculator with; n_max <= 0 skips it for the request.
Plan = Callable[[DraftRequest, str], DraftLimits]
# judge(request, draft, later) -> keep it (True) or pass it over for the speculators named in
# `later` (the chain's next ones that may still draft for the request, never empty).
Judge = Callable[[DraftRequest, Draft, tuple[str, ...]], bool]


class SpeculatorFault(Exception):
    """A speculator raised a BaseException that is not an Exception (SystemExit, GeneratorExit, a
    subclass of its own). Carried as an Exception so that every handler of speculator failures
    treats it alike: only its sequences lose speculation, the engine thread goes on.
    KeyboardInterrupt is not converted: it is the user's, not the speculator's."""


class SpeculatorTimeout(Exception):
    """A speculator's hook call did not return within its deadline (or grace): the call was
    abandoned and the speculator quarantined (SpeculatorChain.quarantined holds one per
    quarantined spec type)."""


class _Abandoned(BaseException):
    """Raised asynchronously in a quarantined speculator's thread, to stop a call stuck in Python
    code (a loop) from holding the GIL against the engine thread. A BaseException, so that the
    speculator's ``except Exception`` does not catch it."""


class _Mailbox:
    """The hand-off between the engine thread and one speculator's thread: the engine puts a job
    (a list of calls) and releases `go`; the thread runs the calls, noting in `progress` which one
    it is in and since when, puts the results and releases `done`. Two bare locks, the cheapest
    wait with a timeout (about 5 us a round trip on an idle core, concurrent.futures twice that);
    one job per speculator and phase of a step, not one per sequence, since on a loaded machine a
    hand-off costs a wake-up of the other thread. Holds nothing of the chain, so that a dropped
    chain's threads can be told to end."""

    __slots__ = ("go", "done", "job", "result", "progress", "abandoned", "thread")

    def __init__(self, name: str):
        self.go, self.done = _thread.allocate_lock(), _thread.allocate_lock()
        self.go.acquire()
        self.done.acquire()
        self.job: list[tuple[Callable[[dict], Any], dict]] | None = None
        self.result: list[tuple[bool, Any, float]] | None = None
        self.progress: tuple[int, float] = (0, 0.0)  # (index of the call running, perf_counter at its start)
        self.abandoned = False
        self.thread = threading.Thread(target=_serve, args=(self,), name=f"speculator {name}", daemon=True)
        self.thread.start()


def _run_calls(box: _Mailbox | None, calls: list[tuple[Callable[[dict], Any], dict]]) -> list[tuple[bool, Any, float]]:
    """Run hook calls in order: per call (returned, its value or what it raised, seconds). A
    KeyboardInterrupt (or _Abandoned) ends the run: the caller raises it."""
    out = []
    for k, (fn, kwargs) in enumerate(calls):
        t = time.perf_counter()
        if box is not None:
            box.progress = (k, t)
        try:
            out.append((True, fn(kwargs), time.perf_counter() - t))
        except BaseException as e:  # handed to the engine thread, which decides (_fault)
            out.append((False, e, time.perf_counter() - t))
            if isinstance(e, (KeyboardInterrupt, _Abandoned)):
                break
    return out


def _serve(box: _Mailbox) -> None:
    """A speculator's thread: its jobs, one at a time, until told to stop or abandoned."""
    try:
        while True:
            box.go.acquire()
            job, box.job = box.job, None
            if job is None or box.abandoned:
                return
            box.result = _run_calls(box, job)
            del job
            if box.abandoned:  # a job that returned after its deadline: its speculator is gone
                box.result = None
                return
            box.done.release()
    except BaseException:  # _Abandoned outside a call; nothing is waiting for this thread
        return


def _stop(boxes: list[_Mailbox]) -> None:
    """End the threads of a chain that is gone (those idle; an abandoned one ends on its own)."""
    for box in boxes:
        box.job = None
        try:
            box.go.release()
        except RuntimeError:  # not waiting (busy)
            pass


def _interrupt(thread: threading.Thread) -> None:
    """Raise _Abandoned in `thread` at its next Python instruction (CPython; elsewhere a no-op). A
    thread blocked in a C call (sleep, a lock, I/O, a native kernel) sees it only when that returns."""
    if not thread.is_alive() or thread.ident is None:  # it returned meanwhile (its ident may be reused)
        return
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
    except (AttributeError, TypeError):
        pass


_HUNG = object()  # what _run returns for an abandoned call
MAX_QUARANTINES = 3  # the third quarantine of a speculator is for good

# Hooks that run where a speculator may catch up on a whole prompt: held to the grace, not the deadline.
_GRACE_HOOKS = frozenset({"begin", "truncate", "prefill", "export_state", "import_state"})
# Hooks whose first call for a sequence since its begin or truncate gets the grace too.
_FIRST_HOOKS = frozenset({"propose", "propose_batch", "accept"})
# Seconds the grace grows by per token of the call's sequences (all of them, for propose_batch):
# catching up costs time in proportion to the prompt. The 0.5B draft model fed a 4000-token prompt
# in 40 s on a loaded 2-core machine (10 ms a token); twice that, for margin.
GRACE_PER_TOKEN = 0.02


def _tokens(kwargs: dict) -> int:
    """The tokens of the sequences of a hook call (what a catch-up would have to feed, at most)."""
    if "seq" in kwargs:
        return len(kwargs["seq"].tokens)
    return sum(len(r.seq.tokens) for r in kwargs.get("requests", ()))


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
    confidence = draft.confidence
    if confidence is not None:
        try:
            confidence = tuple(float(c) for c in confidence)
        except (TypeError, ValueError):
            confidence = ()
        if len(confidence) < len(tokens) or not all(0.0 <= c <= 1.0 for c in confidence):
            raise TypeError(f"{name}: the draft's confidence must be a probability for each of its {len(tokens)} tokens, "
                            f"got {draft.confidence!r:.80}")
    if type(draft.tokens) is tuple and all(type(t) is int for t in draft.tokens) and confidence == draft.confidence:
        return draft  # the usual case: as it is
    return Draft(tokens, draft.spec_type, probs, confidence)


def _trim(draft: Draft, n_max: int) -> Draft:
    """A speculator may not exceed the limit; trim rather than overrun the context."""
    return draft.prefix(n_max)


@attrs.define(eq=False)
class _Slot:
    """One speculator of the chain: its hooks as callers of a kwargs dict, its thread's mailbox
    (None: its calls run inline, on the caller's thread) and whether it is quarantined."""

    index: int
    name: str
    spec: Any
    hooks: dict[str, Callable[[dict], Any]]
    box: _Mailbox | None = None
    quarantined: bool = False
    quarantines: int = 0  # how many times; at MAX_QUARANTINES it is for good
    quarantined_at: float = 0.0
    # Sequences whose state in this speculator is unknown (it was revived): before its next hook
    # call for one of them it gets `end` and `begin`, and starts over from the sequence's view.
    stale: set[int] = attrs.field(factory=set)


def _caller(pm: pluggy.PluginManager, name: str, spec: Any, others: list[Any]) -> Callable[[dict], Any] | None:
    """A speculator's implementation of hook `name` as a function of the hook's kwargs (None when
    it has none): the method itself, with the arguments it takes (pluggy's dispatch, without its
    cost), or through pluggy for the odd wrapper."""
    impls = [h for h in getattr(pm.hook, name).get_hookimpls() if h.plugin is spec]
    if not impls:
        return None
    impl = impls[0]
    if len(impls) > 1 or impl.hookwrapper or getattr(impl, "wrapper", False):
        subset = pm.subset_hook_caller(name, others)
        return lambda kwargs: subset(**kwargs)
    fn, argnames = impl.function, tuple(impl.argnames)
    return lambda kwargs: fn(*[kwargs[a] for a in argnames])


class SpeculatorChain:
    """``deadline``: seconds a speculator's hook call may take (None: no limit, calls run inline
    on the caller's thread). With one, each speculator's calls run on a thread of its own (one
    per speculator: its calls stay sequential, its state is touched by one thread at a time) and
    the caller waits at most the deadline for each. ``grace`` (default max(60 s, 10 x deadline)),
    plus GRACE_PER_TOKEN (20 ms) per token of the call's sequences, replaces the deadline for
    ``begin``, ``truncate`` and ``prefill``, and for a speculator's first ``propose``/
    ``propose_batch`` and first ``accept`` for a sequence since its begin or truncate: there a
    speculator may catch up on the prompt (a draft model feeds it lazily; EAGLE3 takes the
    prompt's hidden states).

    A call that does not return in time is abandoned: the speculator is quarantined (no hook of it
    is called while its thread may still be changing its state), one warning is logged, and its
    sequences go on with the rest of the chain (with plain decoding when none is left). Its
    thread gets _Abandoned raised in it, which stops a call stuck in Python code; one blocked in
    a C call stays blocked. ``revive`` (None: never) seconds after a quarantine, once that thread
    has ended, the speculator is tried again on a new thread (a stall from swapping or a loaded
    host should not cost a long-running server its speculation for good): every live sequence
    is stale for it, and gets ``end`` and ``begin`` from it before its next hook call for that
    sequence. The third quarantine is for good. An exception from a hook is the caller's to
    handle, as without a deadline."""

    def __init__(self, speculators: list[Any], deadline: float | None = None, grace: float | None = None,
                 revive: float | None = None):
        self.speculators = list(speculators)
        self.deadline = deadline
        self.grace = None if deadline is None else (grace if grace is not None else max(60.0, 10 * deadline))
        self.revive = revive
        self.quarantined: dict[str, SpeculatorTimeout] = {}  # spec type -> why
        self.revived = 0  # speculators brought back after a quarantine
        # seq_id -> (speculator index, hook) called for it since its begin or truncate
        self._asked: dict[int, set[tuple[int, str]]] = {}
        self._live: set[int] = set()  # sequences begun (or cut) and not ended: what a revived speculator must rebuild
        self.pm = pluggy.PluginManager("speculant")
        self.pm.add_hookspecs(hookspecs.SpeculatorSpec)
        for i, spec in reversed(list(enumerate(self.speculators))):
            self.pm.register(spec, name=f"{i}:{getattr(spec, 'spec_type', type(spec).__name__)}")
        self.pm.check_pending()
        self.hook = self.pm.hook
        self.hook_seconds = 0.0  # time spent inside hook dispatch and speculators, for the overhead check
        hooks = ("begin", "propose", "propose_batch", "accept", "prefill", "truncate", "checkpoint", "export_state",
                 "import_state", "state_nbytes", "end")
        self._slots: list[_Slot] = []
        for i, spec in enumerate(self.speculators):
            name = getattr(spec, "spec_type", type(spec).__name__)
            others = [s for s in self.speculators if s is not spec]
            callers = {h: c for h in hooks if (c := _caller(self.pm, h, spec, others)) is not None}
            self._slots.append(_Slot(i, name, spec, callers, _Mailbox(f"{i}:{name}") if deadline is not None else None))
        boxes = [s.box for s in self._slots if s.box is not None]
        if boxes:
            weakref.finalize(self, _stop, boxes)
        self._hidden()

    def _hidden(self) -> None:
        # Hidden states the speculators (not quarantined) ask for (MTP, EAGLE3, DFlash), requested from the target.
        self.hidden_layers = tuple(sorted({l for s in self._slots if not s.quarantined
                                           for l in getattr(s.spec, "hidden_layers", ())}))

    def __bool__(self) -> bool:
        return bool(self.speculators)

    def _limit(self, slot: _Slot, hook: str, kwargs: dict, seq_ids: Sequence[int]) -> float:
        """The seconds a call may take: where it may catch up on a prompt the grace, plus
        GRACE_PER_TOKEN per token of its sequences; else the deadline."""
        grace = hook in _GRACE_HOOKS
        if hook in _FIRST_HOOKS:
            for seq_id in seq_ids:
                asked = self._asked.setdefault(seq_id, set())
                if (slot.index, hook) not in asked:
                    asked.add((slot.index, hook))
                    grace = True
        return self.grace + GRACE_PER_TOKEN * _tokens(kwargs) if grace else self.deadline

    def _run(self, slot: _Slot, hook: str, calls: list[tuple[dict, Sequence[int]]]):
        """Calls of one speculator's hook, each (kwargs, the seq_ids it is for), in one hand-off to
        its thread: per call (returned, value or exception, seconds), as _run_calls. _HUNG when a
        call did not return within its limit: the speculator is then quarantined and the job's
        results are dropped."""
        if slot.stale and self._resync(slot, hook, calls) is _HUNG:
            return _HUNG
        fn = slot.hooks[hook]
        box = slot.box
        if box is None:
            return _run_calls(None, [(fn, kwargs) for kwargs, _ in calls])
        limits = [self._limit(slot, hook, kwargs, seq_ids) for kwargs, seq_ids in calls]
        box.job = [(fn, kwargs) for kwargs, _ in calls]
        box.progress = (0, time.perf_counter())
        box.go.release()
        try:
            while True:
                k, started = box.progress
                remaining = started + limits[k] - time.perf_counter()
                if remaining <= 0:
                    self._quarantine(slot, hook, limits[k], calls[k][1])
                    return _HUNG
                if box.done.acquire(True, remaining):
                    break
        except BaseException:  # KeyboardInterrupt while waiting: the job is abandoned
            self._quarantine(slot, hook, limits[box.progress[0]], calls[box.progress[0]][1], log_it=False)
            raise
        out, box.result = box.result, None
        return out

    def _quarantine(self, slot: _Slot, hook: str, seconds: float, seq_ids: Sequence[int], log_it: bool = True) -> None:
        slot.quarantined = True
        slot.quarantines += 1
        slot.quarantined_at = time.monotonic()
        slot.box.abandoned = True
        for_good = self.revive is None or slot.quarantines >= MAX_QUARANTINES
        self.quarantined[slot.name] = SpeculatorTimeout(
            f"{slot.name}: {hook} did not return within {seconds:g} s; the speculator is quarantined"
            + ("" if for_good else f", to be tried again after {self.revive:g} s once that call has returned"))
        self._hidden()
        if log_it:
            log.warning("speculator call did not return in time: abandoned, the speculator is quarantined"
                        + (" for the engine's life" if for_good else "") + "; its sequences go on without it",
                        spec_type=slot.name, call=hook, seconds=round(seconds, 3), seq_ids=list(seq_ids),
                        quarantines=slot.quarantines)
        _interrupt(slot.box.thread)

    def revive_due(self) -> None:
        """Bring back the quarantined speculators whose time is up and whose stuck call has ended:
        a new thread, and every live sequence stale for it (end, then begin, before its next call
        for that sequence). Called by the engine once a step, before the proposals."""
        if self.revive is None or not self.quarantined:
            return
        now = time.monotonic()
        for slot in self._slots:
            if (slot.quarantined and slot.quarantines < MAX_QUARANTINES and now - slot.quarantined_at >= self.revive
                    and slot.box is not None and not slot.box.thread.is_alive()):
                slot.box = _Mailbox(f"{slot.index}:{slot.name}")
                weakref.finalize(self, _stop, [slot.box])
                slot.quarantined = False
                slot.stale = set(self._live)
                self.quarantined.pop(slot.name, None)
                self.revived += 1
                self._hidden()
                log.warning("speculator tried again after its quarantine; its sequences start over with it",
                            spec_type=slot.name, quarantines=slot.quarantines, sequences=len(slot.stale))

    def _resync(self, slot: _Slot, hook: str, calls: list[tuple[dict, Sequence[int]]]):
        """Before `hook` calls of a revived speculator: `end` and `begin` for the stale sequences
        among them (an `end` call needs neither). _HUNG if it is quarantined again on the way."""
        views = []
        for kwargs, _ in calls:
            if "seq_id" in kwargs:
                slot.stale.discard(kwargs["seq_id"])
            for view in ([kwargs["seq"]] if "seq" in kwargs else [r.seq for r in kwargs.get("requests", ())]):
                if view.seq_id in slot.stale:
                    slot.stale.discard(view.seq_id)
                    views.append(view)
        for name, jobs in (("end", [({"seq_id": v.seq_id}, (v.seq_id,)) for v in views]),
                           ("begin", [({"seq": v}, (v.seq_id,)) for v in views])):
            if jobs and name in slot.hooks and self._run(slot, name, jobs) is _HUNG:
                return _HUNG
        return None

    @staticmethod
    def _error(e: BaseException) -> Exception:
        """What a speculator raised, as the exception to handle (KeyboardInterrupt is raised)."""
        fault = _fault(e)
        if fault is not e:
            fault.__cause__ = e
        return fault

    def _call(self, name: str, seq_ids: Sequence[int], **kwargs):
        """Hook `name` on every speculator implementing it (not quarantined), in chain order. The
        first exception stops the call and is raised (as pluggy does); `end` still reaches every
        speculator, then raises the first."""
        t = time.perf_counter()
        first: Exception | None = None
        try:
            for slot in self._slots:
                if slot.quarantined or name not in slot.hooks:
                    continue
                res = self._run(slot, name, [(kwargs, seq_ids)])
                if res is _HUNG or res[0][0]:
                    continue
                fault = self._error(res[0][1])
                if name != "end":
                    raise fault
                first = first or fault
            if first is not None:
                raise first
        finally:
            self.hook_seconds += time.perf_counter() - t

    def begin(self, seq: SequenceView) -> None:
        self._asked.pop(seq.seq_id, None)
        self._live.add(seq.seq_id)
        self._call("begin", (seq.seq_id,), seq=seq)

    def propose_batch(self, requests: Sequence[DraftRequest], only: Sequence[tuple[str, ...] | None] | None = None,
                      plan: Plan | None = None, judge: Judge | None = None) -> list[Proposal]:
        """A Proposal per request. ``only[i]``: the spec types that may draft for request i (None:
        all). ``plan``, if given, picks the limits each speculator is asked with, per request
        (the engine's cost model: a costly draft model is not run when its draft would not pay).
        ``judge``, if given, sees each draft that a later speculator could still replace: one it
        does not keep goes to the Proposal's ``passed`` and the search goes on (the engine's: a
        cheap lookup's one-token guess is worth less than the hidden-state head after it).
        A speculator quarantined on the way is skipped: the next one is asked for its sequences."""
        t_start = time.perf_counter()
        out = [Proposal() for _ in requests]
        pending = [i for i, r in enumerate(requests) if r.limits.n_max > 0]
        for si, slot in enumerate(self._slots):
            if not pending:
                break
            batched = "propose_batch" in slot.hooks
            if slot.quarantined or not (batched or "propose" in slot.hooks):
                continue
            name = slot.name
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
            keep = self._keeper(judge, si, requests, only)
            if batched:
                t = time.perf_counter()
                seq_ids = [requests[i].seq.seq_id for i, _ in asked]
                res = self._run(slot, "propose_batch", [({"requests": [DraftRequest(requests[i].seq, lim) for i, lim in asked]}, seq_ids)])
                if res is _HUNG:  # quarantined: the next speculators are asked for these sequences
                    continue
                try:
                    ok, drafts, _ = res[0]
                    if not ok:
                        raise drafts
                    if drafts is not None and not isinstance(drafts, list):
                        raise TypeError(f"{name}: propose_batch returned {type(drafts).__name__}, not a list of drafts")
                    if drafts is not None and len(drafts) != len(asked):
                        raise ValueError(f"{name}: propose_batch returned {len(drafts)} drafts for {len(asked)} requests")
                    if drafts is not None:
                        drafts = [_checked(name, d) for d in drafts]
                    error = None
                except BaseException as e:  # every sequence of the call loses speculation; the others go on
                    drafts, error = None, self._error(e)
                share = (time.perf_counter() - t) / len(asked)
                for j, (i, lim) in enumerate(asked):
                    d = None if drafts is None else drafts[j]
                    answered.update(self._record(out[i], name, share, d, lim, error, i, keep))
            else:  # one call per sequence, all in one hand-off
                res = self._run(slot, "propose", [({"seq": requests[i].seq, "limits": lim}, (requests[i].seq.seq_id,))
                                                  for i, lim in asked])
                if res is _HUNG:
                    continue
                for (i, lim), (ok, value, seconds) in zip(asked, res):
                    try:
                        if not ok:
                            raise value
                        d, error = _checked(name, value), None
                    except BaseException as e:
                        d, error = None, self._error(e)
                    answered.update(self._record(out[i], name, seconds, d, lim, error, i, keep))
            if answered:
                pending = [i for i in pending if i not in answered]
        self.hook_seconds += time.perf_counter() - t_start
        return out

    def _keeper(self, judge: Judge | None, si: int, requests: Sequence[DraftRequest],
                only: Sequence[tuple[str, ...] | None] | None) -> Callable[[int, Draft], bool] | None:
        """keep(i, draft) for the drafts of slot si: the judge's verdict where a later speculator
        may still draft for request i, else True (no judge: None)."""
        if judge is None:
            return None
        later = [s.name for s in self._slots[si + 1:]
                 if not s.quarantined and ("propose" in s.hooks or "propose_batch" in s.hooks)]
        if not later:
            return None

        def keep(i: int, draft: Draft) -> bool:
            names = tuple(n for n in later if only is None or only[i] is None or n in only[i])
            return not names or judge(requests[i], draft, names)
        return keep

    @staticmethod
    def _record(p: Proposal, name: str, seconds: float, draft: Draft | None, limits: DraftLimits,
                error: BaseException | None, i: int, keep: Callable[[int, Draft], bool] | None = None) -> tuple[int, ...]:
        """Note one speculator's answer for a request; returns (i,) when the search for it ends."""
        p.costs.append((name, seconds, 0 if draft is None else len(draft)))
        if error is not None:
            p.error = error
            return (i,)
        if draft is None:
            return ()
        if len(draft):
            draft = _trim(draft, limits.n_max)
            if keep is not None and not keep(i, draft):  # passed over: the next speculators are asked
                p.passed.append(draft)
                return ()
            p.draft = draft
        return (i,)

    def propose(self, seq: SequenceView, limits: DraftLimits, only: tuple[str, ...] | None = None) -> Draft | None:
        """The first draft of the chain for one sequence (of its spec types in `only`, when given)."""
        p = self.propose_batch([DraftRequest(seq, limits)], [only])[0]
        if p.error is not None:
            raise p.error
        return p.draft

    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict, hidden_start: int = 0) -> None:
        error = self.accept_many([dict(seq=seq, draft=draft, n_accepted=n_accepted, hidden=hidden, hidden_start=hidden_start)])[0]
        if error is not None:
            raise error

    def accept_many(self, calls: list[dict]) -> list[Exception | None]:
        """``accept`` for several sequences (each a dict of accept's arguments), one hand-off per
        speculator: per call, None or the exception a speculator raised (the speculators after it
        in the chain are then not told, as with ``accept``)."""
        t = time.perf_counter()
        errors: list[Exception | None] = [None] * len(calls)
        try:
            for slot in self._slots:
                if slot.quarantined or "accept" not in slot.hooks:
                    continue
                todo = [i for i, e in enumerate(errors) if e is None]
                if not todo:
                    break
                res = self._run(slot, "accept", [(calls[i], (calls[i]["seq"].seq_id,)) for i in todo])
                if res is _HUNG:
                    continue
                for i, (ok, value, _) in zip(todo, res):
                    if not ok:
                        errors[i] = self._error(value)
        finally:
            self.hook_seconds += time.perf_counter() - t
        return errors

    def prefill(self, seq: SequenceView, start: int, hidden: dict) -> None:
        self._call("prefill", (seq.seq_id,), seq=seq, start=start, hidden=hidden)

    def truncate(self, seq: SequenceView, n: int) -> None:
        self._asked.pop(seq.seq_id, None)
        self._live.add(seq.seq_id)
        self._call("truncate", (seq.seq_id,), seq=seq, n=n)

    def checkpoint(self, seq: SequenceView, action: str) -> None:
        self._call("checkpoint", (seq.seq_id,), seq=seq, action=action)

    def on_hidden_states(self) -> list[str]:
        """The spec types (not quarantined) that draft from the target's hidden states."""
        return [s.name for s in self._slots if not s.quarantined and getattr(s.spec, "hidden_layers", ())]

    def _answers(self, hook: str, seq_id: int, **kwargs):
        """(spec type, value) of each speculator (not quarantined) implementing `hook`, called for
        sequence `seq_id`. One that raises or hangs is left out, a raise logged as
        ``{hook}_failed``: used where a speculator's answer is optional to the caller."""
        for slot in self._slots:
            if slot.quarantined or hook not in slot.hooks:
                continue
            res = self._run(slot, hook, [(dict(seq_id=seq_id, **kwargs), (seq_id,))])
            if res is _HUNG:
                continue
            ok, value, _ = res[0]
            if not ok:
                log.warning(f"{hook}_failed", spec_type=slot.name, error=f"{type(value).__name__}: {value}")
                self._error(value)  # a KeyboardInterrupt is the user's: raised
                continue
            yield slot.name, value

    def export_states(self, seq_id: int, n: int) -> dict[str, SpeculatorState]:
        """Each speculator's ``export_state`` of sequence `seq_id`'s first n positions, by spec
        type. One that raises or hangs is left out (logged): a slot file is still written,
        without its state."""
        return {name: value for name, value in self._answers("export_state", seq_id, n=n)
                if isinstance(value, SpeculatorState)}

    def import_states(self, seq: SequenceView, states: dict[str, SpeculatorState], n: int) -> set[str]:
        """Offer each speculator the states of `states` (after ``begin``), its own spec type's
        first, then the others (saved under an alias, e.g. draft-mtp for mtp: the state's key
        decides), until it takes one; the spec types that took one. A speculator that raises
        stops the call, as ``begin`` does."""
        taken = set()
        for slot in self._slots:
            if slot.quarantined or "import_state" not in slot.hooks:
                continue
            offers = sorted(states.items(), key=lambda item: item[0] != slot.name)
            for _, state in offers:
                res = self._run(slot, "import_state", [(dict(seq=seq, state=state, n=n), (seq.seq_id,))])
                if res is _HUNG:
                    break
                ok, value, _ = res[0]
                if not ok:
                    raise self._error(value)
                if value:
                    taken.add(slot.name)
                    break
        return taken

    def state_nbytes(self, seq_id: int) -> int:
        """The bytes the speculators hold for sequence `seq_id`, summed (``state_nbytes``). One
        that raises or hangs counts 0 (logged): the answer is for the cache's accounting, which
        must not fail a request."""
        return sum(value for _, value in self._answers("state_nbytes", seq_id)
                   if isinstance(value, int) and not isinstance(value, bool) and value > 0)

    def end(self, seq_id: int) -> None:
        self._asked.pop(seq_id, None)
        self._live.discard(seq_id)
        for slot in self._slots:
            slot.stale.discard(seq_id)  # the sequence is gone: nothing to rebuild (its `end` still goes out)
        self._call("end", (seq_id,), seq_id=seq_id)
