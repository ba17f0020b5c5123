"""speculant speculators called through their hooks, the engine's chain semantics, no engine.

speculant's own chain (`speculant.chain`) is internal, and carries what a vLLM worker does not
want (a thread per speculator, deadlines, the cost model). What is kept is the contract every
speculator is written against (docs/plugins.md, "Hook reference"):

* a hook is called only if the speculator implements it, with the arguments its method names
  (a method may take fewer than the hook offers), as pluggy dispatches;
* lifecycle hooks (begin, accept, end) reach every speculator of the chain;
* drafts: the speculators are asked in chain order for the sequences still without a draft;
  one with `propose_batch` gets all of them in one call, one with `propose` is asked per
  sequence; a Draft (even empty) answers for its sequence, None passes it on;
* a hook that raises turns speculation off for the sequences of that call only.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from speculant import Draft, DraftRequest, SequenceView
from speculant.logs import get_logger

log = get_logger(__name__)

HOOKS = ("begin", "propose", "propose_batch", "accept", "end")


def _hook(spec: Any, name: str) -> Callable[..., Any] | None:
    """The speculator's implementation of hook `name`, taking only the keywords it names."""
    fn = getattr(spec, name, None)
    if fn is None or getattr(fn, "speculant_impl", None) is None:  # pluggy's @hookimpl mark
        return None
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    wanted = set(params)
    return lambda **kw: fn(**{k: v for k, v in kw.items() if k in wanted})


class Chain:
    """The speculators of one proposer, in the user's order. Sequence ids whose speculation a
    failing hook turned off are in `off`; they get no further calls but `end`."""

    def __init__(self, speculators: Sequence[Any]):
        self.speculators = list(speculators)
        self.hooks = [{name: _hook(s, name) for name in HOOKS} for s in self.speculators]
        self.off: set[int] = set()

    def _each(self, name: str, seq_ids: Sequence[int], **kwargs) -> None:
        for spec, hooks in zip(self.speculators, self.hooks):
            fn = hooks[name]
            if fn is None:
                continue
            try:
                fn(**kwargs)
            except Exception as e:  # speculant's rule: only these sequences lose speculation
                self._fail(spec, name, seq_ids, e)

    def _fail(self, spec: Any, hook: str, seq_ids: Sequence[int], e: Exception) -> None:
        log.warning("speculator hook failed; speculation off for its sequences", spec_type=getattr(spec, "spec_type", "?"),
                    hook=hook, sequences=len(seq_ids), error=f"{type(e).__name__}: {e}")
        self.off.update(seq_ids)

    def begin(self, seq: SequenceView) -> None:
        self._each("begin", [seq.seq_id], seq=seq)

    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int) -> None:
        if seq.seq_id in self.off:
            return
        # Token-only speculators read no hidden states: none are asked for, none are given.
        self._each("accept", [seq.seq_id], seq=seq, draft=draft, n_accepted=n_accepted, hidden={},
                   hidden_start=len(seq.tokens))

    def end(self, seq_id: int) -> None:
        self._each("end", [seq_id], seq_id=seq_id)
        self.off.discard(seq_id)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """One draft (or None) per request, in order; at most its limits' n_max tokens."""
        out: list[Draft | None] = [None] * len(requests)
        pending = [i for i, r in enumerate(requests) if r.seq.seq_id not in self.off]
        for spec, hooks in zip(self.speculators, self.hooks):
            if not pending:
                break
            answered: list[tuple[int, Draft | None]] = []
            if hooks["propose_batch"] is not None:
                ids = [requests[i].seq.seq_id for i in pending]
                try:
                    drafts = hooks["propose_batch"](requests=[requests[i] for i in pending])
                    drafts = [None] * len(pending) if drafts is None else list(drafts)
                    if len(drafts) != len(pending):
                        raise ValueError(f"propose_batch returned {len(drafts)} drafts for {len(pending)} requests")
                    answered = [(i, _checked(d)) for i, d in zip(pending, drafts)]
                except Exception as e:
                    self._fail(spec, "propose_batch", ids, e)
            elif hooks["propose"] is not None:
                for i in pending:
                    r = requests[i]
                    try:
                        answered.append((i, _checked(hooks["propose"](seq=r.seq, limits=r.limits))))
                    except Exception as e:
                        self._fail(spec, "propose", [r.seq.seq_id], e)
            for i, draft in answered:
                if draft is not None:
                    n_max = requests[i].limits.n_max
                    out[i] = draft if len(draft) <= n_max else Draft(draft.tokens[:n_max], draft.spec_type)
            done = {i for i, d in answered if d is not None}
            pending = [i for i in pending if i not in done and requests[i].seq.seq_id not in self.off]
        return [None if r.seq.seq_id in self.off else d for r, d in zip(requests, out)]


def _checked(draft: Any) -> Draft | None:
    """A speculator's answer as a Draft of plain ints (numpy or torch integers are fine)."""
    if draft is None:
        return None
    if not isinstance(draft, Draft):
        raise TypeError(f"a draft must be a speculant.Draft, got {type(draft).__name__}")
    return Draft(tuple(int(t) for t in draft.tokens), draft.spec_type, draft.probs)

