"""The prompt cache in the engine: a request continuing from a kept state computes exactly what a
cold start computes (logits bit for bit, so greedy and seeded sampling give the same tokens),
prefills only the rest of its prompt, and hands the speculators `truncate`, not `begin`.

Tiny random GGUF models exercise the CPU backend's row classes (prompt rows of short prompts take
llama.cpp's prompt arithmetic, which a decode row does not), the toys the engine's bookkeeping
(recurrent targets go back to saved prompt-end states), the real target a chat's second turn.
"""
from __future__ import annotations

import attrs
import numpy as np
import pytest
import structlog
import torch

from speculant import hookimpl
from speculant.engine import Engine, EngineConfig
from speculant.loader import load_model
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny_gguf import write_tiny_model

from toy_models import ToyModel, ToyRecurrentModel

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=5)


class Recording:
    """Wraps a model: keeps the logits of every forward and counts the rows fed."""

    def __init__(self, model):
        self.model, self.logits, self.rows = model, [], 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, batch, context, hidden_layers=()):
        self.rows += len(batch)
        # every row's whole logits, which these tests compare bit for bit: not the screened head's
        # argmax-only rows (whose other entries depend on whether its copy was ready yet)
        batch = attrs.evolve(batch, argmax_only=())
        out = self.model.forward(batch, context, hidden_layers)
        self.logits.append(out.logits)
        return out


def run(engine, prompt, n, params=GREEDY, cached=None):
    """Generate n tokens (or to the end) for prompt; returns (tokens, sequence)."""
    seq = engine.add(prompt, n, params, cached=cached)
    out = []
    while seq.finish_reason is None:
        out += engine.step()[seq.seq_id]
    return out, seq


def two_turns(model, first, extra, n1=12, n2=16, params=GREEDY, speculators=()):
    """Turn 1 on `first`, its state kept; turn 2 on first + turn 1's tokens + extra, once from the
    kept state and once cold in a fresh engine. Returns (warm, cold, warm seq, turn-2 prompt)."""
    rec = Recording(model)
    engine = Engine(rec, EngineConfig(n_ctx=1024, adaptive=False), list(speculators))
    gen, seq = run(engine, first, n1, params)
    entry = engine.keep(seq)
    second = first + gen + extra
    rec.logits.clear()
    rows_before = rec.rows
    warm, warm_seq = run(engine, second, n2, params, cached=entry)
    warm_logits, warm_rows = torch.cat(rec.logits), rec.rows - rows_before

    cold_rec = Recording(model)
    cold_engine = Engine(cold_rec, EngineConfig(n_ctx=1024, adaptive=False))
    cold, _ = run(cold_engine, second, n2, params)
    assert warm == cold
    if speculators:
        assert warm_seq.stats.n_drafts > 0
    else:  # one logits row a step in both: they must be the same floats
        assert torch.equal(warm_logits, torch.cat(cold_rec.logits))
        assert warm_rows == cold_rec.rows - warm_seq.n_reused  # only the rest of the prompt was fed
    return warm, cold, warm_seq, second


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt-cache") / "qwen2-q4k.gguf"
    return write_tiny_model(path, "qwen2", qtype="Q4_K", n_embd=256, n_ff=256, head_dim=64, n_layers=2, seed=3, n_ctx=1024)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path, progress=False)


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_long_prompt_reuses_every_cached_row(tiny, params):
    """A prompt of 64+ tokens: prompt and decode rows compute alike, so all cached rows are
    reused, across the 256-token split (rows past it take other kernels)."""
    first = toks(250, 1)
    _, _, seq, second = two_turns(tiny, first, toks(9, 2), params=params)
    assert seq.n_reused == len(first) + 12 - 1  # all but the last generated token, which was never fed


def test_short_prompt_reuses_only_rows_computed_alike(tiny):
    """Under 64 tokens the prompt rows take llama.cpp's prompt arithmetic, which depends on the
    prompt's length; turn 1's generated rows were decode rows. Only rows a cold start of the new
    prompt computes the same way are reused: here turn 1's prompt rows, none of its generation."""
    first = toks(20, 3)
    _, _, seq, second = two_turns(tiny, first, toks(3, 4), n1=10)
    assert len(second) < 64 and seq.n_reused == len(first)


def test_short_prompt_grown_long_starts_over(tiny):
    """Turn 1 under 64 tokens, turn 2 over: no cached row computes as the cold start would."""
    _, _, seq, _ = two_turns(tiny, toks(30, 5), toks(40, 6))
    assert seq.n_reused == 0


def test_edited_history_reuses_the_common_prefix(tiny):
    """A client that edits the conversation: only the unchanged prefix is reused."""
    engine = Engine(tiny, EngineConfig(n_ctx=1024))
    first = toks(120, 7)
    _, seq = run(engine, first, 8)
    entry = engine.keep(seq)
    edited = first[:70] + toks(30, 8)
    warm, seq = run(engine, edited, 12, cached=entry)
    cold, _ = run(Engine(tiny, EngineConfig(n_ctx=1024)), edited, 12)
    assert seq.n_reused == 70 and warm == cold


def test_the_same_prompt_again_feeds_only_its_last_token(tiny):
    engine = Engine(tiny, EngineConfig(n_ctx=1024))
    prompt = toks(100, 9)
    first, seq = run(engine, prompt, 8)
    again, seq = run(engine, prompt, 8, cached=engine.keep(seq))
    assert seq.n_reused == len(prompt) - 1 and again == first


def test_cached_state_is_freed_when_not_reused(tiny):
    engine = Engine(tiny, EngineConfig(n_ctx=1024))
    _, seq = run(engine, toks(30, 10), 4)
    entry = engine.keep(seq)
    assert engine.context.length(entry.seq_id) > 0 and entry.n_bytes > 0
    other, seq = run(engine, toks(80, 11), 4, cached=entry)  # nothing in common: a cold start
    assert seq.n_reused == 0
    engine.release(seq)
    assert engine.context.length(entry.seq_id) == 0 and not engine.sequences


# --- speculators: truncate, not begin ---------------------------------------------------------------
class HookLog:
    spec_type = "hook-log"

    def __init__(self):
        self.calls = []

    @hookimpl
    def begin(self, seq):
        self.calls.append(("begin", len(seq.tokens)))

    @hookimpl
    def truncate(self, seq, n):
        self.calls.append(("truncate", n, len(seq.tokens)))

    @hookimpl
    def end(self, seq_id):
        self.calls.append(("end", seq_id))

    @hookimpl
    def propose(self, seq, limits):
        return None


def test_speculators_get_truncate_and_keep_their_state(tiny):
    log = HookLog()
    engine = Engine(tiny, EngineConfig(n_ctx=1024), [log])
    first = toks(100, 12)
    gen, seq = run(engine, first, 6)
    entry = engine.keep(seq)
    assert ("end", entry.seq_id) not in log.calls  # kept: the speculators keep their state too
    second = first + gen + toks(5, 13)
    log.calls.clear()
    _, seq = run(engine, second, 4, cached=entry)
    assert log.calls == [("truncate", len(first) + 5, len(second))]
    engine.release(seq)
    assert log.calls[-1] == ("end", seq.seq_id)


@pytest.mark.parametrize("spec_types", [["ngram-simple"], ["ngram-map-k", "ngram-mod"], ["suffix", "ngram-simple"]])
def test_speculation_after_reuse_gives_plain_tokens(tiny, spec_types):
    """Speculators continuing their state across requests: still exactly the target's tokens.
    The turn-2 prompt repeats text, so the n-gram speculators do draft."""
    speculators = build_speculators(spec_types, {}, target=tiny)
    first = toks(90, 14)
    two_turns(tiny, first, first[:40], n1=10, n2=30, speculators=speculators)


# --- toys: the bookkeeping, recurrent targets -------------------------------------------------------
def test_toy_reuse_counts_and_equality():
    model = ToyModel()
    two_turns(model, [1, 2, 3, 4, 5, 6, 7], [8, 9], n1=10, n2=20)


@pytest.mark.parametrize("extra", [[8, 9], []], ids=["continues", "same-prompt"])
def test_recurrent_target_resumes_from_its_whole_state(extra):
    """A recurrent state cannot be cut, but when the new prompt continues all of it, it is used whole."""
    model = ToyRecurrentModel()
    engine = Engine(model, EngineConfig(n_ctx=256))
    first = [1, 2, 3, 4, 5]
    gen, seq = run(engine, first, 6)
    entry = engine.keep(seq)
    second = first + gen[:-1] + extra if extra else first + gen[:-1] + [gen[-1]]
    warm, seq = run(engine, second, 10, cached=entry)
    cold, _ = run(Engine(ToyRecurrentModel(), EngineConfig(n_ctx=256)), second, 10)
    assert seq.n_reused == len(first) + len(gen) - 1 and warm == cold


def test_recurrent_target_goes_back_to_a_prompt_end_checkpoint():
    """When the new prompt leaves the kept history inside turn 1's answer, the state saved at the
    end of turn 1's prompt is restored and the rest replayed."""
    model = ToyRecurrentModel()
    engine = Engine(model, EngineConfig(n_ctx=256))
    first = [1, 2, 3, 4, 5, 6]
    gen, seq = run(engine, first, 8)
    entry = engine.keep(seq)
    assert [n for n, _ in entry.checkpoints] == [len(first) - 1]
    second = first + gen[:3] + [9, 9, 9]  # the answer was edited after its third token
    warm, seq = run(engine, second, 10, cached=entry)
    cold, _ = run(Engine(ToyRecurrentModel(), EngineConfig(n_ctx=256)), second, 10)
    assert seq.n_reused == len(first) - 1 and warm == cold


# --- the real target: a chat's second turn ------------------------------------------------------------
@pytest.mark.realmodel
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_real_chat_second_turn_equals_cold_start(params):
    from conftest import TARGET, load_cached

    model = load_cached(TARGET)
    tok = model.tokenizer
    source = open(__file__).read()[:2500]
    messages = [{"role": "system", "content": "You are a careful coding assistant."},
                {"role": "user", "content": "Here is a test module:\n```python\n" + source + "\n```\nWhat does it test?"}]
    first = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special=True, parse_special=True)
    assert len(first) > 256  # rows on both sides of the split
    engine = Engine(model, EngineConfig(n_ctx=2048))
    gen, seq = run(engine, first, 24, params)
    entry = engine.keep(seq)
    messages += [{"role": "assistant", "content": tok.decode(gen)}, {"role": "user", "content": "Shorter, please."}]
    second = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special=True, parse_special=True)
    rec = Recording(model)
    engine.model = rec
    warm, seq = run(engine, second, 24, params, cached=entry)
    cold_rec = Recording(model)
    cold, _ = run(Engine(cold_rec, EngineConfig(n_ctx=2048)), second, 24, params)
    assert seq.n_reused >= len(first)  # turn 1's prompt and (re-tokenized alike) its answer
    assert torch.equal(torch.cat(rec.logits), torch.cat(cold_rec.logits))
    assert warm == cold


# --- adopt: a state saved elsewhere, with the hidden states speculators read ------------------------
class HiddenLog:
    """Asks the target for some layers' hidden states (two by default) and keeps, by position, what `prefill` (full
    prompt chunks) and `accept` (the rest: a prompt's last chunk rides with its first step) hand over."""

    spec_type = "hidden-log"

    def __init__(self, layers=(1, 2)):
        self.hidden_layers = tuple(layers)
        self.begun, self.calls, self.at = 0, [], {}

    @hookimpl
    def begin(self, seq):
        self.begun += 1

    def _keep(self, hook, start, hidden):
        rows = len(next(iter(hidden.values())))
        self.calls.append((hook, start, rows))
        for i in range(rows):
            self.at[start + i] = {l: h[i].clone() for l, h in hidden.items()}

    @hookimpl
    def prefill(self, seq, start, hidden):
        self._keep("prefill", start, hidden)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden, hidden_start):
        self._keep("accept", hidden_start, hidden)

    @hookimpl
    def propose(self, seq, limits):
        return None

    def rows(self, layer, n):
        """Positions 0..n-1's hidden states of `layer`."""
        return torch.stack([self.at[i][layer] for i in range(n)])


def cold_prompt_state(model, prompt):
    """A cold start's tokens, its target rows of prompt[:-1], and the prompt's hidden states as the
    speculators were handed them."""
    log = HiddenLog()
    engine = Engine(model, EngineConfig(n_ctx=1024), [log])
    tokens, seq = run(engine, prompt, 4)
    n = len(prompt) - 1
    state = {k: v[:, :n].clone() for k, v in engine.context.get_state(seq.seq_id).items()}
    return tokens, state, {l: log.rows(l, len(prompt)) for l in log.hidden_layers}


@pytest.mark.parametrize("n_prompt", [120, 700], ids=["one-chunk", "chunks"])
def test_adopted_hidden_states_reach_the_speculators_as_a_cold_prefill(tiny, n_prompt):
    prompt = toks(n_prompt, 21)
    cold_tokens, state, hidden = cold_prompt_state(tiny, prompt)
    log = HiddenLog()
    engine = Engine(tiny, EngineConfig(n_ctx=1024), [log])
    n = len(prompt) - 1
    entry = engine.adopt(prompt[:-1], ((0, len(prompt)),), state, hidden={l: h[:n] for l, h in hidden.items()})
    tokens, seq = run(engine, prompt, 4, cached=entry)
    assert seq.n_reused == n and tokens == cold_tokens
    # begin, the adopted rows' states from position 0, then the engine's own last prompt row
    assert log.begun == 1 and log.calls[:2] == [("prefill", 0, n), ("accept", n, 1)]
    for layer in log.hidden_layers:
        assert torch.equal(log.rows(layer, len(prompt)), hidden[layer])


def test_adopt_without_hidden_states_hands_the_speculators_none(tiny):
    prompt = toks(80, 22)
    _, state, _ = cold_prompt_state(tiny, prompt)
    log = HiddenLog()
    engine = Engine(tiny, EngineConfig(n_ctx=1024), [log])
    entry = engine.adopt(prompt[:-1], ((0, len(prompt)),), state)
    with structlog.testing.capture_logs() as logs:
        run(engine, prompt, 2, cached=entry)
    assert log.calls[0] == ("accept", len(prompt) - 1, 1)  # only the row the engine computed itself
    assert [e["layers"] for e in logs if e["event"] == "adopted_without_hidden_states"] == [[1, 2]]


def test_adopt_refuses_hidden_states_of_another_length(tiny):
    prompt = toks(40, 23)
    _, state, hidden = cold_prompt_state(tiny, prompt)
    engine = Engine(tiny, EngineConfig(n_ctx=1024))
    with pytest.raises(ValueError, match="hidden states of layer 1 hold 40 rows for 39 tokens"):
        engine.adopt(prompt[:-1], ((0, len(prompt)),), state, hidden=hidden)
