"""Adaptive draft length: pick the k that maximizes expected tokens per second.

Leviathan et al.'s cost model, measured on the fly. With alpha_i the chance that draft token i is
accepted given that the ones before it were, a step that verifies k draft tokens emits
E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j tokens and costs T(k) = t_verify(1 + k rows) + c * k,
c being the speculator's own cost per drafted token. A plain step emits 1 token in t_verify(1).

Two decisions use it:

* before drafting (`plan`): the most tokens worth drafting, with c counted. 0 means "do not ask
  this speculator": a draft model's forwards are the expensive part, so a draft that would not pay
  must not be made at all. c is measured per spec type as seconds spent in the speculator over
  tokens it produced, so calls that produced nothing (a draft model that stopped below p_min at
  its first token, a draft dropped for being shorter than n_min) count too.
* after drafting (`best_length`): how many of the drafted tokens to verify; the drafting is paid
  for then, so only verification cost counts.

A speculator whose call costs under CHEAP_CALL of a plain step (an n-gram or suffix lookup) is
always asked, at its full n_max: declining it saves nothing, and only its draft tells what it is
worth, by the length it chose. A suffix tree drafts a long copy after a long match and a one-token
guess after a short one: with one estimate for both, the guesses' rejections cut the copies short
(per position, a copy's tokens look independent, so 48 tokens of a copy accepted whole are
verified 6 at a time) or the copies' acceptance pays for verifying every guess (a one-token
guess right 15% of the time costs 27% more than a plain step on a Zen 4 core). So a cheap
speculator's draft is judged by the drafts of its length class (1, 2-3, 4-7, 8-15, 16+ tokens as
proposed): verified whole, by the share of such drafts accepted (a copy's tokens stand or fall
together; from CUT_BELOW tokens on, trimmed where fewer rows cost less per token, see
TRIM_MARGIN), or, under CUT_BELOW tokens, cut to the k its class's acceptance by position gives
(a draft sure of its first tokens only), whichever is expected faster, or not at all. A draft's
tokens left unverified (all of it when it was dropped, the rest when it was cut and what was
verified was accepted) still teach its class: the engine compares them with the tokens the
sequence then emits (`observe_shadow`), so a class wins back as soon as its drafts turn right
(the growing drafts of a copy the sequence has started to follow), at no cost.

Acceptance is tracked per sequence and spec type with exponential forgetting, a new sequence
starting from the spec type's over the sequences before it at the weight of one draft
(CARRY_WEIGHT), and declining it on its own drafts only once it made MIN_OWN_DRAFTS of them;
the forward cost per row count, and each speculator's cost, over all sequences.
A declined spec type is still probed now and then so it can win back when text turns repetitive,
as often as PROBE_BUDGET of plain decoding's time pays for (`probe_interval`).
A probe is two drafts in a row for one sequence, and only the second one's cost is counted: a
speculator that was not asked for a while may first catch up on what it missed (a draft model
feeds the tokens of all the steps it sat out), which is not what drafting costs it. For the same
reason a sequence's first call of each speculator is not counted either: it may feed the whole
prompt (a hidden-state head writes a row per prompt token), and counted as drafting, one 935-token
prompt priced an EAGLE3 head at 0.1 s a token, which declined it for the rest of a served
session (3 of 384 steps drafted, 0.92x plain).
"""
from __future__ import annotations

import math

import attrs

DECAY = 0.98  # per observation: acceptance estimates follow the last ~50 drafts
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.5, 1.0  # the first position's prior; each later one shrinks toward the one before
PROBE_EVERY = 16  # at least this many declined drafts in a row before one is let through to refresh the estimate
PROBE_LENGTH = 2
# What probing a declined speculator may cost, as a share of plain decoding's time: its interval
# grows with what a probe costs (its drafting, its catching up, its extra verification rows), so
# a costly draft model is probed seldom and a cheap n-gram lookup often.
PROBE_BUDGET = 0.03
PROBE_EVERY_MAX = 1024
FIRST_DRAFT = 4  # most tokens a spec type drafts before its cost is known (a draft model pays per token)
COST_DECAY = 0.9  # per observation of a speculator's cost: follows the last ~10 calls
CHEAP_CALL = 0.02  # a call costing less than this share of a plain step is always made
# A cheap speculator's draft is dropped only when its class loses more than this share of a plain
# step's rate: near even, verifying is worth more than the step shows (a short draft accepted at
# the start of a copy lets the next one be long; on a code edit a margin of 0.1 made 13 drops of 26).
DROP_MARGIN = 0.05
# A cheap speculator's draft is passed over for a later speculator of the chain (best_length's
# `rival`) when that one's drafts are expected to emit this share more tokens a second. The chain's
# order puts the lookups first (a long copy beats any head), but their one-token guesses then kept
# the head behind them from drafting at all: on free-quicksort-c, AVX2 without AVX-VNNI, suffix's
# guesses (40% right, a verification 1.42x a plain step) took the steps where the MTP head's (74%)
# would have paid, and `copy-edits,suffix,mtp` ran 0.96x of `mtp` alone.
RIVAL_MARGIN = 0.05
# A cheap speculator's drafts of this many tokens or more are verified whole or not at all, never
# cut: they come from long matches, whose tokens stand or fall together, and the acceptance by
# position (independent tokens) cut them to a few tokens a step (served on a Zen 4 core, one run
# in three drafted 1.8 tokens a step, 0.71x the controller off). Shorter drafts may be cut (a
# suffix tree's short matches on extract-table: sure of the first tokens only).
CUT_BELOW = 8
# A long draft is trimmed to fewer tokens where its verification then costs this share less per
# expected token, or more: the kernels take rows in groups (16 on AVX-512), and a row past a
# group costs more than a row inside one. Measured on a Zen 4 core (AVX-512, no AMX), 1.5B, after
# 1500 tokens: 48 rows 389 ms, 49 rows 416; 16 rows 140, 24 rows 256 (what 32 cost). A suffix
# tree's copy of 48 tokens verified as 47 then costs 7.1 instead of 7.5 ms a token (the 48th
# comes with the next step's draft). The margin keeps noise in the costs from flipping the choice.
TRIM_MARGIN = 0.02
# A new sequence starts from its spec type's acceptance over the sequences before it, worth this
# many drafts at the first position: one request's text says little about the next one's (a code
# edit copies, a new function does not), and carried at full weight (~50 drafts) a draft model
# declined on one request stayed declined through the next, where it would have paid (served on a
# Zen 3, draft-simple drafted nothing on free-quicksort-c after code-edit-bisect), and a head
# accepted on one request drafted at a loss well into the next. Worth one draft, a sequence's own
# first drafts decide: replayed on every cost profile (tests/test_adaptive_replay.py), a 90% request
# after a 20% one gained what a fresh controller gains (draft model with AMX 0.68-0.73x plain where
# it had stayed declined at 1.02x; heads 0.49-0.69x where 0.54-0.86x), a 20% one after a 90% one
# lost 1-5% (heads had lost 3-17%). A sequence whose carried estimates decline a speculator still
# probes it once on its own text.
CARRY_WEIGHT = 1.0
# ... and its own first drafts decide only once there are this many: the first tokens of an
# answer are the hardest to guess, and one or two rejected there declined a draft model for the
# rest of a request it would have drafted at 95% (served on the Zen 3, extract-table after
# free-quicksort-c: 6 tokens drafted of 346, 1.11x plain where 1.3x was there). Until then a
# sequence drafts as its spec type's record over all sequences says; the drafts that record
# wrongly pays for cost a few steps' time a request, bounded by this count.
MIN_OWN_DRAFTS = 4
LENGTH_CLASSES = 5  # drafts of 1, 2-3, 4-7, 8-15 and 16+ tokens are estimated apart (best_length)


def length_class(n: int) -> int:
    """The length class of a draft of n >= 1 tokens as its speculator proposed it."""
    return min(LENGTH_CLASSES - 1, n.bit_length() - 1)


# A row count not measured in this many forwards is stale, and a stale estimate above what
# forwards of fresh row counts covering its rows cost is dropped: a forward never costs more than
# smaller ones that take its rows (it reads the weights once, they each), so such an estimate is a slow sample
# (another process, a thread starting) that nothing corrects, since a dropped draft is not
# verified and so never measured again. In process on a Zen 4 core, with the screened head's copy
# loading during the first steps, 3 rows at 134 ms and 5 at 238 (against 70 and 110) kept every
# draft after the third from being verified, for the whole request.
STALE_AFTER = 48
# A forward's sample moves its row count's estimate as if it took at most SPIKE times the estimate:
# on a shared box one forward in a few runs twice as long, and at a row count seldom verified one
# such sample priced it out for the rest of a request (in process on a Zen 4 core, AVX-512, EAGLE3
# on free-quicksort-c: 2 rows at 99.8 ms where 4 rows cost 65.3 and 1 row 57.0, so 3-token drafts
# were verified where 1-token ones cost less). A real rise (a longer context, a slower box) is
# still followed, by up to a tenth a sample.
SPIKE = 1.5


def _interpolate(seconds: dict[int, float], rows: int) -> float | None:
    """The cost of `rows` rows from the measured row counts: linear between the nearest two,
    beyond them along the slope of the nearest two (never falling)."""
    if rows in seconds:
        return seconds[rows]
    known = sorted(seconds)
    if not known:
        return None
    lo = max((r for r in known if r < rows), default=None)
    hi = min((r for r in known if r > rows), default=None)
    if lo is not None and hi is not None:
        w = (rows - lo) / (hi - lo)
        return (1 - w) * seconds[lo] + w * seconds[hi]
    if len(known) >= 2:  # extrapolate from the two nearest points
        a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
        slope = max(0.0, (seconds[b] - seconds[a]) / (b - a))
        ref = b if hi is None else a
        return seconds[ref] + slope * (rows - ref)
    return None


@attrs.define
class ForwardCost:
    """EMA of forward seconds by number of rows, each sample clipped at SPIKE times the estimate;
    unseen row counts interpolate linearly; stale estimates that fresh forwards taking the same
    rows undercut are dropped (STALE_AFTER); no row count costs more than a fresh larger one (a
    forward of more rows does all the work of one of fewer)."""

    seconds: dict[int, float] = attrs.field(factory=dict)
    last_seen: dict[int, int] = attrs.field(factory=dict)  # row count -> `observations` when last measured
    observations: int = 0
    _kept: dict[int, float] = attrs.field(factory=dict, init=False, repr=False)  # the table cost() reads,
    _kept_at: int = attrs.field(default=-1, init=False, repr=False)              # as of this many observations

    def observe(self, rows: int, seconds: float) -> None:
        self.observations += 1
        self.last_seen[rows] = self.observations
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * min(seconds, SPIKE * old)

    def cost(self, rows: int) -> float | None:
        return _interpolate(self._table(), rows)

    def measured(self) -> list[int]:
        """The row counts whose cost is measured (not interpolated), ascending."""
        return sorted(self._table())

    def _table(self) -> dict[int, float]:
        if self._kept_at != self.observations:  # made once per observation: cost() is asked for many row counts a step
            self._kept, self._kept_at = self._current(), self.observations
        return self._kept

    def _current(self) -> dict[int, float]:
        """The estimates, less the stale ones that fresh forwards covering their rows undercut,
        each at most what the next larger fresh row count costs."""
        fresh = {r: s for r, s in self.seconds.items() if self.observations - self.last_seen[r] < STALE_AFTER}
        kept = dict(self.seconds)
        if fresh and len(fresh) < len(self.seconds):
            # cover[r]: the cheapest fresh forwards that together take r rows or more
            top = max(self.seconds)
            cover = [0.0] + [math.inf] * top
            for r in range(1, top + 1):
                cover[r] = min(fresh[a] + cover[max(0, r - a)] for a in fresh)
            kept = {r: s for r, s in kept.items() if r in fresh or s <= cover[r]}
        # Costs never fall with the rows: a slow sample at a row count that larger fresh ones
        # undercut is capped at theirs (only fresh ones cap: the cost grows with the context).
        # Where more rows take a cheaper kernel path (AMX from its threshold), the row count
        # below it is priced at the larger one's cost, under its own.
        cap = math.inf
        for r in sorted(kept, reverse=True):
            kept[r] = min(kept[r], cap)
            if r in fresh:
                cap = kept[r]
        return kept


@attrs.define
class Acceptance:
    """Decayed counts of tried/accepted per draft position for one spec type."""

    tried: list[float] = attrs.field(factory=list)
    accepted: list[float] = attrs.field(factory=list)

    def observe(self, draft_len: int, n_accepted: int) -> None:
        n = max(len(self.tried), draft_len)
        self.tried = [t * DECAY for t in self.tried] + [0.0] * (n - len(self.tried))
        self.accepted = [a * DECAY for a in self.accepted] + [0.0] * (n - len(self.accepted))
        for i in range(min(n_accepted + 1, draft_len)):  # position i was tried if all before it were accepted
            self.tried[i] += 1
            if i < n_accepted:
                self.accepted[i] += 1

    def alphas(self, n: int) -> list[float]:
        """Estimates for positions 0..n-1, each shrunk toward the one before it: a position
        seldom tried (because drafts have been short) is taken to behave like the one before it.
        Shrinking toward a fixed prior instead would keep drafts short for ever: a position
        never tried keeps the prior's pessimism and so is never tried."""
        out, prior = [], PRIOR_ACCEPT
        for i in range(n):
            t = self.tried[i] if i < len(self.tried) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            prior = (a + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def alpha(self, i: int) -> float:
        return self.alphas(i + 1)[i]

    def carried(self, weight: float) -> Acceptance:
        """A copy worth at most `weight` drafts at the first position (ratios kept): what a new
        sequence starts from, soon outweighed by its own drafts."""
        first = self.tried[0] if self.tried else 0.0
        scale = min(1.0, weight / first) if first > 0 else 1.0
        return Acceptance([t * scale for t in self.tried], [a * scale for a in self.accepted])


# A costly speculator's draft that says how sure it is of each token (`Draft.confidence`) is cut
# where its tokens' chances, read off how often tokens of such confidence were right, stop paying
# for their verification rows (or not verified at all): the chances by position alone cannot tell
# a sure draft from a guess. Lower edges of the confidence bins; a bin's prior is its midpoint,
# worth CALIBRATION_PRIOR tokens.
CONFIDENCE_BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
CALIBRATION_PRIOR = 2.0


def confidence_bin(c: float) -> int:
    return max(i for i, edge in enumerate(CONFIDENCE_BINS) if c >= edge or i == 0)


@attrs.define
class Calibration:
    """Decayed counts, per confidence bin, of a speculator's draft tokens tried (all before them
    right) and right."""

    tried: list[float] = attrs.field(factory=lambda: [0.0] * len(CONFIDENCE_BINS))
    right: list[float] = attrs.field(factory=lambda: [0.0] * len(CONFIDENCE_BINS))

    def observe(self, confidence: tuple[float, ...], n_tokens: int, n_right: int) -> None:
        self.tried = [t * DECAY for t in self.tried]
        self.right = [r * DECAY for r in self.right]
        for i in range(min(n_right + 1, n_tokens, len(confidence))):
            b = confidence_bin(confidence[i])
            self.tried[b] += 1
            self.right[b] += i < n_right

    def chance(self, c: float) -> float:
        """How likely a token drafted with confidence c is right (all before it being right)."""
        b = confidence_bin(c)
        upper = CONFIDENCE_BINS[b + 1] if b + 1 < len(CONFIDENCE_BINS) else 1.0
        prior = (CONFIDENCE_BINS[b] + upper) / 2
        return (self.right[b] + prior * CALIBRATION_PRIOR) / (self.tried[b] + CALIBRATION_PRIOR)


@attrs.define
class ClassAcceptance:
    """Decayed count of one length class's drafts (of a cheap speculator) and sum of the share of
    each that was accepted (or, unverified, matched what the sequence emitted)."""

    drafts: float = 0.0
    shares: float = 0.0

    def observe(self, n_tokens: int, n_accepted: int) -> None:
        self.drafts = DECAY * self.drafts + 1
        self.shares = DECAY * self.shares + n_accepted / n_tokens

    def share(self) -> float:
        """The share of a draft of this class expected accepted (the prior: half)."""
        return (self.shares + PRIOR_ACCEPT * PRIOR_WEIGHT) / (self.drafts + PRIOR_WEIGHT)


@attrs.define
class DraftCost:
    """Decayed sums of a speculator's seconds and the tokens it produced in them."""

    seconds: float = 0.0
    tokens: float = 0.0
    calls: float = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        self.seconds = COST_DECAY * self.seconds + seconds
        self.tokens = COST_DECAY * self.tokens + tokens
        self.calls = COST_DECAY * self.calls + 1

    def per_call(self) -> float:
        return self.seconds / max(self.calls, 1.0)

    def per_token(self) -> float:
        # Calls that produced nothing still cost: with no tokens yet, count as if one was made.
        return self.seconds / max(self.tokens, 1.0)


@attrs.define
class DraftLengthController:
    enabled: bool = True
    forward: ForwardCost = attrs.field(factory=ForwardCost)
    acceptance: dict[str, Acceptance] = attrs.field(factory=dict)  # over all sequences: a new one's start
    seq_acceptance: dict[tuple[str, int], Acceptance] = attrs.field(factory=dict)  # (spec type, sequence)
    by_length: dict[tuple[str, int], ClassAcceptance] = attrs.field(factory=dict)  # (spec type, length class)
    by_length_position: dict[tuple[str, int], Acceptance] = attrs.field(factory=dict)  # the same, by position
    costs: dict[str, DraftCost] = attrs.field(factory=dict)
    calibration: dict[str, Calibration] = attrs.field(factory=dict)  # spec type -> its confidences' worth
    declined_in_a_row: dict[str, int] = attrs.field(factory=dict)
    probing: dict[tuple[str, int], int] = attrs.field(factory=dict)  # (spec type, sequence) -> probe drafts to go
    catch_up: dict[str, float] = attrs.field(factory=dict)  # spec type -> seconds of its last probe's first call
    seen: set[tuple[str, int]] = attrs.field(factory=set)  # (spec type, sequence) whose first call is behind
    tried_here: set[tuple[str, int]] = attrs.field(factory=set)  # (spec type, sequence) drafted or probed for already
    declined_last: set[tuple[str, int]] = attrs.field(factory=set)  # (spec type, sequence) whose last plan was 0
    resuming: set[tuple[str, int]] = attrs.field(factory=set)  # ... and then asked again: its next call catches up
    own_drafts: dict[tuple[str, int], int] = attrs.field(factory=dict)  # (spec type, sequence) -> its drafts judged
    # A recurrent target without per-row states (checkpoint/replay): every verification pays a
    # checkpoint save (and, on a rejection, its restore), and the kept tokens of a partly
    # accepted draft are computed again as rows of the next step.
    replay: bool = False
    checkpoint: DraftCost = attrs.field(factory=DraftCost)

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.forward.observe(rows, seconds)

    def observe_draft(self, spec_type: str, n_drafted: int, n_accepted: int, proposed: int | None = None,
                      share_known: bool = True, seq_id: int = 0, confidence: tuple[float, ...] | None = None) -> None:
        """A verified draft: n_drafted tokens, the first n_accepted of them accepted; `proposed`:
        its length as the speculator proposed it, before best_length (default n_drafted). Not
        `share_known`: it was cut and all of it accepted, and the rest is being compared with what
        the sequence emits (observe_shadow gives its class the whole draft's share). `confidence`:
        the draft's, for its tokens' calibration."""
        if confidence:
            self.calibration.setdefault(spec_type, Calibration()).observe(confidence, n_drafted, n_accepted)
        self.tried_here.add((spec_type, seq_id))
        if share_known or self.cheap(spec_type):  # else its shadow tells how far the whole draft was right
            self._observe_positions(spec_type, seq_id, n_drafted, n_accepted)
        key = (spec_type, length_class(proposed or n_drafted))
        self.by_length_position.setdefault(key, Acceptance()).observe(n_drafted, n_accepted)
        if share_known:
            self.by_length.setdefault(key, ClassAcceptance()).observe(proposed or n_drafted, n_accepted)

    def _observe_positions(self, spec_type: str, seq_id: int, n_drafted: int, n_accepted: int) -> None:
        self.own_drafts[(spec_type, seq_id)] = self.own_drafts.get((spec_type, seq_id), 0) + 1
        self._acceptance(spec_type, seq_id).observe(n_drafted, n_accepted)
        self.acceptance.setdefault(spec_type, Acceptance()).observe(n_drafted, n_accepted)

    def observe_shadow(self, spec_type: str, proposed: int, n_matched: int,
                       confidence: tuple[float, ...] | None = None, seq_id: int = 0) -> None:
        """A draft of `proposed` tokens that best_length left unverified (or cut, and the part
        verified was accepted): set against what the sequence emitted, its first n_matched tokens
        were the same. Its confidences (the whole draft's) are calibrated by it too:
        a guess that was not verified still says what such guesses are worth. A costly speculator's
        shadow is its whole draft's outcome for the acceptance by position, which `plan` drafts by:
        counted only as far as it was verified, a draft cut to its sure tokens would look surer
        than the speculator is."""
        if confidence:
            self.calibration.setdefault(spec_type, Calibration()).observe(confidence, len(confidence),
                                                                          min(n_matched, len(confidence)))
        if not self.cheap(spec_type):
            self._observe_positions(spec_type, seq_id, proposed, n_matched)
            return
        self.by_length.setdefault((spec_type, length_class(proposed)), ClassAcceptance()).observe(proposed, n_matched)

    def observe_cost(self, spec_type: str, seconds: float, n_tokens: int, seq_id: int = 0) -> None:
        """One call of a speculator for one sequence: its seconds and the tokens it produced (0 too).
        The sequence's first call, a probe's first call and the first call after a decline catch
        up on the history (not counted)."""
        key = (spec_type, seq_id)
        probe_start = self.probing.get(key) == 2  # a probe's first draft: catching up, not drafting
        if probe_start:
            self.probing[key] = 1
        resumed = key in self.resuming  # asked again after a decline: catching up first
        self.resuming.discard(key)
        if key not in self.seen:  # the sequence's first call: the prompt's catch-up
            self.seen.add(key)
            return
        if probe_start:
            self.catch_up[spec_type] = seconds  # what the next probe's interval must pay for
            return
        if resumed:
            return
        self.probing.pop(key, None)
        self.costs.setdefault(spec_type, DraftCost()).observe(seconds, n_tokens)

    def observe_checkpoint(self, seconds: float) -> None:
        """A checkpoint's save or restore took `seconds` (the cost of a draft on a recurrent target)."""
        self.checkpoint.observe(seconds, 1)

    def forget(self, seq_id: int) -> None:
        """The sequence ended: drop a probe left unfinished for it, its acceptance estimates and its
        first calls' marks."""
        for key in [k for k in self.probing if k[1] == seq_id]:
            del self.probing[key]
        for key in [k for k in self.seq_acceptance if k[1] == seq_id]:
            del self.seq_acceptance[key]
        self.tried_here = {k for k in self.tried_here if k[1] != seq_id}
        self.declined_last = {k for k in self.declined_last if k[1] != seq_id}
        self.resuming = {k for k in self.resuming if k[1] != seq_id}
        self.own_drafts = {k: n for k, n in self.own_drafts.items() if k[1] != seq_id}
        self.seen = {k for k in self.seen if k[1] != seq_id}

    def draft_cost(self, spec_type: str) -> float:
        """Measured seconds per drafted token (0 before any measurement)."""
        c = self.costs.get(spec_type)
        return 0.0 if c is None else c.per_token()

    def cheap(self, spec_type: str) -> bool:
        """Does a call of the speculator cost under CHEAP_CALL of a plain step (measured)? Never
        on the replay path, where a verified draft also costs a checkpoint: plan counts it."""
        c, t1 = self.costs.get(spec_type), self.forward.cost(1)
        return not self.replay and c is not None and t1 is not None and c.per_call() < CHEAP_CALL * t1

    def _acceptance(self, spec_type: str, seq_id: int) -> Acceptance:
        """The sequence's acceptance estimates for the spec type: its own drafts', begun from the
        spec type's over all sequences worth CARRY_WEIGHT drafts (see CARRY_WEIGHT)."""
        key = (spec_type, seq_id)
        acc = self.seq_acceptance.get(key)
        if acc is None:
            acc = self.seq_acceptance[key] = self.acceptance.get(spec_type, Acceptance()).carried(CARRY_WEIGHT)
        return acc

    def _best(self, spec_type: str, n: int, cost_per_token: float, optimistic: bool = False,
              acc: Acceptance | None = None, seq_id: int = 0) -> tuple[int, float] | None:
        """(k, E(k) / T(k)) for the k in 0..n that maximizes it (acceptance `acc`, default the
        sequence's for the spec type); None before the forward cost is known. With
        `optimistic`, a verification whose cost is not known yet is taken to cost what a plain
        step does (a lower bound): a draft that does not pay even then is declined, any other
        is verified and so measured."""
        t1 = self.forward.cost(1)
        if t1 is None or (self.forward.cost(2) is None and not optimistic):
            return None
        acc = acc or self._acceptance(spec_type, seq_id)
        best_k, best_rate = 0, 1.0 / t1
        expected, p = 1.0, 1.0
        alphas = acc.alphas(n)
        # Replay: a save and, unless all k are accepted, a restore, plus j rows fed again when
        # exactly j were accepted (j < k) -- each j's chance is p_j (1 - alpha_{j+1}).
        save = self.checkpoint.per_token() if self.replay else 0.0
        replay_by_j = [0.0] * (n + 1)  # sum over j < k of P(exactly j accepted) (restore + t(1 + j) - t(1))
        for k in range(1, n + 1):
            p_before = p
            p *= alphas[k - 1]
            expected += p
            if self.replay:
                j = k - 1
                extra = max(0.0, (self.forward.cost(1 + j) or t1) - t1) + save
                replay_by_j[k] = replay_by_j[k - 1] + p_before * (1 - alphas[k - 1]) * extra
            t = self.forward.cost(1 + k)
            rate = expected / ((t1 if t is None else t) + cost_per_token * k + save + replay_by_j[k])
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def plan(self, spec_type: str, n_max: int, seq_id: int = 0) -> int:
        """How many tokens the speculator may draft for the sequence (0: do not ask it), its own
        cost counted. A speculator asked again after being declined first catches up on the tokens
        it sat out (a draft model feeds them): that call's seconds are not its drafting cost
        (observe_cost), as a probe's first call's are not."""
        k = self._plan(spec_type, n_max, seq_id)
        key = (spec_type, seq_id)
        if k <= 0:
            self.declined_last.add(key)
        elif key in self.declined_last:
            self.declined_last.discard(key)
            self.resuming.add(key)
        return k

    def _plan(self, spec_type: str, n_max: int, seq_id: int) -> int:
        if not self.enabled or n_max <= 0:
            return n_max
        if not self.forward.seconds:
            return 0  # nothing measured yet: one plain step gives the cost all drafts are compared with
        if spec_type not in self.costs:
            return min(n_max, FIRST_DRAFT)  # a first, short draft measures what the speculator costs
        if (spec_type, seq_id) in self.probing:
            return min(n_max, PROBE_LENGTH)  # the probe's second draft, whose cost is measured
        if self.cheap(spec_type):
            return n_max  # its draft decides (best_length)
        best = self._best(spec_type, n_max, self.draft_cost(spec_type), optimistic=True, seq_id=seq_id)
        if best is None:
            return n_max  # learn: verify and measure
        k = best[0]
        if k == 0 and self.own_drafts.get((spec_type, seq_id), 0) < MIN_OWN_DRAFTS:
            # Declined on a few drafts of its own, against the spec type's record: draft on as
            # that record says until the sequence's own evidence decides (see MIN_OWN_DRAFTS).
            past = self._best(spec_type, n_max, self.draft_cost(spec_type), optimistic=True,
                              acc=self.acceptance.get(spec_type))
            if past is not None and past[0] > 0:
                self.tried_here.add((spec_type, seq_id))
                self.declined_in_a_row[spec_type] = 0
                return past[0]
        if k == 0 and (spec_type, seq_id) not in self.tried_here:
            # Declined on the strength of earlier sequences alone: probe once on this one's text
            # (a draft model caught up on its prompt in `begin`, so this costs two short drafts).
            self.tried_here.add((spec_type, seq_id))
            self.probing[(spec_type, seq_id)] = 2
            return min(n_max, PROBE_LENGTH)
        self.tried_here.add((spec_type, seq_id))
        if k == 0:
            streak = self.declined_in_a_row.get(spec_type, 0) + 1
            self.declined_in_a_row[spec_type] = streak
            if streak >= self.probe_interval(spec_type):
                self.declined_in_a_row[spec_type] = 0
                self.probing[(spec_type, seq_id)] = 2
                return min(n_max, PROBE_LENGTH)
            return 0
        self.declined_in_a_row[spec_type] = 0
        return k

    def probe_interval(self, spec_type: str) -> int:
        """Declined drafts in a row before a probe: enough plain steps that the probe's cost, if
        it finds nothing, stays within PROBE_BUDGET of their time. A probe costs its catching up
        (as the last one measured), two drafts of PROBE_LENGTH tokens and two verifications of
        PROBE_LENGTH rows more than a plain step's. (Catching up grows with the interval: a draft
        model feeds every token it sat out. That share, its prefill cost over the target's decode
        cost, about 3-4% for the 0.5B under the 1.5B, is the floor of what a declined draft model
        costs while it may still be probed.)"""
        t1 = self.forward.cost(1)
        if not t1:
            return PROBE_EVERY
        extra_rows = max(0.0, (self.forward.cost(1 + PROBE_LENGTH) or t1) - t1)
        probe = self.catch_up.get(spec_type, 0.0) + 2 * (PROBE_LENGTH * self.draft_cost(spec_type) + extra_rows)
        return int(min(PROBE_EVERY_MAX, max(PROBE_EVERY, math.ceil(probe / (PROBE_BUDGET * t1)))))

    def rival_rate(self, spec_types: tuple[str, ...], n_max: int, seq_id: int = 0) -> float | None:
        """The best expected rate (tokens a second, as `plan` would have them draft) among the
        costly speculators named; None where there is none. A cheap one's worth shows only in its
        draft, so it is no rival. One not measured yet is infinitely good: its first calls
        measure it (best_length lets that take a guess's step, never a copy's)."""
        best = None
        for spec_type in spec_types:
            if spec_type not in self.costs:
                return math.inf
            if self.cheap(spec_type):
                continue
            found = self._best(spec_type, n_max, self.draft_cost(spec_type), seq_id=seq_id)
            if found is not None and (best is None or found[1] > best):
                best = found[1]
        return best

    def best_length(self, spec_type: str, n: int, seq_id: int = 0, confidence: tuple[float, ...] | None = None,
                    rival: float | None = None) -> int:
        """How many of the n drafted tokens are worth verifying. A costly speculator's draft: at
        least 1 (the decision to draft was `plan`'s, and the drafting is paid for). A cheap one's:
        all, a trim or a cut, or 0, by its length class (see the module's doc); 0: the step decodes
        plainly, or, where `rival` (rival_rate of the speculators after it) beats its expected rate
        by RIVAL_MARGIN, one of those drafts instead (an unmeasured rival takes only a guess's
        step: one of fewer than CUT_BELOW tokens)."""
        if not self.enabled or n == 0:
            return n
        if not self.cheap(spec_type):
            # (on the replay path a verification also costs a checkpoint, which only _best counts)
            if confidence is not None and len(confidence) >= n and not self.replay:
                return self._by_confidence(spec_type, n, confidence)
            best = self._best(spec_type, n, 0.0, seq_id=seq_id)
            return n if best is None else max(1, best[0])
        t1, tn = self.forward.cost(1), self.forward.cost(1 + n)
        if t1 is None or tn is None or (n >= CUT_BELOW and 1 + n > self.forward.measured()[-1]):
            # Past the largest row count measured: learn (verify it whole, and so measure it). The
            # cost there is extrapolated along the slope of the per-row kernels, where the tiled
            # ones from 8 rows cost less a row (in process on a Zen 4 core: 10 rows priced 133 ms
            # from 5 and 6 rows' 78 and 89, where they cost 120), and a copy's drafts declined on
            # that were never verified, and so never measured, until one was 16 tokens long.
            return n
        key = (spec_type, length_class(n))
        share = self.by_length.get(key, ClassAcceptance()).share()
        best_k, best_rate = n, (1 + share * n) / tn  # whole
        if n < CUT_BELOW:  # cut (k = 0: plain beats every cut)
            cut = self._best(spec_type, n, 0.0, acc=self.by_length_position.get(key, Acceptance()))
            if cut is not None and cut[0] and cut[1] > best_rate:
                best_k, best_rate = cut
        else:
            best_k, best_rate = self._trim(n, share, best_rate)
        if rival is not None and rival > best_rate * (1 + RIVAL_MARGIN) and (rival < math.inf or n < CUT_BELOW):
            return 0
        return best_k if best_rate > (1 - DROP_MARGIN) / t1 else 0

    def _by_confidence(self, spec_type: str, n: int, confidence: tuple[float, ...]) -> int:
        """A costly speculator's draft cut where its tokens' calibrated chances stop paying for
        their rows (0: not verified; the drafting is paid for either way)."""
        t1 = self.forward.cost(1)
        if t1 is None or self.forward.cost(2) is None:
            return n  # learn: verify and measure
        calibration = self.calibration.get(spec_type, Calibration())
        best_k, best_rate = 0, 1.0 / t1
        expected, p = 1.0, 1.0
        for k in range(1, n + 1):
            p *= calibration.chance(confidence[k - 1])
            expected += p
            rate = expected / self.forward.cost(1 + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _trim(self, n: int, share: float, whole_rate: float) -> tuple[int, float]:
        """A long draft of n tokens (share: its class's acceptance) trimmed to the k >= CUT_BELOW
        whose verification costs least per expected token, where that beats verifying it whole by
        TRIM_MARGIN; else (n, whole_rate). Only measured row counts can be cheaper per row than
        their neighbours (between two, the cost is interpolated linearly, and the rate is monotonic
        along a line), so they are the candidates."""
        best_k, best_rate = n, whole_rate
        for rows in self.forward.measured():
            k = rows - 1
            if CUT_BELOW <= k < n:
                rate = (1 + share * k) / self.forward.cost(rows)
                if rate > best_rate and rate > whole_rate * (1 + TRIM_MARGIN):
                    best_k, best_rate = k, rate
        return best_k, best_rate
