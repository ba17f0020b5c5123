"""Plugin discovery (speculant.plugins) and the speculator chain behind the lifecycle hooks.

Third-party plugins are simulated honestly: real `*.dist-info` directories with entry_points.txt
and real module files, written to a temporary directory put on sys.path, so importlib.metadata
discovers them exactly as it would an installed package.
"""
from __future__ import annotations

import sys
import time
import types

import pluggy
import pytest

from fake_dists import write_dist
import torch

from speculant import Draft, DraftLimits, SequenceView, SpeculantError, hookimpl
from speculant.chain import SpeculatorChain
from speculant.errors import ModelFileError
from speculant.loader import load_model
from speculant.plugins import load_registry
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_cpu.backend import CpuBackend
from speculant_transformer.gemma3 import Gemma3Model
from speculant_transformer.llama import LlamaModel

ARCHS = ["gemma3", "lfm2", "llama", "qwen2", "qwen3", "qwen35"]  # the transformer plugin's
ALL_ARCHS = sorted(ARCHS + ["eagle3", "dflash"])  # with the eagle3 and dflash plugins' drafter layouts


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("SPECULANT_PLUGINS", raising=False)
    monkeypatch.delenv("SPECULANT_DISABLE_PLUGINS", raising=False)
    modules = set(sys.modules)
    yield
    for name in set(sys.modules) - modules:  # forget the fake plugins' modules
        if name.startswith("fakeplug_"):
            del sys.modules[name]


def module(name: str, **hooks) -> types.ModuleType:
    """A module-like plugin object holding the given hook implementations."""
    m = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(m, hook, hookimpl(fn))
    return m


class FakeDists:
    """Writes installed-looking distributions into a directory appended to sys.path."""

    def __init__(self, tmp_path, monkeypatch):
        self.root = tmp_path / "site"
        self.root.mkdir()
        monkeypatch.setattr(sys, "path", sys.path + [str(self.root)])  # after the real site-packages

    def add(self, dist: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "1.0"):
        write_dist(self.root, dist, version, entry_points, {f"{mod}.py": source for mod, source in modules.items()})


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    return FakeDists(tmp_path, monkeypatch)


SPECULATOR_PLUGIN = """
    from speculant import hookimpl

    class Lookahead:
        spec_type = "lookahead"

    @hookimpl
    def speculant_register_speculators(register):
        register("test-lookahead", Lookahead)
"""


# ---------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------

def test_first_party_plugins_are_found_as_entry_points():
    reg = load_registry()
    assert reg.names("backend") == ["cpu"]
    assert reg.names("architecture") == ALL_ARCHS
    assert reg.get("backend", "cpu") is CpuBackend
    assert reg.get("architecture", "llama") == LlamaModel.load
    assert reg.get("architecture", "qwen2") == LlamaModel.load and reg.get("architecture", "qwen3") == LlamaModel.load
    assert reg.get("architecture", "gemma3") == Gemma3Model.load
    by_name = {p.name: p for p in reg.plugins}
    assert {"cpu", "transformer"} <= set(by_name)  # (more first-party plugins may come)
    for p in (by_name["cpu"], by_name["transformer"]):
        assert p.distribution == "speculant" and p.version and p.error is None and p.module is not None
    # every registration is attributed to its plugin
    assert reg.entries[("backend", "cpu")].plugin.name == "cpu"
    assert {reg.entries[("architecture", a)].plugin.name for a in ARCHS} == {"transformer"}


def test_extra_plugin_registers_a_speculator():
    class MySpec:
        spec_type = "mine"

    plugin = module("my_plugin", speculant_register_speculators=lambda register: register("mine", MySpec))
    reg = load_registry(extra_plugins=[("mine-plugin", plugin)])
    assert "mine" in reg.names("speculator") and reg.get("speculator", "mine") is MySpec
    entry = reg.entries[("speculator", "mine")]
    assert entry.plugin.name == "mine-plugin" and entry.plugin.distribution == "(registered in process)"
    assert reg.names("backend") == ["cpu"] and reg.names("architecture") == ALL_ARCHS  # installed ones still there
    # a plain object (not a module) works too, and may register several kinds
    class Obj:
        @hookimpl
        def speculant_register_speculators(self, register):
            register("other", MySpec)

        @hookimpl
        def speculant_register_backends(self, register):
            register("fake-device", CpuBackend)

    reg = load_registry(extra_plugins=[("obj-plugin", Obj())])
    assert reg.get("speculator", "other") is MySpec and reg.names("backend") == ["cpu", "fake-device"]
    assert reg.entries[("backend", "fake-device")].plugin.name == "obj-plugin"


def test_same_name_from_two_plugins_is_an_error_naming_both():
    a = module("a", speculant_register_speculators=lambda register: register("test-dup", type("A", (), {})))
    b = module("b", speculant_register_speculators=lambda register: register("test-dup", type("B", (), {})))
    with pytest.raises(SpeculantError) as e:
        load_registry(extra_plugins=[("plugin-a", a), ("plugin-b", b)])
    msg = str(e.value)
    assert "speculator 'test-dup'" in msg and "'plugin-a'" in msg and "'plugin-b'" in msg
    assert "(registered in process)" in msg

    # clashing with an installed plugin names its distribution
    c = module("c", speculant_register_backends=lambda register: register("cpu", type("OtherCpu", (), {})))
    with pytest.raises(SpeculantError) as e:
        load_registry(extra_plugins=[("plugin-c", c)])
    msg = str(e.value)
    assert "backend 'cpu'" in msg and "plugin 'cpu' (distribution speculant)" in msg and "'plugin-c'" in msg
    assert "SPECULANT_DISABLE_PLUGINS" in msg

    # the same object under the same name twice is not a clash
    shared = type("Shared", (), {})
    d1 = module("d1", speculant_register_speculators=lambda register: register("s", shared))
    d2 = module("d2", speculant_register_speculators=lambda register: register("s", shared))
    assert load_registry(extra_plugins=[("d1", d1), ("d2", d2)]).get("speculator", "s") is shared


def test_trainers_from_plugins_join_one_train_command(monkeypatch, capsys):
    """A plugin's speculant_add_trainers adds a method to `speculant train` beside eagle3's, and a
    method two plugins add is an error naming both: MTP and DFlash trainers need not fight over
    one `train` command."""
    import speculant.cli
    import speculant.plugins

    ran = []

    def add(subparsers, register):
        p = subparsers.add_parser("toy-head", help="train a toy head")
        p.add_argument("--steps", type=int, default=1)
        register("toy-head", lambda args: ran.append(args.steps) or 0)

    reg = load_registry(extra_plugins=[("toy-trainer", module("toy_trainer", speculant_add_trainers=add))])
    monkeypatch.setattr(speculant.plugins, "_default", reg)
    assert speculant.cli.main(["train", "toy-head", "--steps", "3"]) == 0 and ran == [3]
    assert speculant.cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "toy-head" in out and "eagle3" in out

    clash = module("clash", speculant_add_trainers=lambda subparsers, register: register("eagle3", lambda a: 0))
    monkeypatch.setattr(speculant.plugins, "_default", load_registry(extra_plugins=[("clash-plugin", clash)]))
    assert speculant.cli.main(["train", "eagle3", "--help"]) == 2
    err = capsys.readouterr().err
    assert "trainer 'eagle3' is added twice" in err and "'eagle3'" in err and "'clash-plugin'" in err


def test_disable_plugins_removes_the_architectures(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "transformer")
    reg = load_registry()
    assert reg.names("architecture") == ["dflash", "eagle3"] and reg.names("backend") == ["cpu"]
    assert "transformer" not in [p.name for p in reg.plugins] and "cpu" in [p.name for p in reg.plugins]
    path = write_tiny_model(tmp_path / "m.gguf", "llama")
    with pytest.raises(ModelFileError, match=r"architecture .llama. is not supported \(supported: dflash, eagle3\)"):
        load_model(path, registry=reg, progress=False)
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", " transformer , cpu ")  # a comma list, spaces ignored
    reg = load_registry()
    assert reg.names("architecture") == ["dflash", "eagle3"] and reg.names("backend") == []


def test_plugins_allow_list(monkeypatch):
    monkeypatch.setenv("SPECULANT_PLUGINS", "cpu")
    reg = load_registry()
    assert [p.name for p in reg.plugins] == ["cpu"]
    assert reg.names("backend") == ["cpu"] and reg.names("architecture") == []
    monkeypatch.setenv("SPECULANT_PLUGINS", "cpu,transformer")
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "cpu")  # the block list wins over the allow list
    reg = load_registry()
    assert reg.names("backend") == [] and reg.names("architecture") == ARCHS


def test_third_party_distribution_is_discovered(fake_dists):
    fake_dists.add("speculant-lookahead", {"lookahead": "fakeplug_lookahead"}, {"fakeplug_lookahead": SPECULATOR_PLUGIN}, "2.3.1")
    reg = load_registry()
    cls = reg.get("speculator", "test-lookahead")
    assert cls.__name__ == "Lookahead" and cls.__module__ == "fakeplug_lookahead"
    info = reg.entries[("speculator", "test-lookahead")].plugin
    assert (info.name, info.distribution, info.version, info.error) == ("lookahead", "speculant-lookahead", "2.3.1", None)
    assert reg.names("backend") == ["cpu"] and reg.names("architecture") == ALL_ARCHS


def test_plugin_whose_import_fails_is_recorded_and_skipped(fake_dists):
    fake_dists.add("speculant-cuda", {"cuda": "fakeplug_cuda"},
                   {"fakeplug_cuda": 'raise ImportError("libcudart.so.12: cannot open shared object file")\n'})
    fake_dists.add("speculant-missing", {"missing": "fakeplug_not_there"}, {})
    fake_dists.add("speculant-lookahead", {"lookahead": "fakeplug_lookahead2"}, {"fakeplug_lookahead2": SPECULATOR_PLUGIN})
    reg = load_registry()
    by_name = {p.name: p for p in reg.plugins}
    cuda = by_name["cuda"]
    assert cuda.distribution == "speculant-cuda" and cuda.version == "1.0" and cuda.module is None
    assert cuda.error == "ImportError: libcudart.so.12: cannot open shared object file"
    assert by_name["missing"].error.startswith("ModuleNotFoundError:") and "fakeplug_not_there" in by_name["missing"].error
    # everything else still loads
    assert by_name["lookahead"].error is None and "test-lookahead" in reg.names("speculator")
    assert reg.names("backend") == ["cpu"] and reg.names("architecture") == ALL_ARCHS
    with pytest.raises(SpeculantError, match=r"unknown backend 'cuda' \(available: cpu\)"):
        reg.get("backend", "cuda")


def test_installed_plugins_registering_one_name_name_both_distributions(fake_dists):
    fake_dists.add("speculant-llama-fast", {"llamafast": "fakeplug_llamafast"}, {"fakeplug_llamafast": """
        from speculant import hookimpl

        @hookimpl
        def speculant_register_architectures(register):
            register("llama", lambda gguf, backend, progress: None)
    """})
    with pytest.raises(SpeculantError) as e:
        load_registry()
    msg = str(e.value)
    assert "architecture 'llama' is registered twice" in msg
    assert "plugin 'transformer' (distribution speculant)" in msg
    assert "plugin 'llamafast' (distribution speculant-llama-fast)" in msg


def test_duplicate_entry_point_name_is_skipped(fake_dists):
    fake_dists.add("speculant-othercpu", {"cpu": "fakeplug_othercpu"}, {"fakeplug_othercpu": "raise AssertionError('never imported')\n"})
    reg = load_registry()
    skipped = [p for p in reg.plugins if p.distribution == "speculant-othercpu"]
    assert len(skipped) == 1 and skipped[0].error == "duplicate entry-point name, skipped"
    assert reg.get("backend", "cpu") is CpuBackend and "fakeplug_othercpu" not in sys.modules


def test_env_lists_apply_to_third_party_plugins(fake_dists, monkeypatch):
    fake_dists.add("speculant-cuda", {"cuda": "fakeplug_cuda2"}, {"fakeplug_cuda2": "raise ImportError('no GPU')\n"})
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "cuda")
    reg = load_registry()
    assert "cuda" not in [p.name for p in reg.plugins] and "fakeplug_cuda2" not in sys.modules


def test_get_unknown_name_lists_what_is_available(monkeypatch):
    monkeypatch.setenv("SPECULANT_PLUGINS", "cpu,transformer")  # no speculator plugins
    reg = load_registry()
    with pytest.raises(SpeculantError, match=r"unknown architecture 'mamba' \(available: gemma3, lfm2, llama, qwen2, qwen3, qwen35\)"):
        reg.get("architecture", "mamba")
    with pytest.raises(SpeculantError, match=r"unknown speculator 'eagle3' \(available: none installed\)"):
        reg.get("speculator", "eagle3")


# ---------------------------------------------------------------------------------------------
# The speculator chain
# ---------------------------------------------------------------------------------------------

SEQ = SequenceView(0, (1, 2, 3), 3)
LIMITS = DraftLimits(n_max=4)


class Spec:
    """A speculator that proposes fixed tokens (None: nothing) and logs every hook call."""

    def __init__(self, name, toks=None, log=None, hidden_layers=()):
        self.spec_type, self.toks, self.hidden_layers = name, toks, hidden_layers
        self.log = [] if log is None else log

    @hookimpl
    def begin(self, seq):
        self.log.append((self.spec_type, "begin"))

    @hookimpl
    def propose(self, seq, limits):
        self.log.append((self.spec_type, "propose"))
        return None if self.toks is None else Draft(tuple(self.toks), self.spec_type)

    @hookimpl
    def accept(self, seq, draft, n_accepted, hidden):
        self.log.append((self.spec_type, "accept", n_accepted))

    @hookimpl
    def truncate(self, seq, n):
        self.log.append((self.spec_type, "truncate", n))

    @hookimpl
    def end(self, seq_id):
        self.log.append((self.spec_type, "end"))


def test_chain_calls_speculators_in_user_order():
    log = []
    chain = SpeculatorChain([Spec("c", log=log), Spec("a", log=log), Spec("b", log=log)])
    chain.begin(SEQ)
    chain.accept(SEQ, None, 0, {})
    chain.truncate(SEQ, 2)
    chain.end(0)
    assert log == [("c", "begin"), ("a", "begin"), ("b", "begin"),
                   ("c", "accept", 0), ("a", "accept", 0), ("b", "accept", 0),
                   ("c", "truncate", 2), ("a", "truncate", 2), ("b", "truncate", 2),
                   ("c", "end"), ("a", "end"), ("b", "end")]
    assert chain.speculators[0].spec_type == "c" and bool(chain) and not SpeculatorChain([])


def test_propose_falls_through_to_the_first_speculator_with_a_draft():
    log = []
    chain = SpeculatorChain([Spec("none1", None, log), Spec("x", [7, 8], log), Spec("y", [9], log)])
    draft = chain.propose(SEQ, LIMITS)
    assert draft == Draft((7, 8), "x")
    assert log == [("none1", "propose"), ("x", "propose")]  # firstresult: y is never asked
    log.clear()
    chain = SpeculatorChain([Spec("none1", None, log), Spec("none2", None, log)])
    assert chain.propose(SEQ, LIMITS) is None and len(log) == 2
    # a speculator without a propose hook (a pure observer) is skipped
    class Observer:
        @hookimpl
        def begin(self, seq):
            pass

    assert SpeculatorChain([Observer(), Spec("z", [4])]).propose(SEQ, LIMITS).tokens == (4,)


def test_empty_draft_is_no_draft_and_ends_the_search():
    """propose is firstresult: returning an empty Draft answers the call (with nothing), so
    speculators must return None to let the next one try, as the hookspec says."""
    log = []
    chain = SpeculatorChain([Spec("empty", [], log), Spec("x", [5], log)])
    assert chain.propose(SEQ, LIMITS) is None
    assert SpeculatorChain([Spec("none", None, log), Spec("x", [5], log)]).propose(SEQ, LIMITS) == Draft((5,), "x")


def test_propose_respects_limits():
    spec = Spec("long", [1, 2, 3, 4, 5, 6])
    chain = SpeculatorChain([spec])
    assert chain.propose(SEQ, DraftLimits(n_max=0)) is None and spec.log == []  # not even asked
    assert chain.propose(SEQ, DraftLimits(n_max=3)).tokens == (1, 2, 3)

    class WithProbs:
        @hookimpl
        def propose(self, seq, limits):
            return Draft((1, 2, 3, 4), "p", torch.eye(4, 8))

    d = SpeculatorChain([WithProbs()]).propose(SEQ, DraftLimits(n_max=2))
    assert d.tokens == (1, 2) and d.spec_type == "p" and torch.equal(d.probs, torch.eye(4, 8)[:2])


def test_hidden_layers_are_the_union_of_the_speculators():
    chain = SpeculatorChain([Spec("a", hidden_layers=(3, 1)), Spec("b"), Spec("c", hidden_layers=(1, 24))])
    assert chain.hidden_layers == (1, 3, 24)


def test_misspelled_hook_is_rejected():
    class Typo:
        @hookimpl
        def propse(self, seq, limits):  # noqa: misspelled on purpose
            return None

    with pytest.raises(pluggy.PluginValidationError, match="propse"):
        SpeculatorChain([Typo()])

    class WrongArgs:
        @hookimpl
        def propose(self, seq, limits, temperature):  # an argument the spec does not have
            return None

    with pytest.raises(pluggy.PluginValidationError, match="temperature"):
        SpeculatorChain([WrongArgs()])

    class Fewer:  # taking fewer arguments than the spec offers is allowed
        @hookimpl
        def accept(self, seq):
            self.seen = len(seq)

    f = Fewer()
    SpeculatorChain([f]).accept(SEQ, None, 0, {})
    assert f.seen == 3


def test_two_instances_of_one_class_are_both_called():
    log = []
    chain = SpeculatorChain([Spec("same", None, log), Spec("same", [1], log)])
    assert chain.propose(SEQ, LIMITS).tokens == (1,) and len(log) == 2


def test_hook_dispatch_overhead():
    """Not a pass/fail check: prints the cost of one chain.propose through pluggy."""

    class Trivial:
        draft = Draft((1, 2), "t")

        @hookimpl
        def propose(self, seq, limits):
            return self.draft

    n = 10_000
    spec = Trivial()
    chain = SpeculatorChain([spec])
    for _ in range(200):  # warm up
        chain.propose(SEQ, LIMITS)
    t0 = time.perf_counter()
    for _ in range(n):
        chain.propose(SEQ, LIMITS)
    chain_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        spec.propose(SEQ, LIMITS)
    direct_us = (time.perf_counter() - t0) / n * 1e6
    chain3 = SpeculatorChain([Spec("n1"), Spec("n2"), spec])  # two that return None first
    t0 = time.perf_counter()
    for _ in range(n):
        chain3.propose(SEQ, LIMITS)
    chain3_us = (time.perf_counter() - t0) / n * 1e6
    print(f"\nchain.propose: {chain_us:.2f} us/call (1 speculator), {chain3_us:.2f} us/call (3, third answers); "
          f"direct method call {direct_us:.2f} us/call")


def test_load_model_once_shares_a_model_until_its_file_changes(tmp_path):
    """Draft models and heads are loaded once per process (a bench or server builds speculators
    afresh per run); a rewritten file loads again, and a missing one is one line naming what."""
    import os

    from speculant import load_model_once

    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", seed=1)
    first = load_model_once(path, what="draft model")
    assert load_model_once(path, what="draft model") is first
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load_model_once(path) is not first
    with pytest.raises(SpeculantError, match=r"cannot read the EAGLE3 head"):
        load_model_once(str(tmp_path / "absent.gguf"), what="EAGLE3 head")
