"""Hostile input and broken plugins (issue 22): a speculator's wrong answer or BaseException costs
only its own sequences their speculation, a dead engine thread makes the server refuse work, and
odd request bodies (lone surrogates, unsupported fields, tiny temperatures) get clear answers."""
import asyncio
import time

import pytest
import torch

from speculant import Draft, hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.sampling import Sampler, SamplingParams

from test_server_util import aiotest, assert_error, make_engine, post, serve, tiny_model
from toy_models import ToyModel

PROMPT = [1, 2, 3, 4, 5]
BAD_PROMPT = [9, 2, 3, 4, 5]  # the broken speculators misbehave for this prompt only
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}


def plain(prompt=PROMPT, n=30, params=SamplingParams()):
    return list(Engine(ToyModel(), EngineConfig(n_ctx=256)).generate(prompt, n, params))


def run_pair(speculators, **config):
    """The bad and the good prompt decoded together; (bad seq, good seq, their outputs)."""
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False, **config), speculators)
    bad, good = engine.add(BAD_PROMPT, 30), engine.add(PROMPT, 30)
    outs = {bad.seq_id: [], good.seq_id: []}
    while engine.active():
        for sid, toks in engine.step().items():
            outs[sid] += toks
    return bad, good, outs[bad.seq_id], outs[good.seq_id]


# --- 1. a speculator's answer that is not a Draft ------------------------------------------------------
WRONG_ANSWERS = {
    "list": [0, 1],
    "tuple": (0, 1),
    "string": "01",
    "int": 3,
    "float tokens": Draft((0.5, 1.0), "wrong"),
    "string tokens": Draft(("a",), "wrong"),
    "tokens not a sequence": Draft(7, "wrong"),
    "bool tokens": Draft((True,), "wrong"),
    "probs not a tensor": Draft((0, 1), "wrong", [[0.5]]),
    "probs over another vocabulary": Draft((0, 1), "wrong", torch.full((2, 7), 1 / 7)),
    "confidence not numbers": Draft((0, 1), "wrong", None, ("sure", "sure")),
    "confidence too short": Draft((0, 1), "wrong", None, (0.9,)),
    "confidence not a probability": Draft((0, 1), "wrong", None, (0.9, 1.5)),
}


class Wrong:
    spec_type = "wrong"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def propose(self, seq, limits):
        return self.answer if seq.tokens[0] == BAD_PROMPT[0] else Draft((0,), self.spec_type)


class WrongBatch:
    spec_type = "wrong"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def propose_batch(self, requests):
        if any(r.seq.tokens[0] == BAD_PROMPT[0] for r in requests):
            return self.answer
        return [Draft((0,), self.spec_type) for _ in requests]


@pytest.mark.parametrize("answer", list(WRONG_ANSWERS.values()), ids=list(WRONG_ANSWERS))
def test_propose_returning_a_non_draft_costs_its_sequence_only(answer):
    bad, good, out_bad, out_good = run_pair([Wrong(answer)])
    assert out_bad == plain(BAD_PROMPT) and out_good == plain()
    assert bad.spec_error and "wrong" in bad.spec_error
    assert good.spec_error is None and good.stats.n_drafts > 0


@pytest.mark.parametrize("answer", [("a", "b"), "ab", 5, [0, 1, 2], [[0], [1]], [Draft((0,)), (0,)]],
                         ids=["tuple", "string", "int", "list of ints", "list of lists", "one non-draft"])
def test_propose_batch_returning_non_drafts_costs_its_call_only(answer):
    """propose_batch answers for all the sequences of its call: a wrong answer costs them all
    their speculation (here both, the good one is in the same call), never the step."""
    bad, good, out_bad, out_good = run_pair([WrongBatch(answer)])
    assert out_bad == plain(BAD_PROMPT) and out_good == plain()
    assert bad.spec_error and "wrong" in bad.spec_error


# --- 2. a speculator raising a BaseException -------------------------------------------------------------
class Fatal(BaseException):
    pass


BASE_EXCEPTIONS = {"SystemExit": SystemExit(3), "GeneratorExit": GeneratorExit(), "custom": Fatal("fatal")}


class Raiser:
    """Raises `error` in the hook `where` for the bad prompt's sequence."""

    spec_type = "raiser"

    def __init__(self, where, error):
        self.where, self.error = where, error

    def _maybe(self, name, seq):
        if name == self.where and seq.tokens[0] == BAD_PROMPT[0]:
            raise self.error

    @hookimpl
    def begin(self, seq):
        self._maybe("begin", seq)

    @hookimpl
    def propose(self, seq, limits):
        self._maybe("propose", seq)
        return Draft((0,), self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        self._maybe("accept", seq)


class BatchRaiser:
    spec_type = "raiser"

    def __init__(self, error):
        self.error = error

    @hookimpl
    def propose_batch(self, requests):
        if any(r.seq.tokens[0] == BAD_PROMPT[0] for r in requests):
            raise self.error
        return [Draft((0,), self.spec_type) for _ in requests]


class EndRaiser:
    spec_type = "raiser"

    def __init__(self, error):
        self.error = error

    @hookimpl
    def end(self, seq_id):
        raise self.error


@pytest.mark.parametrize("error", list(BASE_EXCEPTIONS.values()), ids=list(BASE_EXCEPTIONS))
@pytest.mark.parametrize("where", ["begin", "propose", "accept", "propose_batch"])
def test_base_exception_in_a_hook_costs_its_sequence_only(where, error):
    spec = BatchRaiser(error) if where == "propose_batch" else Raiser(where, error)
    bad, good, out_bad, out_good = run_pair([spec])
    assert out_bad == plain(BAD_PROMPT) and out_good == plain()
    assert bad.spec_error and type(error).__name__ in bad.spec_error
    if where != "propose_batch":  # a batched call answers for both: both lose speculation
        assert good.spec_error is None and good.stats.n_drafts > 0


@pytest.mark.parametrize("error", list(BASE_EXCEPTIONS.values()), ids=list(BASE_EXCEPTIONS))
def test_base_exception_in_end_does_not_escape_release(error):
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False), [EndRaiser(error)])
    seq = engine.add(PROMPT, 5)
    while engine.active():
        engine.step()
    engine.release(seq)
    assert not engine.sequences and type(error).__name__ in seq.spec_error


def test_keyboard_interrupt_is_not_swallowed():
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False), [Raiser("propose", KeyboardInterrupt())])
    engine.add(BAD_PROMPT, 5)
    with pytest.raises(KeyboardInterrupt):
        engine.step()


# --- a per-call deadline: a speculator that hangs is abandoned and quarantined; the engine goes on ---------
# Each speculator's calls run on a thread of its own; the engine waits at most the deadline (the
# grace where a speculator may catch up on a prompt), then abandons the call and never calls that
# speculator again. Every run below is bounded by a thread join, so that on an engine without the
# watchdog the test fails instead of hanging the suite.
DEADLINE, GRACE = 0.2, 0.5


def within(seconds, fn, *args, **kwargs):
    """fn(*args, **kwargs) on a daemon thread; its result and seconds, or a failure if it has not
    returned in `seconds`."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the engine thread is held by a speculator"
    if "error" in out:
        raise out["error"]
    return out["value"], time.perf_counter() - t0


class Hanger:
    """Hangs in hook `where` for the bad prompt's sequence: blocked (as in time.sleep(10**9): a C
    call, GIL released) or spinning in Python (`while True: pass`, GIL held), until the test sets
    `release` at its end. Drafts token 0 otherwise. Counts its calls by hook."""

    spec_type = "hanger"

    def __init__(self, where, spin=False):
        import threading

        self.where, self.spin = where, spin
        self.release = threading.Event()
        self.calls: dict[str, int] = {}
        self.threads: set = set()

    def _maybe(self, name, tokens):
        import threading

        self.calls[name] = self.calls.get(name, 0) + 1
        self.threads.add(threading.current_thread())
        if name == self.where and tokens[0] == BAD_PROMPT[0]:
            if self.spin:
                while not self.release.is_set():
                    pass
            else:
                self.release.wait()

    @hookimpl
    def begin(self, seq):
        self._maybe("begin", seq.tokens)

    @hookimpl
    def propose(self, seq, limits):
        self._maybe("propose", seq.tokens)
        return Draft((0,), self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        self._maybe("accept", seq.tokens)

    @hookimpl
    def truncate(self, seq, n):
        self._maybe("truncate", seq.tokens)

    @hookimpl
    def end(self, seq_id):
        self._maybe("end", (0,))


class HangerBatch(Hanger):
    @hookimpl
    def propose_batch(self, requests):
        bad = any(r.seq.tokens[0] == BAD_PROMPT[0] for r in requests)
        self._maybe("propose_batch", BAD_PROMPT if bad else requests[0].seq.tokens)
        return [Draft((0,), self.spec_type) for _ in requests]


class Other:
    """A second speculator of the chain: drafts token 0 for every sequence, counting them."""

    spec_type = "other"

    def __init__(self):
        self.drafted: dict[int, int] = {}

    @hookimpl
    def propose(self, seq, limits):
        self.drafted[seq.tokens[0]] = self.drafted.get(seq.tokens[0], 0) + 1
        return Draft((0,), self.spec_type)


def decode_all(engine, *seqs):
    outs = {s.seq_id: [] for s in seqs}
    while engine.active():
        for sid, toks in engine.step().items():
            outs.setdefault(sid, []).extend(toks)
    return [outs[s.seq_id] for s in seqs]


@pytest.mark.parametrize("spin", [False, True], ids=["blocked", "spinning"])
@pytest.mark.parametrize("where", ["propose", "propose_batch", "accept", "begin"])
def test_a_hung_speculator_is_quarantined_and_the_engine_goes_on(where, spin):
    spec = HangerBatch(where, spin) if where == "propose_batch" else Hanger(where, spin)
    other = Other()
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False, spec_deadline=DEADLINE, spec_grace=GRACE),
                    [spec, other])
    try:
        def run():
            bad, good = engine.add(BAD_PROMPT, 30), engine.add(PROMPT, 30)
            return bad, good, *decode_all(engine, bad, good)

        (bad, good, out_bad, out_good), seconds = within(10, run)
        assert out_bad == plain(BAD_PROMPT) and out_good == plain()
        assert seconds < 5
        assert list(engine.chain.quarantined) == ["hanger"]
        assert "did not return within" in str(engine.chain.quarantined["hanger"])
        assert bad.spec_error is None and good.spec_error is None  # a hang is not the sequence's error
        # the rest of the chain drafts for the bad prompt's sequence
        assert other.drafted.get(BAD_PROMPT[0], 0) > 1 and engine.spec_stats["other"].drafts > 1
        calls = dict(spec.calls)
        # a later request completes too, without calling the quarantined speculator
        (out_again,), _ = within(10, lambda: decode_all(engine, engine.add(BAD_PROMPT, 30)))
        assert out_again == plain(BAD_PROMPT) and spec.calls == calls
        assert all(t is not __import__("threading").main_thread() for t in spec.threads)
        if spin:  # the abandoned thread was stopped: it does not keep the GIL from the engine
            thread = next(iter(spec.threads))
            thread.join(2)
            assert not thread.is_alive()
    finally:
        spec.release.set()
    # the stuck call returned; the speculator stays quarantined for the engine's life
    time.sleep(0.1)
    (out_again,), _ = within(10, lambda: decode_all(engine, engine.add(BAD_PROMPT, 30)))
    assert out_again == plain(BAD_PROMPT) and spec.calls == calls and "hanger" in engine.chain.quarantined


def test_a_quarantined_speculator_comes_back_once_its_call_has_returned():
    """--spec-revive: not while the stuck call still runs; after it returned and the time is up,
    the speculator is tried again on a new thread, every live sequence starting over with it
    (end, then begin) before its next call; outputs stay plain decoding's. The third quarantine
    is for good."""
    import threading

    spec, other = Hanger("propose"), Other()
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, adaptive=False, spec_deadline=DEADLINE, spec_grace=GRACE,
                                             spec_revive=0.3), [spec, other])
    try:
        (out_bad,), _ = within(10, lambda: decode_all(engine, engine.add(BAD_PROMPT, 30)))
        assert out_bad == plain(BAD_PROMPT) and "hanger" in engine.chain.quarantined
        time.sleep(0.4)  # past the revive time, but the call is still stuck: it stays out
        live = engine.add(PROMPT, 60)  # begun while the speculator is out
        first = engine.step().get(live.seq_id, [])
        assert "hanger" in engine.chain.quarantined and engine.chain.revived == 0
    finally:
        spec.release.set()
    stuck = next(t for t in spec.threads if t is not threading.main_thread())
    stuck.join(2)
    assert not stuck.is_alive()
    begins, proposes = spec.calls.get("begin", 0), spec.calls.get("propose", 0)
    (out_live,), _ = within(10, lambda: decode_all(engine, live))
    out_live = first + out_live
    assert out_live == plain(n=60) and engine.chain.revived == 1 and not engine.chain.quarantined
    assert spec.calls["begin"] == begins + 1  # the live sequence started over with it
    assert spec.calls["propose"] > proposes and engine.spec_stats["hanger"].drafts > 0
    assert len(spec.threads) == 2  # a new thread

    # Two more quarantines: the third is for good.
    for k in (2, 3):
        spec.release.clear()
        try:
            (out,), _ = within(10, lambda: decode_all(engine, engine.add(BAD_PROMPT, 30)))
            assert out == plain(BAD_PROMPT) and "hanger" in engine.chain.quarantined
        finally:
            spec.release.set()
        time.sleep(0.4)
        (out,), _ = within(10, lambda: decode_all(engine, engine.add(PROMPT, 30)))
        assert out == plain() and engine.chain.revived == (2 if k >= 2 else 1)
    assert "hanger" in engine.chain.quarantined and "tried again" not in str(engine.chain.quarantined["hanger"])


class Sluggish:
    """Takes `seconds` in propose (sleeping) for the bad prompt's sequence; drafts token 0
    otherwise. Counts its calls per first prompt token."""

    spec_type = "sluggish"

    def __init__(self, seconds=0.3, slow_calls=None):
        self.seconds, self.slow_calls = seconds, slow_calls
        self.calls = {}

    @hookimpl
    def propose(self, seq, limits):
        n = self.calls[seq.tokens[0]] = self.calls.get(seq.tokens[0], 0) + 1
        if seq.tokens[0] == BAD_PROMPT[0] and (self.slow_calls is None or n in self.slow_calls):
            time.sleep(self.seconds)
        return Draft((0,), self.spec_type)


def test_a_late_call_quarantines_the_speculator_and_its_answer_is_dropped():
    spec = Sluggish(0.3)
    (bad, good, out_bad, out_good), seconds = within(10, run_pair, [spec], spec_deadline=0.1, spec_grace=1.0)
    assert out_bad == plain(BAD_PROMPT) and out_good == plain()
    # the first call for a sequence may catch up on its prompt (grace): its draft is verified;
    # the second is past the deadline: abandoned, its draft never verified, never asked again
    assert spec.calls[BAD_PROMPT[0]] == 2 and bad.stats.n_drafts == 1
    assert bad.spec_error is None and seconds < 3


def test_the_first_call_for_a_sequence_may_catch_up_on_its_prompt():
    spec = Sluggish(0.3, slow_calls={1})
    bad, good, out_bad, out_good = run_pair([spec], spec_deadline=0.1, spec_grace=1.0)
    assert out_bad == plain(BAD_PROMPT) and out_good == plain()
    assert bad.spec_error is None and bad.stats.n_drafts > 1


def test_truncate_starts_the_catch_up_again():
    from speculant.chain import SpeculatorChain
    from speculant.types import DraftLimits, SequenceView

    spec = Sluggish(0.2)
    chain = SpeculatorChain([spec], deadline=0.1, grace=1.0)
    seq = SequenceView(7, tuple(BAD_PROMPT), len(BAD_PROMPT), 0.0)
    chain.begin(seq)
    assert chain.propose(seq, DraftLimits(4)) is not None  # the first: the grace
    chain.truncate(seq, 3)
    assert chain.propose(seq, DraftLimits(4)) is not None  # the first since the truncate
    assert chain.propose(seq, DraftLimits(4)) is None and "sluggish" in chain.quarantined  # held to the deadline
    assert chain.propose(seq, DraftLimits(4)) is None and spec.calls[BAD_PROMPT[0]] == 3


def test_the_grace_grows_with_the_prompt():
    """Catching up takes time in proportion to the prompt: the grace grows by GRACE_PER_TOKEN a
    token of the call's sequence."""
    from speculant.chain import GRACE_PER_TOKEN, SpeculatorChain
    from speculant.types import SequenceView

    class SlowBegin:
        spec_type = "slow-begin"

        @hookimpl
        def begin(self, seq):
            time.sleep(0.3)

    n = int(0.5 / GRACE_PER_TOKEN)  # 0.5 s more
    chain = SpeculatorChain([SlowBegin()], deadline=0.05, grace=0.1)
    chain.begin(SequenceView(1, (1,) * n, n, 0.0))
    assert not chain.quarantined
    chain.begin(SequenceView(2, (1, 2), 2, 0.0))
    assert "slow-begin" in chain.quarantined


def test_no_deadline_runs_speculators_inline_and_keeps_a_slow_one():
    import threading

    spec = Sluggish(0.02)
    seen = []

    class Where:
        spec_type = "where"

        @hookimpl
        def accept(self, seq):
            seen.append(threading.current_thread())

    bad, good, out_bad, out_good = run_pair([spec, Where()], spec_deadline=None)
    assert bad.spec_error is None and bad.stats.n_drafts > 0 and out_bad == plain(BAD_PROMPT)
    assert spec.calls[BAD_PROMPT[0]] > 1
    assert seen and all(t is threading.main_thread() for t in seen)


def test_exceptions_cross_the_thread_with_their_type():
    """A speculator's exception, raised on its thread, reaches the engine's handling as it was."""
    import threading

    class Bad:
        spec_type = "bad"

        @hookimpl
        def propose(self, seq, limits):
            raise LookupError(f"from {threading.current_thread().name}")

    bad, good, _, _ = run_pair([Bad()], spec_deadline=1.0)
    assert bad.spec_error.startswith("LookupError: from speculator 0:bad")


def test_a_dropped_chain_ends_its_threads():
    import gc
    import threading

    before = set(threading.enumerate())
    engine = Engine(ToyModel(), EngineConfig(n_ctx=256, spec_deadline=1.0), [Other(), Other()])
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("speculator ")]
    assert len(mine) == 2
    del engine
    gc.collect()
    for t in mine:
        t.join(2)
        assert not t.is_alive()


def test_spec_deadline_flag():
    import argparse

    from speculant.flags import add_model_args, add_spec_args, engine_setup

    p = argparse.ArgumentParser()
    add_model_args(p)
    add_spec_args(p)
    assert engine_setup(p.parse_args(["-m", "x"]), None)[0].spec_deadline == 5.0
    assert engine_setup(p.parse_args(["-m", "x", "--spec-deadline", "0.5"]), None)[0].spec_deadline == 0.5
    assert engine_setup(p.parse_args(["-m", "x", "--spec-deadline", "0"]), None)[0].spec_deadline is None
    assert engine_setup(p.parse_args(["-m", "x"]), None)[0].spec_grace is None  # max(60 s, 10 x the deadline)
    assert engine_setup(p.parse_args(["-m", "x", "--spec-grace", "120"]), None)[0].spec_grace == 120.0
    with pytest.raises(SystemExit):
        p.parse_args(["-m", "x", "--spec-grace", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["-m", "x", "--spec-deadline", "-1"])


# --- 4. tiny temperatures ------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1e-30, 1e-39, 1e-45, 1e-300, 5e-324])
def test_tiny_temperature_samples_like_greedy(t):
    g = torch.Generator().manual_seed(0)
    greedy = Sampler(SamplingParams())
    for top_k in (40, 0):
        s = Sampler(SamplingParams(temperature=t, top_k=top_k, top_p=1.0, min_p=0.0, seed=1))
        for _ in range(20):
            logits = torch.randn(1000, generator=g) * 20
            p = s.probs(logits)
            assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0)
            assert int(p.argmax()) == greedy.sample(logits) == s.sample(logits)


@pytest.mark.parametrize("t", [1e-30, 1e-39])
def test_tiny_temperature_decodes_like_greedy(t):
    params = SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    assert plain(params=params) == plain()


# --- the server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


@aiotest
async def test_dead_engine_thread_refuses_work_and_fails_in_flight_requests(model, monkeypatch):
    engine = make_engine(model)
    entered = asyncio.Event()
    loop = asyncio.get_running_loop()

    def step():  # the thread dies in the middle of a request
        loop.call_soon_threadsafe(entered.set)
        raise Fatal("the engine thread is gone")

    async with serve(engine, n_slots=2) as c:
        assert (await c.get("/health")).status == 200
        monkeypatch.setattr(engine, "step", step)
        in_flight = asyncio.ensure_future(post(c, "/v1/chat/completions", CHAT))
        await asyncio.wait_for(entered.wait(), 10)
        status, body = await asyncio.wait_for(in_flight, 10)
        assert_error(status, body, 500, "engine thread")
        r = await c.get("/health")
        assert r.status == 503 and "engine thread" in (await r.json())["error"]["message"]
        status, body = await asyncio.wait_for(post(c, "/v1/chat/completions", CHAT), 10)
        assert_error(status, body, 503, "engine thread")
        status, body = await asyncio.wait_for(post(c, "/slots/0?action=erase", {}), 10)
        assert_error(status, body, 503, "engine thread")


class HangOnce:
    """Hangs (blocked) in `where` on its first call there, for whatever sequence; drafts garbage
    otherwise (rejected drafts: real verification work, same output)."""

    spec_type = "test-slow"

    def __init__(self, where):
        import threading

        self.where, self.release, self.hung = where, threading.Event(), False

    def _maybe(self, name):
        if name == self.where and not self.hung:
            self.hung = True
            self.release.wait()

    @hookimpl
    def begin(self, seq):
        self._maybe("begin")

    @hookimpl
    def propose(self, seq, limits):
        self._maybe("propose")
        return Draft((0,) * min(2, limits.n_max), self.spec_type)

    @hookimpl
    def accept(self, seq):
        self._maybe("accept")


@pytest.mark.parametrize("where", ["begin", "propose", "accept"])
@aiotest
async def test_server_requests_complete_past_a_hung_speculator(model, where):
    """Concurrent requests on 4 slots with a speculator that hangs: all complete with the text each
    has alone, /health stays 200 throughout, the next requests complete too."""
    from test_server_util import Lookup

    bodies = [{"messages": [{"role": "user", "content": f"request {i}: count to {i + 3}"}], "max_tokens": 12,
               "temperature": 0, "stream": i % 2 == 1} for i in range(6)]

    async def texts(c, bodies):
        answers = await asyncio.gather(*[post(c, "/v1/chat/completions", {**b, "stream": False}) for b in bodies])
        assert all(status == 200 for status, _ in answers), answers
        return [body["choices"][0]["message"]["content"] for _, body in answers]

    async with serve(make_engine(model), n_slots=1) as c:
        want = [(await texts(c, [b]))[0] for b in bodies]
    spec = HangOnce(where)
    engine = make_engine(model, speculators=[spec, Lookup()], adaptive=False, spec_deadline=DEADLINE, spec_grace=GRACE)
    async with serve(engine, n_slots=4) as c:
        try:  # (released before the server shuts down, which waits for the engine thread)
            load = asyncio.ensure_future(asyncio.wait_for(texts(c, bodies), 20))
            while not load.done():
                r = await asyncio.wait_for(c.get("/health"), 5)
                assert r.status == 200, await r.text()
                await asyncio.sleep(0.05)
            assert await load == want
            assert spec.hung and list(engine.chain.quarantined) == ["test-slow"]
            assert await asyncio.wait_for(texts(c, bodies[:3]), 20) == want[:3]
            assert engine.spec_stats["test-lookup"].drafts > 0  # the rest of the chain drafts on
            assert (await c.get("/health")).status == 200
            # an operator sees it: /props names it and why, /metrics has a gauge to alert on
            quarantined = (await (await c.get("/props")).json())["speculative"]["quarantined"]
            assert list(quarantined) == ["test-slow"] and "did not return within" in quarantined["test-slow"]
            metrics = await (await c.get("/metrics")).text()
            assert 'speculant:spec_quarantined{spec_type="test-slow"} 1.0' in metrics
            assert 'speculant:spec_quarantined{spec_type="test-lookup"} 0.0' in metrics
        finally:
            spec.release.set()


SURROGATE_BODIES = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                             '"speculative": {"type": "\\udfff"}}', "speculative.type"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "key"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/completion", '{"prompt": "hi", "n_predict": 2, "speculative.type": "\\ud800"}', "speculative.type"),
    ("/completion", '{"prompt": "hi", "n_predict": 2, "stop": ["x", "\\udc00"]}', "stop[1]"),
    ("/tokenize", '{"content": "\\ud800"}', "content"),
    ("/apply-template", '{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages[0].role"),
]


@aiotest
async def test_lone_surrogates_are_a_400_naming_the_field(model):
    async with serve(make_engine(model)) as c:
        for path, raw, field in SURROGATE_BODIES:
            async with c.post(path, data=raw.encode()) as r:
                assert r.headers["Content-Type"].startswith("application/json"), (path, raw, await r.text())
                status, body = r.status, await r.json()
            err = assert_error(status, body, 400, field, "surrogate")
            assert "\n" not in err["message"]
        # a proper pair is one character, not a lone surrogate
        status, body = await post(c, "/tokenize", '{"content": "\\ud83d\\ude00"}')
        assert status == 200 and body["tokens"]
        status, body = await post(c, "/v1/chat/completions", CHAT)
        assert status == 200


UNSUPPORTED = [
    # tools: the tiny model's ChatML template has no tools section (test_server_tools.py has the rest)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"response_format": "text"}, "response_format"),  # structured outputs: tests/test_server_grammar.py
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"post_sampling_probs": True}, "post_sampling_probs"),
]
ACCEPTED = [{"tools": []}, {"tools": None}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"response_format": {"type": "text"}},
            {"grammar": ""}, {"logprobs": False}, {"response_format": {"type": "json_object"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            {"grammar": "root ::= \"a\""}, {"json_schema": {}}]


@aiotest
async def test_unsupported_fields_are_rejected_not_ignored(model):
    async with serve(make_engine(model)) as c:
        for extra, field in UNSUPPORTED:
            for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
                status, body = await post(c, path, {**base, **extra})
                err = assert_error(status, body, 400, field)
                assert err.get("param") == field.strip("'"), (extra, err)
        for extra in ACCEPTED:
            status, body = await post(c, "/v1/chat/completions", {**CHAT, **extra})
            assert status == 200, (extra, body)


KILLER = '''
from speculant import hookimpl


class Killer:
    spec_type = "killer"

    def __init__(self, config):
        pass

    @hookimpl
    def propose(self, seq, limits):
        raise KeyboardInterrupt  # not a speculator's to swallow: it ends the engine thread


@hookimpl
def speculant_register_speculators(register):
    register("killer", Killer)
'''


def test_serve_exits_non_zero_when_the_engine_thread_dies(tmp_path):
    """`speculant serve` whose engine thread dies answers the in-flight request with an error and
    exits with a non-zero code, so that a supervisor restarts it (it would stay up, refusing)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from fake_dists import write_dist
    from speculant.testing.tiny_gguf import write_tiny_model

    site = tmp_path / "site"
    site.mkdir()
    write_dist(site, "speculant-killer", "1.0", {"killer": "fakekiller"}, {"fakekiller.py": KILLER})
    model = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "SPECULANT_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "-m", model, "--port", str(port), "-c", "256",
                               "-np", "1", "--spec-type", "killer"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        req = urllib.request.Request(url + "/completion", json.dumps({"prompt": "hello", "n_predict": 4}).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(req, timeout=30)
        assert failed.value.code == 500 and "engine thread died" in failed.value.read().decode()
        code = server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
        _, err = server.communicate()
    assert code == 1, err
    assert "the engine thread died (KeyboardInterrupt); exiting" in err
