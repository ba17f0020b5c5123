"""The engine thread: the only code that touches the Engine.

Requests arrive as Jobs in a bounded queue. Between two engine steps the thread admits waiting
jobs into free slots (``-np``), drops cancelled ones (their sequence is released at once, which
frees the slot), runs one ``Engine.step()`` for all active sequences together, and turns each
sequence's new tokens into text (UTF-8 completed, stop strings cut) that it hands to the job's
``emit`` callback (the app's asyncio side, through ``loop.call_soon_threadsafe``).

Events a job receives, in order: ("start", slot), then ("text", str, logprobs) any number of
times (logprobs: None, or the TokenLogprob of each token that this text delta comes from, when the
job asked for them), then either ("done", Done) or ("error", ApiError). A cancelled job receives
nothing more.

A request for n choices is n jobs: the first is queued with the others as its `siblings`, and all
are admitted together once n slots are free (the queue is first come, first served: the requests
behind it wait too). The siblings share the first job's prompt rows (Engine.add(fork_of=)): the
prompt is prefilled once.

Other work on the engine or the slot cache (the slot actions save, restore, erase) goes through
``call``: the engine thread runs it between two steps and hands back its result or exception.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable

import attrs

from speculant.engine import Engine, Sequence, SpecOverride, SpecTypeStats
from speculant.errors import LimitError
from speculant.logs import get_logger
from speculant.sampling import SamplingParams

from speculant_server.protocol import ApiError
from speculant_server.slot_cache import SlotCache
from speculant_server.text import TextPipeline

log = get_logger("speculant.server")


class QueueFull(Exception):
    pass


@attrs.define
class Done:
    finish_reason: str  # "stop" or "length" (OpenAI's words)
    stop_type: str  # llama-server's: "eos", "word" or "limit"
    stopping_word: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict
    slot: int
    cached_tokens: int = 0  # of the prompt, taken from the prompt cache


@attrs.define(eq=False)
class Job:
    id: str
    endpoint: str
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stops: list[str]
    emit: Callable[[tuple], None]
    spec: SpecOverride | None = None
    cache_prompt: bool = True  # continue from a kept state sharing a prefix with the prompt (llama-server's field)
    settings: dict = attrs.field(factory=dict)  # what /slots shows
    logprobs: int | None = None  # record logprobs with this many top tokens (None: none)
    constraint: Any = None  # a speculant.Constraint for structured output (its own, one per job)
    siblings: list["Job"] = attrs.field(factory=list)  # the other choices of an n > 1 request, admitted with this one
    cancelled: bool = False
    aborted: bool = False  # cancelled by the server's shutdown, not by its client (abort_running)
    finished: bool = False
    slot: int | None = None
    seq: Sequence | None = None
    pipeline: TextPipeline | None = None
    n_generated: int = 0
    t_queued: float = attrs.field(factory=time.perf_counter)
    t_start: float | None = None
    t_first: float | None = None
    error: ApiError | None = None  # why it could not start


@attrs.define
class Totals:
    """Counters over the server's life, read by the /metrics collector (plain numbers: reads are atomic)."""

    prompt_tokens: int = 0  # prefilled, the tokens taken from the prompt cache not counted (as llama-server)
    prompt_tokens_cached: int = 0  # taken from the prompt cache instead
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0  # engine steps
    busy_slots: int = 0  # summed over steps, for the mean busy slots per step
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    n_tokens_max: int = 0  # the longest sequence seen (prompt + generated)
    spec: dict[str, SpecTypeStats] = attrs.field(factory=dict)  # a copy of engine.spec_stats after each step


class EngineWorker:
    def __init__(self, engine: Engine, n_slots: int, queue_size: int, cache_ram: int | None = 8192 << 20,
                 slot_similarity: float = 0.1):
        self.engine = engine
        self.n_slots = n_slots
        self.cache = SlotCache(engine, n_slots, cache_ram, slot_similarity)
        self.queue_size = queue_size
        self.tokenizer = engine.model.tokenizer
        self.slots: list[Job | None] = [None] * n_slots
        self.totals = Totals()
        self.spec_types = [getattr(s, "spec_type", type(s).__name__) for s in engine.chain.speculators]
        self._pending: collections.deque[Job] = collections.deque()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # see call()
        self._cond = threading.Condition()
        self._stopping = False
        self.draining = False  # shutting down: no new jobs or calls, the running jobs may finish (begin_shutdown)
        self.died: str | None = None  # what killed the engine thread, if something did
        self.on_death: Callable[[], None] | None = None  # then called once its requests are failed (serve: exit)
        self._thread = threading.Thread(target=self._run, name="speculant-engine", daemon=True)

    # --- called from the event loop ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def free_slots(self) -> int:
        return sum(1 for j in self.slots if j is None)

    def n_waiting(self) -> int:
        return max(0, sum(1 + len(j.siblings) for j in list(self._pending)) - self.free_slots())

    def n_processing(self) -> int:
        return self.n_slots - self.free_slots()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when `queue_size` requests already wait for a slot."""
        with self._cond:
            if self.died is not None:
                raise self._refusal()
            if self._stopping or self.draining:
                raise ApiError(503, "the server is shutting down")
            if len(self._pending) >= self.queue_size + self.free_slots():  # an n-choice request counts once
                raise QueueFull(f"all {self.n_slots} slots are busy and {len(self._pending)} requests are waiting")
            self._pending.append(job)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps, before waiting requests are admitted
        (only that thread may touch the engine and the slot cache); the future gets its result or
        exception (await it with asyncio.wrap_future). A future cancelled before its turn is skipped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self.draining:
                future.set_exception(self._refusal() if self.died is not None else ApiError(503, "the server is shutting down"))
                return future
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def begin_shutdown(self) -> None:
        """Stop admitting work: new jobs and calls get 503, as do the jobs still waiting for a slot
        (they have not started; a client can retry elsewhere). The running jobs go on."""
        with self._cond:
            self.draining = True
            waiting, self._pending = [j for lead in self._pending for j in (lead, *lead.siblings)], collections.deque()
        for job in waiting:
            job.finished = True
            job.emit(("error", ApiError(503, "the server is shutting down")))

    def running(self) -> list[Job]:
        """The jobs in slots whose client still waits for them."""
        return [j for j in list(self.slots) if j is not None and not j.finished and not j.cancelled]

    def abort_running(self, error: ApiError) -> int:
        """Fail every running job now, from the event loop (the engine may be in the middle of a
        step): its client gets `error` at once, the engine thread drops the job before its next
        step as it does a cancelled one. Returns how many there were."""
        jobs = self.running()
        for job in jobs:
            job.aborted = job.cancelled = True
            job.emit(("error", error))
        with self._cond:
            self._cond.notify()
        return len(jobs)

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, else release its sequence before the next step."""
        job.cancelled = True
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                pass
            for sib in job.siblings:
                sib.cancelled = True
            self._cond.notify()

    # --- the engine thread ---------------------------------------------------------------------
    def _active(self) -> list[Job]:
        return [j for j in self.slots if j is not None]

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._iteration():
                        break
                except Exception:  # a bug here must not stop the server: log it and go on
                    log.exception("engine thread error")
                    time.sleep(0.01)
        except BaseException as e:  # the thread dies anyway: refuse work rather than queue it forever
            self.died = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.critical("the engine thread died; the server refuses new requests", error=self.died, exc_info=True)
            self._drain(ApiError(500, f"generation failed: the engine thread died ({self.died})"), self._refusal())
            if self.on_death is not None:
                self.on_death()
            return
        self._drain(ApiError(503, "the server is shutting down"), ApiError(503, "the server is shutting down"))

    def _refusal(self) -> ApiError:
        return ApiError(503, f"the engine thread is not running ({self.died}); the server must be restarted")

    def _drain(self, active_error: ApiError, waiting_error: ApiError) -> None:
        """Fail every job and call the engine thread holds or that waits for it (it is ending)."""
        with self._cond:
            self._stopping = True  # submit and call refuse from now on
            waiting, self._pending = [j for lead in self._pending for j in (lead, *lead.siblings)], collections.deque()
            calls, self._calls = self._calls, []
        for job in self._active():
            try:
                if job.cancelled:  # its client is gone, or has had its error (abort_running)
                    self._finish(job, "shutdown" if job.aborted else "cancelled", "none", "")
                else:
                    self._fail(job, active_error)
            except BaseException:  # the engine is broken: the client must hear of it anyway
                self.slots[job.slot] = None
                job.emit(("error", active_error))
        for job in waiting:
            job.emit(("error", waiting_error))
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(waiting_error)

    def _iteration(self) -> bool:
        """Admit, drop cancelled jobs, run one step and deliver its tokens. False: stop."""
        with self._cond:
            while not self._stopping and not self._pending and not self._active() and not self._calls:
                self._cond.wait()
            if self._stopping:
                return False
            calls, self._calls = self._calls, []
        # Before admission: a call sees the slots as the last step left them (a restore into a
        # slot that is about to get a request would otherwise pass its idle check), and a request
        # admitted now sees what the call did (it continues from a restored state).
        for fn, future in calls:
            self._call(fn, future)
        with self._cond:
            admit = []
            free = [i for i, j in enumerate(self.slots) if j is None]
            while self._pending and free:
                job = self._pending[0]
                if not job.cancelled and 1 + len(job.siblings) > len(free):
                    break  # an n-choice request waits for n free slots, and the requests behind it with it
                self._pending.popleft()
                if not job.cancelled:
                    slot = self.cache.pick_slot(job.prompt, free) if job.cache_prompt else self.cache.pick_slot([], free)
                    free.remove(slot)
                    group = [(slot, job)]
                    for sib in job.siblings:  # the least recently used slots; their kept states go to the LRU
                        s = self.cache.pick_slot([], free)
                        free.remove(s)
                        group.append((s, sib))
                    admit.append(group)
        for group in admit:
            (slot, job), rest = group[0], group[1:]
            self._start(job, slot)
            for s, sib in rest:
                if job.seq is None:  # the first could not start: neither can its siblings
                    sib.finished = True
                    if job.error is not None and not sib.cancelled:
                        sib.emit(("error", job.error))
                elif not sib.cancelled:
                    self._start(sib, s, fork_of=job.seq)
        for job in self._active():
            if job.cancelled:
                self._finish(job, "shutdown" if job.aborted else "cancelled", "none", "")
        active = self._active()
        if not active:
            return True
        try:
            new = self.engine.step()
        except Exception as e:  # not a request's fault that we can pin down: fail the step's requests, keep serving
            log.exception("engine step failed", requests=[j.id for j in active])
            for job in active:
                self._fail(job, ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
            return True
        t = self.totals
        t.n_decode += 1
        t.busy_slots += len(active)
        t.spec = {k: attrs.evolve(v, accepted_at=list(v.accepted_at)) for k, v in self.engine.spec_stats.items()}
        for job in active:
            try:
                self._deliver(job, new.get(job.seq.seq_id, ()))
            except Exception as e:
                log.exception("delivering tokens failed", id=job.id)
                self._fail(job, ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
        return True

    def _call(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():  # the caller is gone
            return
        try:
            future.set_result(fn())
        except Exception as e:  # the caller's to handle; the engine thread goes on
            future.set_exception(e)

    def _start(self, job: Job, slot: int, fork_of: Sequence | None = None) -> None:
        cached = self.cache.take(slot, job.prompt, job.cache_prompt and fork_of is None)
        try:
            seq = self.engine.add(job.prompt, job.max_new_tokens, job.params, job.spec, cached=cached,
                                  logprobs=job.logprobs, fork_of=fork_of, constraint=job.constraint)
        except LimitError as e:  # raised before the entry is touched: the slot keeps it
            self.cache.put(slot, cached)
            job.finished = True
            job.error = ApiError(400, str(e))
            job.emit(("error", job.error))
            return
        except Exception as e:
            log.exception("could not start a request", id=job.id)
            self.cache.put(slot, cached)
            job.finished = True
            job.error = ApiError(500, f"could not start the request: {type(e).__name__}: {e}")
            job.emit(("error", job.error))
            return
        job.seq, job.slot, job.t_start = seq, slot, time.perf_counter()
        job.pipeline = TextPipeline(self.tokenizer, job.stops, self.engine.eog)
        self.slots[slot] = job
        job.emit(("start", slot))

    def _deliver(self, job: Job, tokens) -> None:
        if tokens and job.t_first is None:
            job.t_first = time.perf_counter()
        pipe, seq = job.pipeline, job.seq
        out = []
        first = job.n_generated
        for token in tokens:
            job.n_generated += 1
            out.append(pipe.push(token))
            if pipe.stop_word is not None:
                break
        if pipe.stop_word is None and seq.finish_reason is not None:
            out.append(pipe.finish())
        text = "".join(out)
        logprobs = seq.logprobs[first : job.n_generated] if job.logprobs is not None else None
        if (text or logprobs) and not job.cancelled:
            job.emit(("text", text, logprobs))
        if pipe.stop_word is not None:
            self._finish(job, "stop", "word", pipe.stop_word)
        elif seq.finish_reason is not None:
            self._finish(job, seq.finish_reason, "eos" if seq.finish_reason == "stop" else "limit", "")

    def _release(self, job: Job, keep: bool = False) -> None:
        """Free the job's slot; `keep`: its sequence's state stays with the slot for the next
        request (the prompt cache), else it is dropped."""
        job.finished = True
        if self.slots[job.slot] is job:
            self.slots[job.slot] = None
        try:
            if keep:
                self.cache.put(job.slot, self.engine.keep(job.seq))
            else:
                self.engine.release(job.seq)
        except Exception:
            log.exception("releasing a sequence failed", id=job.id)

    def _timings(self, job: Job, t_end: float) -> dict:
        n_cached, n = job.seq.n_reused, job.n_generated
        n_prompt = len(job.prompt) - n_cached  # prefilled (llama-server's prompt_n)
        t_first = job.t_first or t_end
        prompt_ms = (t_first - job.t_start) * 1e3
        predicted_ms = (t_end - t_first) * 1e3 if job.t_first else 0.0
        stats = job.seq.stats
        return {
            "cache_n": n_cached, "prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, n_prompt), "prompt_per_second": n_prompt / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            "draft_n": stats.n_drafted, "draft_n_accepted": stats.n_accepted,
            # beyond llama-server's fields: verified drafts and the time spent drafting (declined calls too)
            "draft_rounds": stats.n_drafts, "draft_ms": stats.draft_seconds * 1e3,
        }

    def _finish(self, job: Job, finish_reason: str, stop_type: str, word: str) -> None:
        t_end = time.perf_counter()
        timings = self._timings(job, t_end)
        seq = job.seq
        t = self.totals
        t.prompt_tokens += timings["prompt_n"]
        t.prompt_tokens_cached += timings["cache_n"]
        t.prompt_seconds += timings["prompt_ms"] / 1e3
        t.predicted_tokens += job.n_generated
        t.predicted_seconds += timings["predicted_ms"] / 1e3
        t.n_tokens_max = max(t.n_tokens_max, len(seq.tokens))
        if finish_reason in ("cancelled", "shutdown"):
            t.requests_cancelled += 1
        else:
            t.requests_finished += 1
        # Free the slot only once the totals count the request: /slots showing it idle while
        # /metrics does not yet count it would be a window where the two disagree. The state
        # stays with the slot, cancelled or not: its rows are right as far as they go.
        self._release(job, keep=True)
        types = self.spec_types if seq.spec is None or seq.spec.types is None else list(seq.spec.types)
        log.info("request", id=job.id, endpoint=job.endpoint, slot=job.slot, prompt_tokens=len(job.prompt),
                 cached_tokens=seq.n_reused,
                 completion_tokens=job.n_generated, finish_reason=finish_reason,
                 queued_ms=round((job.t_start - job.t_queued) * 1e3, 1), prompt_ms=round(timings["prompt_ms"], 1),
                 predicted_ms=round(timings["predicted_ms"], 1), tok_s=round(timings["predicted_per_second"], 2),
                 spec_type=",".join(types) or "none", drafts=seq.stats.n_drafts, drafted=seq.stats.n_drafted,
                 accepted=seq.stats.n_accepted, declined=seq.stats.n_declined,
                 **({"grammar_drafted": seq.stats.grammar_drafted, "grammar_accepted": seq.stats.grammar_accepted}
                    if job.constraint is not None else {}))
        if seq.spec_error:
            log.warning("speculator failed; the request went on with plain decoding", id=job.id, error=seq.spec_error)
        if getattr(job.constraint, "error", None):
            log.warning("the grammar engine failed; the request ended there", id=job.id, error=job.constraint.error)
        if finish_reason not in ("cancelled", "shutdown"):
            job.emit(("done", Done(finish_reason, stop_type, word, len(job.prompt), job.n_generated, timings, job.slot,
                                       seq.n_reused)))

    def _fail(self, job: Job, error: ApiError) -> None:
        self.totals.requests_failed += 1
        self._release(job)
        log.warning("request failed", id=job.id, slot=job.slot, status=error.status, error=error.message)
        job.emit(("error", error))
