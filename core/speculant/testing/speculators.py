"""The speculator contract: what every speculator plugin must do, as tests that can fail.

Subclass :class:`SpeculatorContract` in a test module (``class TestMine(SpeculatorContract):
pass``) or run ``pytest --pyargs speculant.testing.suite``; the pytest plugin
(speculant.testing.pytest_plugin) runs each test once per installed speculator.

A speculator class can tell the suite three things through class attributes:

* ``contract_options``: options (``config.options``, dest names) to build it with here, e.g.
  shorter n-grams so that the suite's short texts draft;
* ``shared_across_sequences = True``: it drafts for one sequence from what it learned from others
  (a global cache). The isolation tests then give the other sequences unrelated tokens instead of
  look-alike text: their content may not change this sequence's drafts, but they may share;
* ``contract_xfail``: ``{"test_name": "reason"}``, tests it is known to fail, run as strict
  expected failures (a test that starts passing is reported, so the list stays true);
* ``contract_draft_model(target_path, directory) -> path`` (a staticmethod): the file to pass as
  ``-md`` for the suite's tiny target, for a speculator whose draft is not a plain draft model
  (an EAGLE3 head); without it the suite passes a small draft model of the target's vocabulary.

Speculators that read the target's hidden states (``hidden_layers``) get, in the suite's
simulated steps, a fixed random function of each row's token as every layer's state.
"""
from __future__ import annotations

import argparse
import random

import pytest
import torch

from speculant.engine import Engine, EngineConfig
from speculant.sampling import Sampler, SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.driver import Driver, same_steps, script, segment_pool
from speculant.types import Batch, Draft

ALPHABET = range(0, 128)  # byte tokens of the tiny vocabulary: always valid, never special
OTHER_ALPHABET = range(128, 256)  # unrelated text for the isolation tests of shared speculators
SEED = 1234
# chi-square critical value, 19 degrees of freedom, p = 1e-4: with fixed seeds the test either
# always passes or always fails, and a correct speculator fails it with probability 1e-4.
CHI2_CRIT_19_DF = 51.2


def plugin_options(registry) -> dict:
    """Every option's default as the CLI parses it (plugins add theirs through speculant_add_options)."""
    parser = argparse.ArgumentParser()
    registry.add_options(parser)
    return vars(parser.parse_args([]))


class SpeculatorContract:
    """Base class of the speculator contract. Parametrized by ``speculator_name``."""

    #: spec types this class tests; None: every installed one (or those --speculant-plugin selects)
    spec_types: tuple[str, ...] | None = None

    # --- fixtures ----------------------------------------------------------------------------
    @pytest.fixture
    def speculator_class(self, speculant_registry, speculator_name):
        return speculant_registry.get("speculator", speculator_name)

    @pytest.fixture
    def make(self, speculant_registry, speculator_name, speculator_class, tiny_models):
        """make() -> a new speculator instance, built as the CLI builds it."""
        options = {**plugin_options(speculant_registry), "seed": SEED, **getattr(speculator_class, "contract_options", {})}
        draft_path = tiny_models.draft_for(speculator_class)

        def make():
            return build_speculators([speculator_name], options, target=tiny_models.target, draft_model=draft_path,
                                     backend="cpu", registry=speculant_registry)[0]
        return make

    @pytest.fixture
    def driver(self, make, tiny_models):
        def driver():
            return Driver(make(), tiny_models.target.info.n_vocab, tiny_models.target.info.n_embd)
        return driver

    @pytest.fixture
    def shared(self, speculator_class) -> bool:
        return bool(getattr(speculator_class, "shared_across_sequences", False))

    # --- helpers -------------------------------------------------------------------------------
    @staticmethod
    def texts(seed: int, n: int, length: int = 120, alphabet=ALPHABET, pool=None) -> list[list[int]]:
        rng = random.Random(seed)
        pool = pool or segment_pool(rng, alphabet)
        return [script(rng, pool, length, alphabet) for _ in range(n)]

    @staticmethod
    def require_drafts(steps, what: str) -> None:
        assert steps, (f"the speculator never drafted in {what}, so this test checks nothing; the texts repeat "
                       f"segments of 4-12 tokens (set contract_options so that it drafts on them)")

    # --- the contract ----------------------------------------------------------------------------
    def test_hooks_are_valid(self, make):
        """Its hook implementations match the hookspecs (pluggy validates names and arguments)
        and it implements propose."""
        d = Driver(make(), 512)  # registers it with pluggy: a misspelled hook or argument raises here
        assert d.hook.propose.get_hookimpls() or d.batched, "the speculator has no @hookimpl propose (or propose_batch) method"

    def test_drafts_on_repetitive_text(self, driver):
        """Something to verify: on text made of repeated segments it proposes drafts."""
        d = driver()
        for i, text in enumerate(self.texts(1, 3)):
            d.begin(i, text, 40)
            d.run(i, len(text))
        self.require_drafts(d.drafts(), "three sequences of repeated segments")

    def test_proposes_only_valid_tokens(self, driver, tiny_models):
        """Token ids are ints in [0, n_vocab); a draft is None or non-empty (an empty Draft would
        end the chain's search); probabilities, if any, are distributions that give the
        proposed token a non-zero chance; confidences, if any, a probability for each token."""
        n_vocab = tiny_models.target.info.n_vocab
        d = driver()
        for i, text in enumerate(self.texts(2, 3)):
            d.begin(i, text, 30)
            d.run(i, len(text), n_max=6)
        for s in d.log:
            if s.draft is None:
                continue
            assert isinstance(s.draft, Draft), f"propose returned {type(s.draft).__name__}, not a Draft or None"
            assert len(s.draft) > 0, "propose returned an empty Draft: return None when there is nothing to propose"
            assert type(s.draft.tokens) is tuple and all(type(t) is int for t in s.draft.tokens), \
                f"draft tokens must be a tuple of Python ints, got {s.draft.tokens!r}"
            bad = [t for t in s.draft.tokens if not 0 <= t < n_vocab]
            assert not bad, f"token ids {bad} are outside the vocabulary [0, {n_vocab})"
            if s.draft.probs is not None:
                p = s.draft.probs.float().cpu()
                assert p.shape == (len(s.draft), n_vocab), f"probs shape {tuple(p.shape)}, expected {(len(s.draft), n_vocab)}"
                assert torch.isfinite(p).all() and (p >= 0).all(), "probs must be finite and non-negative"
                assert torch.allclose(p.sum(-1), torch.ones(len(s.draft)), atol=1e-3), "each probs row must sum to 1"
                picked = p[torch.arange(len(s.draft)), torch.tensor(s.draft.tokens)]
                assert (picked > 0).all(), "a proposed token has probability 0 in its own draft distribution"
            if s.draft.confidence is not None:
                c = s.draft.confidence
                assert len(c) == len(s.draft) and all(isinstance(x, float) and 0.0 <= x <= 1.0 for x in c), \
                    f"confidence must be a probability (float) for each of the {len(s.draft)} tokens, got {c!r:.80}"
        self.require_drafts(d.drafts(), "three sequences")

    def test_never_more_than_the_limit(self, driver):
        """len(draft) <= limits.n_max for every limit asked, 1 included."""
        d = driver()
        limits = [1, 2, 3, 5, 8, 13]
        for i, text in enumerate(self.texts(3, 2)):
            d.begin(i, text, 30)
            k = 0
            while len(d.tokens[i]) < len(text):
                n_max = limits[k % len(limits)]
                s = d.step(i, n_max=n_max)
                assert s.draft is None or len(s.draft) <= n_max, f"asked for at most {n_max} tokens, got {len(s.draft)}"
                k += 1
        self.require_drafts(d.drafts(), "two sequences")

    def test_begin_resets(self, driver, shared):
        """After begin, a sequence id drafts as on a new speculator: nothing of the text it held
        before is used. (For shared speculators the earlier text uses other tokens.)"""
        old = self.texts(4, 1, alphabet=OTHER_ALPHABET if shared else ALPHABET)[0]
        rng = random.Random(5)
        pool = segment_pool(rng, ALPHABET)
        new = self.texts(6, 1, pool=pool)[0]
        if not shared:  # the earlier text shares segments with the new one, in another order
            old = self.texts(4, 1, pool=pool)[0]
        a, b = driver(), driver()
        a.begin(0, old, 30)
        a.run(0, len(old))
        mark = len(a.log)
        a.begin(0, new, 30)
        a.run(0, len(new))
        b.begin(0, new, 30)
        b.run(0, len(new))
        diff = same_steps(a.log[mark:], b.log)
        assert diff is None, f"after begin the speculator still used the sequence's earlier text: {diff}"
        self.require_drafts(b.drafts(), "the sequence after begin")

    @pytest.mark.parametrize("where", ["end of prompt", "middle"])
    def test_truncate_forgets_the_cut(self, driver, where):
        """After truncate(n) it drafts exactly as a twin that never saw the tokens after n."""
        text, other = self.texts(7, 2)
        a, b = driver(), driver()
        a.begin(0, text, 30)
        a.run(0, len(text) - 20)
        cut = 30 if where == "end of prompt" else [s.at for s in a.log][len(a.log) // 2]
        mark = len(a.log)
        a.truncate(0, cut)
        a.rescript(0, text[:cut] + other)
        a.run(0, cut + 60)
        b.begin(0, text, 30)
        b.run(0, cut)
        assert len(b.tokens[0]) == cut, "the twin did not retrace the same steps: the speculator is not deterministic"
        mark_b = len(b.log)
        b.rescript(0, text[:cut] + other)
        b.run(0, cut + 60)
        skip = 0
        if where == "end of prompt" and getattr(a.spec, "hidden_layers", ()):
            # The target computed the kept prompt before the cut, the twin's target has computed
            # nothing yet: a drafter that reads its hidden states may draft one step earlier.
            skip = 1
        diff = same_steps(a.log[mark + skip:], b.log[mark_b + skip:])
        assert diff is None, f"after truncate({cut}) the speculator still used the cut tokens: {diff}"
        self.require_drafts(a.drafts(since=mark), "the sequence after the truncate")

    def test_continues_into_a_new_request(self, driver):
        """The prompt cache: a later request whose prompt starts with the sequence's first n
        tokens and goes on with new text continues it, through truncate(n) with the new prompt
        as the history (no begin). It goes on drafting, on the new text too."""
        text, other = self.texts(11, 2)
        a = driver()
        a.begin(0, text, 30)
        a.run(0, 80)
        n = 60
        new = text[:n] + other
        a.resume(0, new, n + 40, n)
        mark = len(a.log)
        a.run(0, len(new))
        assert a.tokens[0] == new, "the driver did not follow the script"
        self.require_drafts(a.drafts(since=mark), "the request continued from a kept state")

    def test_sequences_do_not_leak(self, driver, shared):
        """A sequence drafts the same whether or not other sequences run alongside it (drafted
        in the same batch, begun, truncated, ended). (For shared speculators the others use
        unrelated tokens.)"""
        rng = random.Random(8)
        pool = segment_pool(rng, ALPHABET)
        mine = self.texts(9, 1, pool=pool)[0]
        others = self.texts(10, 3, alphabet=OTHER_ALPHABET) if shared else self.texts(10, 3, pool=pool)
        b = driver()
        b.begin(0, mine, 30)
        b.run(0, len(mine))
        a = driver()
        a.begin(0, mine, 30)
        a.begin(1, others[0], 25)
        events = {10: lambda: a.begin(2, others[1], 20), 15: lambda: a.truncate(1, 30),
                  20: lambda: (a.end(2), a.begin(3, others[2], 20))}  # a new sequence after one ended
        n = 0
        while len(a.tokens[0]) < len(mine):
            a.step_many([i for i in a.tokens if len(a.tokens[i]) < len(a.scripts[i])])
            n += 1
            if n in events:
                events[n]()
        diff = same_steps([s for s in a.log if s.seq_id == 0], b.log)
        assert diff is None, f"other sequences changed sequence 0's drafts: {diff}"
        self.require_drafts(b.drafts(), "sequence 0")

    def test_checkpoint_round_trips(self, driver):
        """With a target that can only be saved and restored, the engine saves before each
        verification and restores (or discards) after it: the drafts must be those of a plain
        run. A speculator that implements checkpoint must also undo, on restore, whatever it
        was fed after the save."""
        text = self.texts(11, 1)[0]
        b = driver()
        b.begin(0, text, 30)
        b.run(0, len(text))
        self.require_drafts(b.drafts(), "the sequence")
        runs = {"engine's calls": False}
        if b.hook.checkpoint.get_hookimpls():
            runs["restore after more text"] = True
        for what, meddle in runs.items():
            a = driver()
            a.begin(0, text, 30)
            a.run(0, len(text), checkpoint=True, meddle=meddle)
            diff = same_steps(a.log, b.log)
            assert diff is None, f"with checkpoints ({what}) the drafts changed: {diff}"

    def test_deterministic_for_a_seed(self, driver):
        """Two instances built with the same options (seed included) draft the same."""
        texts = self.texts(12, 2)
        logs = []
        for _ in range(2):
            d = driver()
            for i, text in enumerate(texts):
                d.begin(i, text, 30)
            d.run_all()
            logs.append(d.log)
        diff = same_steps(*logs)
        assert diff is None, f"two instances with the same seed drafted differently: {diff}"
        self.require_drafts([s for s in logs[0] if s.draft is not None], "two sequences")

    # --- end to end on a tiny model ---------------------------------------------------------------
    def test_engine_greedy_equals_plain_decoding(self, make, tiny_models):
        """Temperature 0: the engine with the speculator emits exactly plain decoding's tokens,
        for several sequences decoded together."""
        engine = Engine(tiny_models.target, EngineConfig(n_ctx=256, draft_n_max=8, adaptive=False), [make()])
        seqs = [engine.add(p, tiny_models.n_new, SamplingParams()) for p in tiny_models.prompts]
        while engine.active():
            engine.step()
        for i, (seq, ref) in enumerate(zip(seqs, tiny_models.greedy)):
            got = seq.tokens[seq.n_prompt:]
            assert seq.spec_error is None, f"the speculator raised: {seq.spec_error}"
            assert got == ref, f"sequence {i}: speculative output differs from plain decoding at token " \
                               f"{next(j for j, (x, y) in enumerate(zip(got + [-1], ref + [-2])) if x != y)}"
        assert sum(s.drafts for s in engine.spec_stats.values()) > 0, "no draft was verified, so this test checks nothing"

    def test_engine_sampling_follows_the_target_distribution(self, make, tiny_models):
        """Temperature > 0: every emitted token is distributed as the target's sampler says.
        Each token's probability-integral transform (randomized for discrete tokens) against
        the target's distribution at its position must be uniform: a chi-square test over all
        tokens of many sequences. Also: the same seeds give the same tokens again."""
        params = [SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=SEED + i) for i in range(48)]
        prompts = [tiny_models.prompts[i % len(tiny_models.prompts)] for i in range(len(params))]

        def run(n):
            engine = Engine(tiny_models.target, EngineConfig(n_ctx=256, draft_n_max=8, adaptive=False), [make()])
            seqs = [engine.add(p, 40, sp) for p, sp in zip(prompts[:n], params[:n])]
            while engine.active():
                engine.step()
            for s in seqs:
                assert s.spec_error is None, f"the speculator raised: {s.spec_error}"
            return [s.tokens for s in seqs], sum(st.drafts for st in engine.spec_stats.values())

        outputs, n_drafts = run(len(params))
        assert n_drafts > 0, "no draft was verified, so this test checks nothing"
        stat, n = pit_chi_square(tiny_models.target, outputs, [len(p) for p in prompts], params)
        assert stat < CHI2_CRIT_19_DF, (f"the {n} sampled tokens are not distributed as the target's sampler: "
                                        f"chi-square {stat:.1f} >= {CHI2_CRIT_19_DF} (19 df, p = 1e-4)")
        again, _ = run(8)
        assert again == outputs[:8], "the same seeds gave different tokens"

    def test_a_restored_state_drafts_as_the_kept_one(self, make, tiny_models):
        """A speculator that drafts from the target's hidden states implements ``export_state``
        and ``import_state``: a conversation restored from a slot file (the target's rows, and
        the speculators' states it exported) drafts exactly as the process that saved it would
        have. (A speculator on tokens alone rebuilds its state in ``begin`` and needs neither.)"""
        probe = make()
        hooks = {h for h in ("export_state", "import_state") if callable(getattr(probe, h, None))}
        if not getattr(probe, "hidden_layers", ()) and not hooks:
            return
        assert hooks == {"export_state", "import_state"}, \
            "a speculator on hidden states needs export_state and import_state (a restored slot brings no hidden states)"

        def engine():
            return Engine(tiny_models.target, EngineConfig(n_ctx=512, draft_n_max=4, adaptive=False, spec_deadline=None), [make()])

        def finish(e, seq):
            while e.active():
                e.step()
            assert seq.spec_error is None, f"the speculator raised: {seq.spec_error}"
            d = seq.stats.drafts
            return seq.tokens[seq.n_prompt:], (d.drafts, d.drafted, d.accepted), seq.n_reused

        # A first prompt of 64 tokens or more: its rows compute as a longer prompt's do, so that
        # the next request reuses them (Engine.reusable).
        prompt = [t for p in tiny_models.prompts for t in p][:96]
        saving = engine()
        first = saving.add(prompt, tiny_models.n_new)
        finish(saving, first)
        entry = saving.keep(first)
        states = saving.speculator_states(entry)
        kv = {k: v[:, : len(entry.tokens)].clone() for k, v in saving.context.get_state(entry.seq_id).items()}
        follow = list(entry.tokens) + list(tiny_models.prompts[1])
        kept = finish(saving, saving.add(follow, tiny_models.n_new, cached=entry))
        assert kept[1][1] > 0, "no draft after the first turn, so this test checks nothing"
        restored = engine()
        got = finish(restored, restored.add(follow, tiny_models.n_new,
                                            cached=restored.adopt(list(entry.tokens), entry.row_prompts, kv, spec_states=states)))
        assert got[2] > 0 and kept[2] > 0, "the second turn reused none of the first's rows, so this test checks nothing"
        assert got[:2] == kept[:2], \
            f"restored from its exported state it drafted {got[1]} (drafts, tokens, accepted), kept {kept[1]}"

    # --- the suite itself ------------------------------------------------------------------------
    def test_contract_declarations(self, speculator_class):
        """contract_xfail names real contract tests, each with a reason."""
        declared = getattr(speculator_class, "contract_xfail", {})
        names = {n for n in dir(SpeculatorContract) if n.startswith("test_")}
        for name, reason in declared.items():
            assert name in names, f"contract_xfail names '{name}', which is not a contract test ({', '.join(sorted(names))})"
            assert isinstance(reason, str) and reason.strip(), f"contract_xfail['{name}'] needs a reason"

    def test_contract_is_complete(self):
        """No contract test was removed from this class (e.g. by setting it to None)."""
        missing = [n for n in dir(SpeculatorContract) if n.startswith("test_") and not callable(getattr(type(self), n, None))]
        assert not missing, f"contract tests removed: {missing}"


def pit_chi_square(model, outputs: list[list[int]], n_prompts: list[int], params: list[SamplingParams], bins: int = 20):
    """Chi-square statistic of the randomized probability-integral transforms of the generated
    tokens under the target's own distributions (one teacher-forced forward per sequence)."""
    ctx = model.new_context(max(len(o) for o in outputs) + 1)
    batch = Batch.concat([Batch.for_sequence(i, 0, o, logits="all") for i, o in enumerate(outputs)])
    logits = model.forward(batch, ctx).logits
    rng = torch.Generator().manual_seed(SEED)
    counts = torch.zeros(bins)
    row = 0
    for o, n_prompt, sp in zip(outputs, n_prompts, params):
        sampler = Sampler(sp)
        for j in range(n_prompt, len(o)):
            p = sampler.probs(logits[row + j - 1]).double()
            below = float(p[: o[j]].sum())
            u = below + float(torch.rand((), generator=rng, dtype=torch.float64)) * float(p[o[j]])
            counts[min(int(u * bins), bins - 1)] += 1
        row += len(o)
    n = float(counts.sum())
    expected = n / bins
    return float(((counts - expected) ** 2 / expected).sum()), int(n)
