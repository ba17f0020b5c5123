"""The contract suite itself: each contract test fails for a speculator or backend that breaks
its rule, declared expected failures and overrides are handled as promised, --speculant-plugin
selects. Broken plugins are installed the honest way (dist-info with an entry point on sys.path)
and the suite runs in an inner pytest session (pytester)."""
from __future__ import annotations

import sys

import pytest

from fake_dists import write_dist

pytest_plugins = ["pytester"]

PLUGIN = '''
import random

import torch

from speculant import DeviceUnavailable, Draft, hookimpl


class Lookup:
    """Correct: the tokens that followed the last earlier occurrence of the last two tokens."""
    spec_type = "lookup"

    def __init__(self, config):
        self.n_vocab = config.target.info.n_vocab

    def history(self, seq):
        return list(seq.tokens)

    @hookimpl
    def propose(self, seq, limits):
        t = self.history(seq)
        key = t[-2:]
        for i in range(len(t) - 3, 0, -1):
            if t[i - 1 : i + 1] == key:
                follow = self.shape(tuple(t[i + 1 : i + 1 + limits.n_max]), limits)
                return Draft(follow, self.spec_type, self.probs(follow)) if follow else None
        return None

    def shape(self, tokens, limits):
        return tokens

    def probs(self, tokens):
        return None


class TooLong(Lookup):
    def shape(self, tokens, limits):
        return tokens + tokens[:2]


class OutOfVocab(Lookup):
    def shape(self, tokens, limits):
        return tuple(t + self.n_vocab for t in tokens)


class Empty(Lookup):
    @hookimpl
    def propose(self, seq, limits):
        return Lookup.propose(self, seq, limits) or Draft((), self.spec_type)


class Unseeded(Lookup):
    def shape(self, tokens, limits):
        return tokens[: random.randint(1, len(tokens))]


class UniformProbs(Lookup):
    """Drafts random byte tokens (ids below 128) but claims they were drawn from the whole
    vocabulary: rejection sampling then keeps them up to four times too often."""
    @hookimpl
    def propose(self, seq, limits):
        g = torch.Generator().manual_seed(len(seq.tokens) * 1000 + seq.seq_id)
        tokens = tuple(torch.randint(0, 128, (limits.n_max,), generator=g).tolist())
        return Draft(tokens, self.spec_type, torch.full((len(tokens), self.n_vocab), 1.0 / self.n_vocab))


class Stateful(Lookup):
    """Keeps its own copy of each sequence's history, updated from accept."""
    def __init__(self, config):
        super().__init__(config)
        self.seqs = {}

    def history(self, seq):
        return self.seqs.setdefault(seq.seq_id, list(seq.tokens))

    @hookimpl
    def begin(self, seq):
        self.seqs[seq.seq_id] = list(seq.tokens)

    @hookimpl
    def accept(self, seq):
        h = self.history(seq)
        h.extend(seq.tokens[len(h):])

    @hookimpl
    def truncate(self, seq, n):
        del self.history(seq)[n:]


class IgnoresTruncate(Stateful):
    @hookimpl
    def truncate(self, seq, n):
        pass


class KeepsOnBegin(Stateful):
    @hookimpl
    def begin(self, seq):
        self.seqs.setdefault(seq.seq_id, []).extend(seq.tokens)


class OneHistory(Lookup):
    """Also looks in the other sequences' histories (and does not declare it)."""
    def __init__(self, config):
        super().__init__(config)
        self.all = {}

    @hookimpl
    def accept(self, seq):
        self.all[seq.seq_id] = list(seq.tokens)

    def history(self, seq):
        return [t for i, h in self.all.items() if i != seq.seq_id for t in h] + list(seq.tokens)


class NoRestore(Stateful):
    """Implements checkpoint but does not undo anything on restore."""
    @hookimpl
    def checkpoint(self, seq, action):
        pass


class DeclaresTooMuch(Lookup):
    contract_xfail = {"test_never_more_than_the_limit": "(it does not fail it)"}


SPECULATORS = {"good-lookup": Lookup, "bad-limit": TooLong, "bad-ids": OutOfVocab, "bad-empty": Empty,
               "bad-unseeded": Unseeded, "bad-probs": UniformProbs, "bad-truncate": IgnoresTruncate,
               "bad-begin": KeepsOnBegin, "bad-leak": OneHistory, "bad-restore": NoRestore,
               "declares-too-much": DeclaresTooMuch}


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)
'''

BACKENDS = '''
import torch

from speculant import DeviceUnavailable, hookimpl
from speculant_cpu.backend import CpuBackend


class Off(CpuBackend):
    name = "fake-off"

    def linear(self, weight, bias=None):
        lin = super().linear(weight, bias)
        return lambda x: lin(x) * 1.05


class Variant(CpuBackend):
    name = "fake-variant"

    def attention(self, q, k, v, positions, scale, window=0):
        return super().attention(q, k, v, positions, scale, window) * (1 + 1e-6 * q.shape[0])


class Missing(CpuBackend):
    name = "fake-missing"

    def __init__(self):
        raise DeviceUnavailable("no fake accelerator here")


@hookimpl
def speculant_register_backends(register):
    register("fake-off", Off)
    register("fake-variant", Variant)
    register("fake-missing", Missing)
'''


@pytest.fixture
def install(tmp_path, monkeypatch):
    """install(dist, module source): an installed distribution with entry point `dist` -> module."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)

    def install(dist: str, source: str) -> None:
        module = f"fakecontract_{dist.replace('-', '_')}"
        write_dist(root, dist, "1.0", {dist: module}, {f"{module}.py": source})

    yield install
    for name in set(sys.modules) - before:
        if name.startswith("fakecontract_"):
            del sys.modules[name]


def outcomes(reprec) -> dict[str, str]:
    """test id (the part after '::') -> passed / failed / skipped / xfailed / error."""
    out = {}
    for r in reprec.getreports("pytest_runtest_logreport"):
        name = r.nodeid.split("::", 1)[1]
        if r.when == "call" or r.outcome != "passed":
            xfail = hasattr(r, "wasxfail")
            out[name] = "xfailed" if xfail and r.skipped else ("error" if r.failed and r.when != "call" else r.outcome)
    return out


def test_each_broken_speculator_fails_its_contract_test(pytester, install):
    install("badspecs", PLUGIN)
    expected_failures = {
        "bad-limit": "test_never_more_than_the_limit",
        "bad-ids": "test_proposes_only_valid_tokens",
        "bad-empty": "test_proposes_only_valid_tokens",
        "bad-unseeded": "test_deterministic_for_a_seed",
        "bad-probs": "test_engine_sampling_follows_the_target_distribution",
        "bad-truncate": "test_truncate_forgets_the_cut[{}-middle]",
        "bad-begin": "test_begin_resets",
        "bad-leak": "test_sequences_do_not_leak",
        "bad-restore": "test_checkpoint_round_trips",
    }
    # each broken one only with the test it breaks (plus two it does not), the correct one with all
    pairs = [f"({t.split('[')[0]} and {n})" for n, t in expected_failures.items()]
    pairs += ["(test_never_more_than_the_limit and (bad-ids or declares-too-much))", "(test_proposes_only_valid_tokens and bad-limit)"]
    reprec = pytester.inline_run("--pyargs", "speculant.testing.suite", "--speculant-plugin", "badspecs", "-p", "no:cacheprovider",
                                 "-k", f"TestSpeculators and (good-lookup or {' or '.join(pairs)})")
    got = outcomes(reprec)
    for name, test in expected_failures.items():
        test = test.format(name) if "{}" in test else f"{test}[{name}]"
        assert got[f"TestSpeculators::{test}"] == "failed", f"{name} should fail {test}"
    # the correct speculator passes all of them; a declared failure that does not happen is an error
    good = {k: v for k, v in got.items() if "[good-lookup" in k}
    assert good and set(good.values()) == {"passed"}, good
    assert got["TestSpeculators::test_never_more_than_the_limit[declares-too-much]"] == "failed"  # strict XPASS
    # and every bad one passes the tests it does not break (a failure means something, not noise)
    assert got["TestSpeculators::test_never_more_than_the_limit[bad-ids]"] == "passed"
    assert got["TestSpeculators::test_proposes_only_valid_tokens[bad-limit]"] == "passed"


def test_declared_xfail_override_guard_and_selection(pytester, install):
    install("goodspec", PLUGIN.replace('"bad-limit": TooLong', '"bad-limit2": TooLong').replace(
        'SPECULATORS = {', 'SPECULATORS = {"declared": type("Declared", (TooLong,), {"contract_xfail": '
        '{"test_never_more_than_the_limit": "drafts two tokens too many"}}), '))
    pytester.makepyfile(test_mine='''
        import pytest
        from speculant.testing import SpeculatorContract


        class TestQuiet(SpeculatorContract):
            spec_types = ("bad-limit2",)

            def test_never_more_than_the_limit(self):  # silently "fixed"
                pass


        class TestOpen(SpeculatorContract):
            spec_types = ("bad-limit2",)

            @pytest.mark.xfail(reason="known: drafts two tokens too many", strict=True)
            def test_never_more_than_the_limit(self, driver):
                SpeculatorContract.test_never_more_than_the_limit(self, driver)


        class TestDeclared(SpeculatorContract):
            spec_types = ("declared",)
    ''')
    reprec = pytester.inline_run("-k", "test_never_more_than_the_limit or test_contract", "-p", "no:cacheprovider")
    got = outcomes(reprec)
    assert got["TestQuiet::test_never_more_than_the_limit"] == "failed"
    failure = [r for r in reprec.getreports("pytest_runtest_logreport") if "TestQuiet::test_never" in r.nodeid and r.failed]
    assert "overrides the contract test" in str(failure[0].longrepr)
    assert got["TestOpen::test_never_more_than_the_limit[bad-limit2]"] == "xfailed"
    assert got["TestDeclared::test_never_more_than_the_limit[declared]"] == "xfailed"
    assert got["TestDeclared::test_contract_declarations[declared]"] == "passed"
    assert got["TestDeclared::test_contract_is_complete"] == "passed"

    # --speculant-plugin: a name that matches nothing is a usage error naming what exists
    result = pytester.runpytest("--pyargs", "speculant.testing.suite", "--speculant-plugin", "nosuch", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--speculant-plugin nosuch: no installed plugin*speculators:*bad-limit2*"])


def test_broken_backends_fail_and_missing_devices_skip(pytester, install):
    install("fakebackends", BACKENDS)
    install("brokenplug", "raise ImportError('libfake.so: cannot open shared object file')\n")
    reprec = pytester.inline_run("--pyargs", "speculant.testing.suite", "--speculant-plugin", "fakebackends",
                                 "-k", "Q8_0 or attention or device", "-p", "no:cacheprovider")
    got = outcomes(reprec)
    assert got["TestBackends::test_linear_matches_reference[fake-off-Q8_0]"] == "failed"
    assert got["TestBackends::test_linear_is_batch_invariant[fake-off-Q8_0]"] == "passed"
    assert got["TestBackends::test_attention_rows_are_independent[fake-variant-0]"] == "failed"
    assert got["TestBackends::test_attention_matches_reference[fake-variant-1-7-0]"] == "passed"
    missing = {k: v for k, v in got.items() if "fake-missing" in k}
    assert missing and set(missing.values()) == {"skipped"}
    skip = next(r for r in reprec.getreports("pytest_runtest_logreport") if "fake-missing" in r.nodeid and r.skipped)
    assert "no fake accelerator here" in str(skip.longrepr)
    assert not [k for k in got if "TestSpeculators" in k]  # --speculant-plugin selected backends only

    reprec = pytester.inline_run("--pyargs", "speculant.testing.suite", "-k", "TestPlugins", "-p", "no:cacheprovider")
    got = outcomes(reprec)
    assert got["TestPlugins::test_plugin_loads[brokenplug]"] == "failed"
    assert got["TestPlugins::test_plugin_loads[fakebackends]"] == "passed"
    assert got["TestPlugins::test_plugin_loads[cpu]"] == "passed"
    result = pytester.runpytest("--pyargs", "speculant.testing.suite", "--speculant-plugin", "brokenplug", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*brokenplug: the plugin failed to load: ImportError: libfake.so*"])
