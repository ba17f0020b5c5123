"""docs/plugins.md stays true: its hook reference is what the hookspecs say, and its tutorial
plugin, installed from the document's own code blocks, works in the engine and passes the
contract suite."""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from fake_dists import write_dist

from speculant.engine import Engine, EngineConfig
from speculant.hookdoc import replace_section
from speculant.plugins import load_registry
from speculant.sampling import SamplingParams
from speculant.speculator import build_speculators
from speculant.testing.tiny import TinyModels

pytest_plugins = ["pytester"]

DOC = Path(__file__).parent.parent / "docs" / "plugins.md"


def test_hook_reference_is_current():
    text = DOC.read_text()
    assert replace_section(text) == text, "docs/plugins.md's hook reference is out of date: run " \
                                          "`python -m speculant.hookdoc docs/plugins.md`"


def tutorial_files() -> dict[str, str]:
    """path -> content of every code block preceded by a `<!-- file: PATH -->` line."""
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), re.S)
    return dict(blocks)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The tutorial's distribution, installed as pip would lay it out (package + dist-info with
    the entry points of its pyproject.toml) on sys.path."""
    files = tutorial_files()
    project = tomllib.loads(files.pop("speculant-lookup/pyproject.toml"))
    meta = project["project"]
    site = tmp_path / "site"
    site.mkdir()
    write_dist(site, meta["name"], meta["version"], meta["entry-points"]["speculant"],
               {path.split("/", 1)[1]: content for path, content in files.items()})
    monkeypatch.syspath_prepend(str(site))
    yield files
    sys.modules.pop("speculant_lookup", None)


def test_tutorial_plugin_is_about_40_lines(installed):
    code = installed["speculant-lookup/speculant_lookup/__init__.py"]
    assert len(code.splitlines()) <= 40, "the tutorial promises a speculator in about 40 lines"


def test_tutorial_plugin_runs_in_the_engine(installed, tmp_path):
    reg = load_registry()
    entry = reg.entries[("speculator", "lookup")]
    assert (entry.plugin.name, entry.plugin.distribution, entry.plugin.version) == ("lookup", "speculant-lookup", "0.1.0")
    assert "speculant_add_options" in reg.hooks_of("lookup")
    import argparse

    parser = argparse.ArgumentParser()
    reg.add_options(parser)
    assert build_speculators(["lookup"], vars(parser.parse_args(["--spec-lookup-n", "3"])), registry=reg)[0].n == 3

    tiny = TinyModels.create(tmp_path / "models", reg)
    options = vars(parser.parse_args([]))
    engine = Engine(tiny.target, EngineConfig(n_ctx=256, adaptive=False), build_speculators(["lookup"], options, registry=reg))
    seqs = [engine.add(p, tiny.n_new, SamplingParams()) for p in tiny.prompts]
    while engine.active():
        engine.step()
    assert [s.tokens[s.n_prompt:] for s in seqs] == tiny.greedy
    assert engine.spec_stats["lookup"].accepted > 0


def test_tutorial_plugin_passes_the_contract(installed, pytester):
    reprec = pytester.inline_run("--pyargs", "speculant.testing.suite", "--speculant-plugin", "lookup", "-p", "no:cacheprovider")
    passed, skipped, failed = reprec.listoutcomes()
    assert not failed, [r.nodeid for r in failed]
    names = {r.nodeid.split("::")[-1].split("[")[0] for r in passed}
    assert {"test_plugin_loads", "test_truncate_forgets_the_cut", "test_engine_greedy_equals_plain_decoding",
            "test_engine_sampling_follows_the_target_distribution"} <= names
    assert all("[lookup" in r.nodeid for r in passed if "TestSpeculators" in r.nodeid and "[" in r.nodeid)
