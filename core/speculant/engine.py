"""The decode loop: propose -> one target forward over all sequences -> verify -> accept/truncate.

Everything works on token ids; the engine knows nothing of text. Per step, each active sequence
contributes the rows its target state still lacks (normally just its last token) plus its draft;
one forward runs all of them; each sequence keeps the longest draft prefix the target agrees with
plus one token of the target's own, and its target state is cut back to what was kept (KV
truncate, or checkpoint restore and replay for recurrent state).
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import attrs
import torch

from speculant.adaptive import DraftLengthController
from speculant.chain import SpeculatorChain
from speculant.constraint import Constraint
from speculant.errors import LimitError
from speculant.logs import get_logger
from speculant.model import Model
from speculant.sampling import Sampler, SamplingParams, token_logprobs
from speculant.types import Batch, Draft, DraftLimits, DraftRequest, SequenceView, SpeculatorState, TokenLogprob
from speculant.verify import verify

log = get_logger(__name__)

# The spec type of drafts made of the tokens a sequence's constraint forces (the grammar drafter).
GRAMMAR_SPEC_TYPE = "grammar"

# Prompt rows per forward. A prompt is fed in chunks of this size, one chunk per step, so that the
# other sequences keep decoding while a long prompt is prefilled; the rest rides with the
# sequence's first decode step. A row computes the same in any chunk (Model.row_classes).
PREFILL_CHUNK = 512


@attrs.frozen
class EngineConfig:
    n_ctx: int = 4096
    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    adaptive: bool = True  # trim or skip drafts that would not pay for their verification
    # Seconds a speculator's hook call may take (None: no limit; its calls then run inline on the
    # engine thread). With a deadline each speculator's calls run on a thread of its own and the
    # engine waits at most this long for each: a call that does not return in time is abandoned
    # and its speculator quarantined until `spec_revive` (SpeculatorChain; logged), the others
    # go on. `spec_grace` (None: max(60 s, 10 x the deadline)), plus 20 ms per token of the
    # sequence, replaces it where a speculator may catch up on a prompt: begin, truncate, prefill,
    # and its first propose and accept for a sequence.
    spec_deadline: float | None = 5.0
    spec_grace: float | None = None
    # Seconds after a quarantine before the speculator is tried again, once its stuck call has
    # returned (it starts over for every sequence; the third quarantine is for good). None: never.
    spec_revive: float | None = 60.0
    # Recurrent targets (state that cannot be cut): where the context keeps each verification
    # row's state, a partial acceptance cuts back to the last accepted row; `spec_use_checkpoints`
    # saves the state before every verification instead and, on a partial acceptance, restores
    # it and feeds the accepted tokens again (llama.cpp's checkpoint/replay). `ctx_checkpoints`:
    # prompt-end states kept per sequence, the points a later request can resume from.
    spec_use_checkpoints: bool = False
    ctx_checkpoints: int = 32

    def __attrs_post_init__(self):
        if self.n_ctx < 2:
            raise LimitError(f"context size {self.n_ctx} is too small")
        if self.spec_deadline is not None and not self.spec_deadline > 0:
            raise LimitError(f"the speculator deadline must be positive, got {self.spec_deadline}")
        if self.spec_revive is not None and not self.spec_revive >= 0:
            raise LimitError(f"the speculator revive time must be >= 0, got {self.spec_revive}")
        if self.spec_grace is not None and not self.spec_grace > 0:
            raise LimitError(f"the speculator grace must be positive, got {self.spec_grace}")
        if self.ctx_checkpoints < 0:
            raise LimitError(f"--ctx-checkpoints must be >= 0, got {self.ctx_checkpoints}")


@attrs.frozen
class SpecOverride:
    """Per-sequence speculation settings (a server request's ``speculative.*`` fields); None keeps
    the engine's. ``types``: the only spec types of the chain that may draft for the sequence, in
    the chain's order (``()``: no speculation)."""

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    types: tuple[str, ...] | None = None


_NO_OVERRIDE = SpecOverride()


@attrs.define
class SpecTypeStats:
    """Totals for one spec type over everything the engine ran."""

    drafts: int = 0  # verified drafts
    drafted: int = 0  # tokens in them
    accepted: int = 0
    accepted_at: list[int] = attrs.field(factory=list)  # accepted_at[i]: drafts whose token i was accepted
    declined: int = 0  # times the adaptive controller did not let the spec type draft
    produced: int = 0  # tokens the speculator drafted, before the controller trimmed them
    draft_seconds: float = 0.0  # time in the speculator, calls without a draft included
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step, the target's own token included."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    def add(self, draft_len: int, n_accepted: int) -> None:
        self.drafts += 1
        self.drafted += draft_len
        self.accepted += n_accepted
        self.accepted_at.extend([0] * (draft_len - len(self.accepted_at)))
        for i in range(n_accepted):
            self.accepted_at[i] += 1


@attrs.define
class SeqStats:
    n_prompt: int = 0
    n_generated: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    n_declined: int = 0  # spec types the adaptive controller did not let draft, summed over steps
    grammar_drafted: int = 0  # draft tokens the grammar drafter supplied (the constraint forced them)
    grammar_accepted: int = 0
    drafts: SpecTypeStats = attrs.field(factory=SpecTypeStats)  # this sequence's drafts, all spec types

    @property
    def n_drafts(self) -> int:
        return self.drafts.drafts

    @property
    def n_drafted(self) -> int:
        return self.drafts.drafted

    @property
    def n_accepted(self) -> int:
        return self.drafts.accepted


@attrs.define
class Sequence:
    seq_id: int
    tokens: list[int]
    n_prompt: int
    max_new_tokens: int
    sampler: Sampler
    n_cached: int = 0  # tokens[:n_cached] are in the target's state
    finish_reason: str | None = None
    stats: SeqStats = attrs.field(factory=SeqStats)
    saved: Any = None  # recurrent-state checkpoint taken before verifying a draft
    spec: SpecOverride | None = None
    spec_error: str | None = None  # a speculator raised for this sequence: it goes on without speculation
    prefilled: bool = False  # the prompt's chunks but its last (which rides with the first step) are in
    n_reused: int = 0  # prompt tokens whose state came from an earlier request (the prompt cache)
    # (first row, prompt length) runs: rows from `first row` on were computed for a request whose
    # prompt had that length (the backend may compute prompt rows by it, see Model.row_classes).
    row_prompts: tuple[tuple[int, int], ...] = ()
    # (tokens, handle) states saved at prompt ends, for a recurrent target: the only points a later
    # request can go back to, since its state cannot be cut.
    checkpoints: list[tuple[int, Any]] = attrs.field(factory=list)
    # Log-probabilities: None, none recorded; k >= 0, each emitted token's logprob and the k most
    # likely tokens of its row, in `logprobs` (one entry per generated token, in order).
    n_logprobs: int | None = None
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    # Sharing a prompt (Engine.add(..., fork_of=)): the sequence waits, without rows of its own,
    # until `parent` holds the prompt's rows, and then starts from a copy of them (`forks`: the
    # sequences waiting on this one).
    parent: "Sequence | None" = attrs.field(default=None, repr=False, eq=False)
    forks: list["Sequence"] = attrs.field(factory=list, repr=False, eq=False)
    # What the sequence may emit (a grammar, a JSON schema; speculant.constraint), advanced with
    # every token it emits; None: anything.
    constraint: Constraint | None = attrs.field(default=None, repr=False, eq=False)

    def prefill_rows(self) -> list[int]:
        """The prompt's next chunk to feed (empty once the prompt is in)."""
        end = len(self.tokens) - 1
        return self.tokens[self.n_cached : min(end, self.n_cached + PREFILL_CHUNK)]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def argmax_only(self) -> bool:
        """Only the argmax of this sequence's logits is used (Batch.argmax_only): greedy, no
        logprobs, no constraint (whose mask may exclude the argmax)."""
        return self.sampler.params.greedy and self.n_logprobs is None and self.constraint is None

    def view(self) -> SequenceView:
        return SequenceView(self.seq_id, tuple(self.tokens), self.n_prompt, max(0.0, self.sampler.params.temperature))


@attrs.define
class RecurrentStats:
    """How a recurrent target went back after partial acceptances: cut back to a verification
    row's state (`rollbacks`) or restored a checkpoint and fed the kept tokens again (`replays`,
    `replayed_rows`); the seconds spent saving and restoring checkpoints."""

    rollbacks: int = 0
    replays: int = 0
    replayed_rows: int = 0
    saves: int = 0
    checkpoint_seconds: float = 0.0


@attrs.define(eq=False)
class CachedPrompt:
    """A finished sequence's state, kept for a later request to continue from (the prompt cache):
    the target's rows for `tokens`, and the speculators' state, stay under `seq_id` in their
    contexts until a request continues from it (`Engine.add(..., cached=entry)`) or it is dropped
    (`Engine.drop_cached`)."""

    seq_id: int
    tokens: tuple[int, ...]  # whose state the target's context holds, in order
    row_prompts: tuple[tuple[int, int], ...]
    checkpoints: list[tuple[int, Any]]
    n_bytes: int  # the memory it takes, target and speculators (what the server's --cache-ram limit counts)
    speculators_synced: bool = True  # False: the speculators hold nothing for it (a state loaded from a file)
    # The target's hidden states of its rows, {layer: tensor of len(tokens) rows} (`Engine.adopt`):
    # speculators on hidden states get them through `prefill` when a request continues from it.
    hidden: dict[int, Any] | None = None
    # The speculators' own states of its rows, by spec type (`Engine.adopt`, from a slot file):
    # each takes its own through `import_state` when a request continues from it.
    spec_states: dict[str, SpeculatorState] | None = None

    def common_prefix(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` this entry holds."""
        n = min(len(self.tokens), len(prompt))
        i = 0
        while i < n and self.tokens[i] == prompt[i]:
            i += 1
        return i


@attrs.define
class _Shadow:
    """A draft the controller left unverified, being compared with what its sequence emits."""

    spec_type: str
    tokens: tuple[int, ...]
    confidence: tuple[float, ...] | None = None  # the speculator's, for its calibration
    matched: int = 0  # its first tokens that the sequence emitted, in order
    done: bool = False


@attrs.define
class _Part:
    """One sequence's rows in a step: a prompt chunk (draft None, no logits) or decoding rows."""

    seq: Sequence
    draft: Draft | None
    batch: Batch


@attrs.define
class StepPlan:
    decode: list[_Part]
    prefill: list[_Part]
    batch: Batch  # all the rows of one forward: the decoding parts first, then the prompt chunks


def _per_row(row_prompts: tuple[tuple[int, int], ...], n: int) -> list[int]:
    """The prompt length each of the first n rows was computed for, from (first row, length) runs."""
    out = []
    for i, (a, length) in enumerate(row_prompts):
        end = row_prompts[i + 1][0] if i + 1 < len(row_prompts) else n
        out.extend([length] * (min(end, n) - a))
    return out[:n]


class Engine:
    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), speculators: list[Any] = ()):
        self.model, self.config = model, config
        self.context = model.new_context(config.n_ctx)
        self.recurrent = getattr(self.context, "state_kind", "kv") == "recurrent"
        # Per-row rollback where the context can (HybridCache), unless checkpoints are asked for.
        self.row_rollback = (self.recurrent and not config.spec_use_checkpoints
                             and hasattr(self.context, "can_truncate") and hasattr(self.context, "keep_rows"))
        if self.recurrent and hasattr(self.context, "keep_rows"):
            self.context.keep_rows = self.row_rollback
        self.recurrent_stats = RecurrentStats()
        self.chain = SpeculatorChain(list(speculators), deadline=config.spec_deadline, grace=config.spec_grace,
                                     revive=config.spec_revive)
        self.controller = DraftLengthController(enabled=config.adaptive)
        self._proposed: dict[int, Draft] = {}  # sequence -> its draft as proposed, until verified
        self._shadows: dict[int, list[_Shadow]] = {}  # sequence -> drafts left unverified, set against what it emits
        self.controller.replay = self.recurrent and not self.row_rollback
        self.spec_stats: dict[str, SpecTypeStats] = {}
        self.eog = frozenset(getattr(model.tokenizer, "eog_ids", ()) or ())
        self.n_vocab = model.info.n_vocab
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._accepts: list[tuple[Sequence, dict]] = []  # this step's accept calls, made at its end

    # --- sequences ---------------------------------------------------------------------
    def add(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
            spec: SpecOverride | None = None, cached: CachedPrompt | None = None, logprobs: int | None = None,
            fork_of: Sequence | None = None, constraint: Constraint | None = None) -> Sequence:
        """Start a sequence. With `cached` (an entry from `keep`), it continues from the longest
        prefix of the entry that computes exactly as a cold start would (`reusable`): only the
        rest of the prompt is prefilled, and the speculators get `truncate` instead of `begin`, so
        their state up to there survives. The entry is used up either way.

        `logprobs` (k >= 0): record each emitted token's log-probability and the k most likely
        tokens of its row in `seq.logprobs` (None: nothing is computed).

        `fork_of` (a running sequence with the same prompt, e.g. the first of n choices): the
        prompt is not prefilled again; the new sequence waits until that one holds the prompt's
        rows (all but the last, whose logits each sequence computes itself) and starts from a copy
        of them: the same rows a cold start computes, bit for bit. Ignored where the target's
        state cannot be copied (a recurrent target), with `cached`, or for another prompt.

        `constraint` (speculant.constraint.Constraint, in its initial state): every token the
        sequence emits is one it allows; the tokens it forces are drafted without asking the
        speculators (spec type "grammar"), and a speculator's draft is cut before its first
        token the constraint rejects."""
        if not prompt:
            raise LimitError("the prompt is empty")
        if len(prompt) >= self.config.n_ctx:
            raise LimitError(f"prompt has {len(prompt)} tokens, the context holds {self.config.n_ctx} (prompt plus at least one new token)")
        if max_new_tokens < 1:
            raise LimitError(f"max new tokens must be >= 1, got {max_new_tokens}")
        n_reused = self.reusable(cached, prompt) if cached is not None else 0
        if cached is not None and n_reused == 0:
            self.drop_cached(cached)
            cached = None
        seq_id = cached.seq_id if cached is not None else self._new_id()
        seq = Sequence(seq_id, list(prompt), len(prompt), max_new_tokens, Sampler(params), spec=spec, n_logprobs=logprobs,
                       constraint=constraint)
        seq.stats.n_prompt = len(prompt)
        if cached is None:
            seq.row_prompts = ((0, len(prompt)),)
            self.sequences[seq_id] = seq
            self._spec_call(seq, self.chain.begin, seq.view())
            if fork_of is not None and self._can_fork(fork_of, prompt):
                if fork_of.n_cached >= len(prompt) - 1:
                    self._fork(seq, fork_of)
                else:
                    seq.parent = fork_of
                    fork_of.forks.append(seq)
            return seq
        self._restore_prefix(cached, n_reused)
        seq.n_cached = seq.n_reused = n_reused
        seq.row_prompts = tuple((a, n) for a, n in cached.row_prompts if a < n_reused) + ((n_reused, len(prompt)),)
        seq.checkpoints = [(n, h) for n, h in cached.checkpoints if n <= n_reused]
        self.sequences[seq_id] = seq
        if cached.speculators_synced:
            self._spec_call(seq, self.chain.truncate, seq.view(), n_reused)
        else:
            self._spec_call(seq, self.chain.begin, seq.view())
            hidden = self._adopted_hidden(cached, n_reused)
            if hidden:
                self._spec_call(seq, self.chain.prefill, seq.view(), 0, hidden)
            else:
                taken = self._spec_call(seq, self.chain.import_states, seq.view(), cached.spec_states or {}, n_reused) or set()
                lacking = [t for t in self.chain.on_hidden_states() if t not in taken]
                if lacking:
                    log.warning("adopted_without_hidden_states", seq=seq_id, layers=list(self.chain.hidden_layers),
                                spec_types=lacking, effect="these speculators draft nothing for this sequence")
        return seq

    def _adopted_hidden(self, cached: CachedPrompt, n: int) -> dict:
        """The hidden states the speculators ask for, of an adopted entry's first n rows: what a
        cold start's prefill would have handed them for those rows ({} where the entry has none)."""
        if not cached.hidden or any(l not in cached.hidden for l in self.chain.hidden_layers):
            return {}
        return {l: cached.hidden[l][:n] for l in self.chain.hidden_layers}

    def _can_fork(self, parent: Sequence, prompt: list[int]) -> bool:
        # A speculator on hidden states (EAGLE3) gets the prompt's through `prefill`: a copy of the
        # rows would leave it without them, so such a chain prefills each sequence itself.
        return (not self.recurrent and not self.chain.hidden_layers
                and hasattr(self.context, "get_state") and hasattr(self.context, "set_state")
                and self.sequences.get(parent.seq_id) is parent and parent.n_prompt == len(prompt)
                and parent.tokens[: len(prompt)] == list(prompt))

    def _fork(self, seq: Sequence, parent: Sequence) -> None:
        """Start `seq` from a copy of `parent`'s rows of the prompt but its last token."""
        n = seq.n_prompt - 1
        if n > 0:
            state = self.context.get_state(parent.seq_id)
            self.context.set_state(seq.seq_id, {k: v[:, :n] for k, v in state.items()})
        seq.n_cached = seq.n_reused = n
        seq.row_prompts = tuple((a, m) for a, m in parent.row_prompts if a < n) + ((n, seq.n_prompt),)
        seq.parent = None

    def _unfork(self, parent: Sequence) -> None:
        """`parent` goes away: the sequences still waiting on it prefill the prompt themselves."""
        for child in parent.forks:
            child.parent = None
        parent.forks = []

    def _forks_ready(self, parent: Sequence) -> None:
        if parent.forks and parent.n_cached >= parent.n_prompt - 1:
            for child in parent.forks:
                if self.sequences.get(child.seq_id) is child:
                    self._fork(child, parent)
            parent.forks = []

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def reusable(self, cached: CachedPrompt, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` can take their state from `cached` and still compute
        exactly what a cold start computes: the common prefix (all but the prompt's last token,
        whose logits are needed), cut where the model would compute a row differently for this
        prompt than it did for the request that computed it (Model.row_classes), and, for a
        recurrent target, to the point of a saved state."""
        n = min(cached.common_prefix(prompt), len(prompt) - 1)
        if self.recurrent:
            if n == len(cached.tokens):
                return n
            return max((m for m, _ in cached.checkpoints if m <= n), default=0)
        classes = getattr(self.model, "row_classes", None)
        if classes is None or n == 0:
            return n
        positions = range(n)
        old = classes(positions, _per_row(cached.row_prompts, n))
        new = classes(positions, [len(prompt)] * n)
        if old is None:
            return n
        return next((i for i in positions if old[i] != new[i]), n)

    def _restore_prefix(self, cached: CachedPrompt, n: int) -> None:
        """Cut the entry's target state back to its first n tokens."""
        if not self.recurrent:
            self.context.truncate(cached.seq_id, n)
        elif n < len(cached.tokens):
            self.context.restore(cached.seq_id, next(h for m, h in cached.checkpoints if m == n))

    def keep(self, seq: Sequence) -> CachedPrompt:
        """Finish a sequence but keep its state for a later request (`add(..., cached=entry)`)."""
        self._unfork(seq)
        self._detach(seq)
        self.sequences.pop(seq.seq_id, None)
        self.controller.forget(seq.seq_id)
        self._proposed.pop(seq.seq_id, None)
        self._shadows.pop(seq.seq_id, None)
        if seq.saved is not None:  # stopped between a checkpoint and its verification
            self.context.restore(seq.seq_id, seq.saved)
            seq.saved = None
        return CachedPrompt(seq.seq_id, tuple(seq.tokens[: seq.n_cached]), seq.row_prompts, seq.checkpoints, self._nbytes(seq.seq_id))

    def adopt(self, tokens: list[int], row_prompts: tuple[tuple[int, int], ...], state: dict,
              hidden: dict[int, Any] | None = None, spec_states: dict[str, SpeculatorState] | None = None) -> CachedPrompt:
        """An entry from a target state saved elsewhere (`context.get_state` of an entry with these
        tokens and row_prompts, e.g. read back from a file). ValueError if it does not fit.

        `hidden`: the target's hidden states of the same rows, {layer: one row per token}, as
        `Model.forward(hidden_layers=)` numbers and computes them. A speculator on hidden states
        (EAGLE3, MTP, DFlash) gets nothing from a state alone and would not draft for the adopted
        rows; with them it gets, through `prefill`, what a cold start's prefill hands it.
        `spec_states` (`speculator_states` of the entry saved): the speculators' own states of the
        same rows, each handed to its spec type through `import_state` (where `hidden` is not given)."""
        if self.recurrent or not hasattr(self.context, "set_state"):
            raise ValueError("this model's state cannot be loaded")
        for layer, rows in (hidden or {}).items():
            if len(rows) != len(tokens):
                raise ValueError(f"hidden states of layer {layer} hold {len(rows)} rows for {len(tokens)} tokens")
        seq_id = self._new_id()
        try:
            n = self.context.set_state(seq_id, state)
            if n != len(tokens):
                raise ValueError(f"the state holds {n} rows for {len(tokens)} tokens")
        except Exception:
            self.context.drop(seq_id)
            raise
        return CachedPrompt(seq_id, tuple(tokens), tuple(row_prompts), [], self._nbytes(seq_id, hidden, spec_states),
                            speculators_synced=False, hidden=dict(hidden) if hidden else None,
                            spec_states=dict(spec_states) if spec_states else None)

    def speculator_states(self, cached: CachedPrompt) -> dict[str, SpeculatorState]:
        """The speculators' own states of an entry's rows, by spec type, to be saved beside the
        target's (`export_state`; what `adopt` takes back as `spec_states`). An entry adopted and
        not yet continued gives back what it was adopted with."""
        if not cached.speculators_synced:
            return dict(cached.spec_states or {})
        try:
            return self.chain.export_states(cached.seq_id, len(cached.tokens))
        except Exception as e:  # the entry is saved without them
            log.warning("export_state_failed", error=f"{type(e).__name__}: {e}")
            return {}

    def copy_cached(self, cached: CachedPrompt, n: int) -> CachedPrompt | None:
        """A new entry holding a copy of `cached`'s first n rows, `cached` untouched: a request that
        shares only a prefix with another conversation's state (a system prompt) continues from
        the copy, and that conversation's state stays whole for its own next turn. None where the
        target's state cannot be copied (a recurrent target), or where speculators take the
        prompt's hidden states (they would hold nothing for the copied rows)."""
        n = min(n, len(cached.tokens))
        if (n <= 0 or self.recurrent or self.chain.hidden_layers or not hasattr(self.context, "get_state")
                or not hasattr(self.context, "set_state")):
            return None
        seq_id = self._new_id()
        state = self.context.get_state(cached.seq_id)
        self.context.set_state(seq_id, {k: v[:, :n] for k, v in state.items()})
        row_prompts = tuple((a, m) for a, m in cached.row_prompts if a < n)
        return CachedPrompt(seq_id, cached.tokens[:n], row_prompts, [], self._nbytes(seq_id), speculators_synced=False)

    def _nbytes(self, seq_id: int, *held: dict | None) -> int:
        """The memory a kept sequence takes: its target state (0 where the context cannot say),
        what the speculators hold for it (their ``state_nbytes``) and the tensors of `held`
        (an adopted entry's hidden states and speculator states, kept until it is continued)."""
        nbytes = getattr(self.context, "nbytes", None)
        total = 0 if nbytes is None else nbytes(seq_id)
        total += self.chain.state_nbytes(seq_id)
        for group in held:
            for value in (group or {}).values():
                tensors = value.tensors.values() if isinstance(value, SpeculatorState) else [value]
                total += sum(getattr(t, "nbytes", 0) for t in tensors)
        return total

    def drop_cached(self, cached: CachedPrompt) -> None:
        """Free a kept state (target and speculators)."""
        self.context.drop(cached.seq_id)
        try:
            self.chain.end(cached.seq_id)
        except Exception:  # a speculator failing to free its state must not fail the caller
            pass

    def _detach(self, seq: Sequence) -> None:
        if seq.parent is not None:
            seq.parent.forks = [c for c in seq.parent.forks if c is not seq]
            seq.parent = None

    def release(self, seq: Sequence) -> None:
        self._unfork(seq)
        self._detach(seq)
        self.sequences.pop(seq.seq_id, None)
        self.context.drop(seq.seq_id)
        self.controller.forget(seq.seq_id)
        self._proposed.pop(seq.seq_id, None)
        self._shadows.pop(seq.seq_id, None)
        try:
            self.chain.end(seq.seq_id)
        except Exception as e:  # the sequence is gone either way
            seq.spec_error = seq.spec_error or f"{type(e).__name__}: {e}"

    def _spec_call(self, seq: Sequence, hook, *args):
        """A speculator hook for one sequence. A speculator that raises turns speculation off for
        this sequence only: it goes on with plain decoding, the error is left in seq.spec_error.
        (One that hangs past the deadline is quarantined by the chain; the others go on.)"""
        if seq.spec_error is not None:
            return None
        try:
            return hook(*args)
        except Exception as e:
            seq.spec_error = f"{type(e).__name__}: {e}"
            return None

    def active(self) -> list[Sequence]:
        return [s for s in self.sequences.values() if s.finish_reason is None]

    # --- the loop: plan -> run -> commit -------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """Advance every active sequence: one that is decoding by at least one token, one whose
        prompt is still going in by one chunk of it (no tokens yet). Returns the new tokens by id."""
        plan = self._plan_step()
        t0 = time.perf_counter()
        out = self.model.forward(plan.batch, self.context, self.chain.hidden_layers)
        return self._commit(plan, out, time.perf_counter() - t0)

    def _plan_step(self) -> StepPlan:
        """What one forward computes: a chunk of each prompt still going in, and for each decoding
        sequence its rows not yet in the target's state plus the chain's draft."""
        prefill, decoding = [], []
        for seq in self.active():
            if seq.parent is not None:  # waits for the prompt's rows of the sequence it shares them with
                continue
            if not seq.prefilled:  # a new prompt; replayed rows of a recurrent state ride with the step
                rows = seq.prefill_rows()
                # The prompt's last chunk rides with its first decode step (one forward less
                # before the first token): a row computes the same in either (Model.row_classes).
                # A recurrent target takes it alone, to save its state at the prompt's end.
                if len(rows) == PREFILL_CHUNK or (rows and self.recurrent):
                    prefill.append(_Part(seq, None, Batch.for_sequence(seq.seq_id, seq.n_cached, rows, logits="none", prompt_len=seq.n_prompt)))
                    continue
                seq.prefilled = True
                if self.recurrent and seq.n_cached > seq.n_reused and self.config.ctx_checkpoints > 0:
                    # a point a later prompt can resume from (the oldest goes past --ctx-checkpoints)
                    seq.checkpoints = seq.checkpoints[len(seq.checkpoints) + 1 - self.config.ctx_checkpoints:]
                    seq.checkpoints.append((seq.n_cached, self.context.save(seq.seq_id)))
            decoding.append(seq)
        # Checkpoint/replay: a sequence whose kept tokens ride again this step drafts nothing (as
        # llama.cpp's replay step): a draft cut on top of them would restore to before them again,
        # and the rows to replay would pile up.
        replaying = {s.seq_id for s in decoding if self.recurrent and not self.row_rollback and len(s.tokens) - s.n_cached > 1}
        drafts = self._propose_all([s for s in decoding if s.seq_id not in replaying])
        drafts.update((sid, None) for sid in replaying)
        parts = []
        for seq in decoding:
            draft = drafts[seq.seq_id]
            pending = seq.tokens[seq.n_cached:]
            rows = pending + list(draft.tokens if draft else ())
            b = Batch.for_sequence(seq.seq_id, seq.n_cached, rows, logits="all" if draft else "last", prompt_len=seq.n_prompt,
                                   argmax_only=seq.argmax_only)
            if draft:  # logits only from the last pending row on
                b = attrs.evolve(b, want_logits=tuple(i >= len(pending) - 1 for i in range(len(rows))))
                if self.recurrent and not self.row_rollback:
                    t0 = time.perf_counter()
                    seq.saved = self.context.save(seq.seq_id)
                    self._checkpoint_time(t0)
                    self.recurrent_stats.saves += 1
                    self._spec_call(seq, self.chain.checkpoint, seq.view(), "save")
            parts.append(_Part(seq, draft, b))
        if self.row_rollback:  # only verification rows need their states kept: not prompt chunks, not plain steps
            self.context.rows_for = {p.seq.seq_id for p in parts if p.draft}
        # The prompt chunks go last, so the decoding rows keep their offsets in the output.
        return StepPlan(parts, prefill, Batch.concat([p.batch for p in parts + prefill]))

    def _checkpoint_time(self, t0: float) -> None:
        seconds = time.perf_counter() - t0
        self.recurrent_stats.checkpoint_seconds += seconds
        self.controller.observe_checkpoint(seconds)

    def _commit(self, plan: StepPlan, out, seconds: float) -> dict[int, list[int]]:
        """Verify each decoding sequence's rows, cut the states back to what was kept, tell the
        speculators, and write the statistics (each once, here)."""
        decode_rows = sum(1 + len(p.draft or ()) for p in plan.decode)
        if not plan.prefill and len(plan.batch) == decode_rows:  # the cost model is of verification rows alone
            self.controller.observe_forward(len(plan.batch), seconds)
        new: dict[int, list[int]] = {}
        self._accepts = []
        hidden_row = sum(len(p.batch) for p in plan.decode)  # the prompt chunks' rows come last
        for p in plan.prefill:
            if out.hidden:
                hidden = {l: h[hidden_row : hidden_row + len(p.batch)] for l, h in out.hidden.items()}
                self._spec_call(p.seq, self.chain.prefill, p.seq.view(), p.seq.n_cached, hidden)
            hidden_row += len(p.batch)
            p.seq.n_cached += len(p.batch)
            p.seq.stats.prompt_seconds += seconds
            new[p.seq.seq_id] = []
            self._forks_ready(p.seq)
        row = hidden_row = 0
        share = seconds / len(plan.decode) if plan.decode else 0.0
        for p in plan.decode:
            seq, draft = p.seq, p.draft
            n_logits = sum(p.batch.want_logits)
            logits = out.logits[row : row + n_logits]
            hidden = {l: h[hidden_row : hidden_row + len(p.batch)] for l, h in out.hidden.items()}
            row += n_logits
            hidden_row += len(p.batch)
            new[seq.seq_id], n_accepted = self._verify(seq, draft, logits, hidden, len(p.batch))
            self._forks_ready(seq)
            seq.stats.decode_seconds += share
            if draft is not None:
                seq.stats.drafts.add(len(draft), n_accepted)
                if draft.spec_type == GRAMMAR_SPEC_TYPE:
                    seq.stats.grammar_drafted += len(draft)
                    seq.stats.grammar_accepted += n_accepted
                st = self._stats(draft.spec_type)
                st.add(len(draft), n_accepted)
                st.verify_seconds += share
                if draft.spec_type != GRAMMAR_SPEC_TYPE:  # the controller plans the speculators' drafts only
                    proposed = self._proposed.pop(seq.seq_id, draft)
                    cut_and_kept = n_accepted == len(draft) < len(proposed)
                    if cut_and_kept:  # the rest of the draft, set against what the sequence emits (this step's tokens on)
                        self._shadows.setdefault(seq.seq_id, []).append(
                            _Shadow(draft.spec_type, proposed.tokens, proposed.confidence))
                    # a cut draft's confidences are calibrated by its shadow, whole
                    self.controller.observe_draft(draft.spec_type, len(draft), n_accepted, proposed=len(proposed),
                                                  share_known=not cut_and_kept, seq_id=seq.seq_id,
                                                  confidence=None if cut_and_kept else draft.confidence)
            self._compare_shadow(seq, new[seq.seq_id])
        self._tell_accepts()
        return new

    def _compare_shadow(self, seq: Sequence, emitted: list[int]) -> None:
        """Set the sequence's unverified drafts against the tokens it emitted; once one parts from
        them (or is used up), tell the controller how far they agreed."""
        shadows = self._shadows.get(seq.seq_id)
        if not shadows:
            return
        for shadow in shadows:
            for token in emitted:
                if token != shadow.tokens[shadow.matched]:
                    shadow.done = True
                    break
                shadow.matched += 1
                if shadow.matched == len(shadow.tokens):
                    shadow.done = True
                    break
            if shadow.done:
                self.controller.observe_shadow(shadow.spec_type, len(shadow.tokens), shadow.matched, shadow.confidence,
                                               seq.seq_id)
        self._shadows[seq.seq_id] = [s for s in shadows if not s.done]

    def _tell_accepts(self) -> None:
        """The step's accept calls, for all its sequences together: one hand-off to each
        speculator's thread per step rather than one per sequence (SpeculatorChain.accept_many).
        A speculator that raises for a sequence turns speculation off for it, as _spec_call."""
        pending, self._accepts = self._accepts, []
        if not pending or not self.chain:
            return
        for (seq, _), error in zip(pending, self.chain.accept_many([call for _, call in pending])):
            if error is not None:
                seq.spec_error = f"{type(error).__name__}: {error}"

    def _stats(self, spec_type: str) -> SpecTypeStats:
        return self.spec_stats.setdefault(spec_type, SpecTypeStats())

    def _declined(self, seq: Sequence, spec_type: str) -> None:
        """The controller did not let spec_type draft for seq this step (before or after drafting)."""
        self._stats(spec_type).declined += 1
        seq.stats.n_declined += 1

    def _limits(self, seq: Sequence) -> DraftLimits:
        o, c = seq.spec or _NO_OVERRIDE, self.config
        room = min(c.n_ctx - len(seq.tokens) - 1, seq.max_new_tokens - seq.n_generated - 1)
        return DraftLimits(min(c.draft_n_max if o.n_max is None else o.n_max, room),
                           c.draft_n_min if o.n_min is None else o.n_min, c.draft_p_min if o.p_min is None else o.p_min)

    def _plan(self, request: DraftRequest, spec_type: str) -> DraftLimits:
        """The limits a speculator is asked with: its n_max cut to what pays for the draft's own
        cost and its verification (0: it is not asked, the next one of the chain is)."""
        k = self.controller.plan(spec_type, request.limits.n_max, request.seq.seq_id)
        if k <= 0:
            self._declined(self.sequences[request.seq.seq_id], spec_type)
        return request.limits if k == request.limits.n_max else attrs.evolve(request.limits, n_max=k)

    def _propose_all(self, seqs: list[Sequence]) -> dict[int, Draft | None]:
        """The chain's drafts for all sequences in one batched call, trimmed to what pays off."""
        drafts: dict[int, Draft | None] = {seq.seq_id: None for seq in seqs}
        if self.chain:
            self.chain.revive_due()  # a quarantined speculator whose time is up comes back before it is asked
        forced = self._forced_drafts(seqs)
        drafts.update(forced)
        asking = [seq for seq in seqs if self.chain and seq.spec_error is None and (seq.spec or _NO_OVERRIDE).types != ()
                  and seq.seq_id not in forced]
        requests = [DraftRequest(seq.view(), self._limits(seq)) for seq in asking]
        if not requests:
            return drafts
        only = [(seq.spec or _NO_OVERRIDE).types for seq in asking]
        enabled = self.controller.enabled
        proposals = self.chain.propose_batch(requests, only, self._plan if enabled else None, self._judge if enabled else None)
        for seq, request, p in zip(asking, requests, proposals):
            for spec_type, seconds, n_tokens in p.costs:
                seq.stats.draft_seconds += seconds
                st = self._stats(spec_type)
                st.draft_seconds += seconds
                st.produced += n_tokens
                self.controller.observe_cost(spec_type, seconds, n_tokens, seq.seq_id)
            draft = p.draft
            if draft is None and p.error is None:  # the later speculators drafted nothing (a head unsure
                # of its first token, or declined): a passed-over draft that pays on its own is verified
                draft = next((d for d in p.passed
                              if self.controller.best_length(d.spec_type, len(d), seq.seq_id, d.confidence) > 0), None)
            for passed in p.passed:  # left unverified for a later speculator's: its class still learns from it
                if passed is not draft:
                    self._declined(seq, passed.spec_type)
                    self._shadows.setdefault(seq.seq_id, []).append(_Shadow(passed.spec_type, passed.tokens, passed.confidence))
            if p.error is not None:  # a speculator raised: this sequence goes on without speculation
                seq.spec_error = f"{type(p.error).__name__}: {p.error}"
                continue
            if draft is None or len(draft) < max(1, request.limits.n_min):
                continue
            bad = next((t for t in draft.tokens if not 0 <= t < self.n_vocab), None)
            if bad is not None:  # a broken speculator: never let it reach the target's embedding
                seq.spec_error = f"{draft.spec_type} drafted token id {bad}, outside the vocabulary of {self.n_vocab}"
                continue
            if draft.probs is not None and draft.probs.shape[-1] != self.n_vocab:  # rejection sampling would fail the step
                seq.spec_error = f"{draft.spec_type} drafted probabilities over {draft.probs.shape[-1]} tokens, the vocabulary has {self.n_vocab}"
                continue
            if seq.constraint is not None:  # cut before the first token the constraint rejects
                n_valid = seq.constraint.valid_prefix(draft.tokens)
                if n_valid < max(1, request.limits.n_min):
                    continue
                if n_valid < len(draft):
                    draft = draft.prefix(n_valid)
            keep = self.controller.best_length(draft.spec_type, len(draft), seq.seq_id, draft.confidence)
            if keep == 0:  # not worth its verification rows: the step decodes plainly
                self._declined(seq, draft.spec_type)
                self._shadows.setdefault(seq.seq_id, []).append(_Shadow(draft.spec_type, draft.tokens, draft.confidence))
                continue
            self._proposed[seq.seq_id] = draft  # its length class; the rest, if it is cut
            if keep < len(draft):
                draft = draft.prefix(keep)
            drafts[seq.seq_id] = draft
        return drafts

    def _judge(self, request: DraftRequest, draft: Draft, later: tuple[str, ...]) -> bool:
        """Keep a draft, or pass it over for the chain's `later` speculators? A cheap speculator's
        is passed over where it would not be verified (best_length 0: before, the step then
        decoded plainly, the speculators after it never asked) or where a later costly one is
        expected to do better (rival_rate); if none of them drafts, it is verified after all where
        it pays on its own (_propose_all). A costly one's drafting is paid for: kept."""
        c, seq_id = self.controller, request.seq.seq_id
        if not c.cheap(draft.spec_type):
            return True
        rival = c.rival_rate(later, request.limits.n_max, seq_id)
        return c.best_length(draft.spec_type, len(draft), seq_id, draft.confidence, rival=rival) > 0

    def _forced_drafts(self, seqs: list[Sequence]) -> dict[int, Draft]:
        """The grammar drafter: for each constrained sequence whose constraint forces tokens now,
        those tokens as its draft (no speculator is asked for it). It is not a speculator of the
        chain: `SpecOverride.types` () leaves it on, n_max 0 (no drafts at all) turns it off."""
        out = {}
        for seq in seqs:
            if seq.constraint is None:
                continue
            n_max = self._limits(seq).n_max
            if n_max <= 0:
                continue
            tokens = [t for t in seq.constraint.forced()[:n_max] if 0 <= t < self.n_vocab]
            if tokens:
                out[seq.seq_id] = Draft(tuple(tokens), GRAMMAR_SPEC_TYPE)
        return out

    def _verify(self, seq: Sequence, draft: Draft | None, logits: torch.Tensor, hidden: dict, n_rows: int) -> tuple[list[int], int]:
        """The tokens the step emits for seq and how many of its draft were accepted; the target's
        state cut back to what was kept (or restored, for recurrent state), the speculators told."""
        n_before = len(seq.tokens)
        emitted, n_accepted = verify(seq.sampler, logits, draft, self.eog, seq.constraint)
        # Never past the budget or the context (the draft limits make this a no-op normally).
        budget = min(seq.max_new_tokens - seq.n_generated, self.config.n_ctx - n_before)
        if seq.constraint is not None and len(emitted) > budget:
            seq.constraint.rollback(len(emitted) - budget)
        emitted = emitted[:budget]
        n_accepted = min(n_accepted, len(emitted))
        seq.tokens.extend(emitted)
        if seq.n_logprobs is not None:  # row i of this step's logits produced emitted[i]
            seq.logprobs.extend(token_logprobs(logits, emitted, seq.n_logprobs))

        first_row = seq.n_cached  # the position of this step's first row
        fed_end = seq.n_cached + n_rows  # the state now holds tokens up to here (pending + draft rows)
        kept_end = n_before + n_accepted  # ... of which these are right; the last emitted token is pending
        if self.row_rollback and draft is not None and kept_end < fed_end:
            # The context kept each verification row's state: cut back to the last kept row's.
            self.context.truncate(seq.seq_id, kept_end)
            seq.n_cached = kept_end
            self.recurrent_stats.rollbacks += 1
        elif self.recurrent and draft is not None and kept_end < fed_end:
            # Recurrent state cannot be cut: go back to before the draft; the kept tokens are
            # fed again as the first rows of the next step.
            t0 = time.perf_counter()
            self.context.restore(seq.seq_id, seq.saved)
            self._checkpoint_time(t0)
            self.recurrent_stats.replays += 1
            self.recurrent_stats.replayed_rows += kept_end - seq.n_cached
            self._spec_call(seq, self.chain.checkpoint, seq.view(), "restore")
        else:
            if draft is not None and self.recurrent and seq.saved is not None:
                self._spec_call(seq, self.chain.checkpoint, seq.view(), "discard")
            self.context.truncate(seq.seq_id, kept_end)
            seq.n_cached = kept_end
        seq.saved = None
        if seq.spec_error is None:  # told with the step's other sequences (_tell_accepts)
            self._accepts.append((seq, dict(seq=seq.view(), draft=draft, n_accepted=n_accepted, hidden=hidden,
                                            hidden_start=first_row)))

        seq.stats.n_generated = seq.n_generated
        if emitted and emitted[-1] in self.eog:
            seq.finish_reason = "stop"
        elif seq.n_generated >= seq.max_new_tokens:
            seq.finish_reason = "length"
        elif len(seq.tokens) >= self.config.n_ctx:
            seq.finish_reason = "length"
        return emitted, n_accepted

    # --- convenience -----------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 spec: SpecOverride | None = None, constraint: Constraint | None = None) -> Iterator[int]:
        """Generate for one sequence, yielding tokens as they are accepted."""
        seq = self.add(prompt, max_new_tokens, params, spec, constraint=constraint)
        try:
            while seq.finish_reason is None:
                yield from self.step()[seq.seq_id]
        finally:
            self.last_sequence = seq
            self.release(seq)
