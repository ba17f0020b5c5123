"""`speculant plugins` and how start-up treats broken, disabled and clashing plugins.

Third-party plugins are installed the honest way: a dist-info directory with entry_points.txt and
a module, on sys.path, found by importlib.metadata like any pip-installed package."""
from __future__ import annotations

import json
import sys

import pytest

from fake_dists import write_dist

import speculant.plugins
from speculant.cli import main
from speculant.plugins import load_registry


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECULANT_PLUGINS", raising=False)
    monkeypatch.delenv("SPECULANT_DISABLE_PLUGINS", raising=False)
    monkeypatch.setattr(speculant.plugins, "_default", None)  # the CLI discovers afresh in each test
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("fakecmd_"):
            del sys.modules[name]


@pytest.fixture
def install(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def install(dist: str, name: str, source: str, version: str = "2.0") -> None:
        module = f"fakecmd_{name}"
        write_dist(root, dist, version, {name: module}, {f"{module}.py": source})

    return install


def run(capsys, *argv) -> tuple[int, str, str]:
    speculant.plugins._default = None  # discover afresh (the environment may have changed)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_lists_every_installed_plugin(capsys):
    code, out, err = run(capsys, "plugins")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "DISTRIBUTION", "HOOKS"]
    row = {line.split()[0]: line.split() for line in lines[1:] if not line.startswith(" ")}
    assert row["suffix"][:4] == ["suffix", "speculator", "speculant-suffix", "0.1.0"]  # the contrib distribution
    assert row["cpu"][1:3] == ["backend", "speculant"] and row["transformer"][1] == "architecture"
    assert "add_options," in row["suffix"] and "register_speculators" in row["suffix"]
    assert "    speculator suffix: accept, begin, checkpoint, end, propose, state_nbytes, truncate" in lines
    assert "    speculator ngram-simple: propose" in lines and "    architecture qwen2" in lines


def test_json(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    suffix = rows["suffix"]
    assert (suffix["kind"], suffix["distribution"], suffix["version"], suffix["status"], suffix["error"]) == \
           (["speculator"], "speculant-suffix", "0.1.0", "loaded", None)
    assert suffix["hooks"] == ["speculant_add_options", "speculant_register_speculators"]
    assert suffix["registers"] == [{"kind": "speculator", "name": "suffix", "object": "speculant_suffix.speculator.SuffixSpeculator",
                                    "hooks": ["accept", "begin", "checkpoint", "end", "propose", "state_nbytes", "truncate"]}]
    assert [r["name"] for r in rows["transformer"]["registers"]] == ["gemma3", "lfm2", "llama", "qwen2", "qwen3", "qwen35"]


def test_broken_plugins_are_reported_and_skipped(capsys, install, caplog):
    install("speculant-cuda", "cuda", "raise ImportError('libcudart.so.12: cannot open shared object file')\n")
    install("speculant-typo", "typo", """
        from speculant import hookimpl

        @hookimpl
        def speculant_register_speculatorz(register):
            pass
    """)
    install("speculant-raises", "raises", """
        from speculant import hookimpl

        @hookimpl
        def speculant_register_speculators(register):
            register("raises-a", object)
            raise RuntimeError("no config file")
    """)
    code, out, err = run(capsys, "plugins")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if not line.startswith(" ")}
    assert "FAILED: ImportError: libcudart.so.12: cannot open shared object file" in lines["cuda"]
    assert "speculant-cuda 2.0" in lines["cuda"]
    assert "FAILED: unknown hook 'speculant_register_speculatorz'" in lines["typo"]
    assert "FAILED: speculant_register_speculators raised RuntimeError: no config file" in lines["raises"]
    assert "suffix" in lines and "cpu" in lines  # start-up went on
    warned = [r.msg for r in caplog.records if isinstance(r.msg, dict)]  # structlog's events
    assert {"event": "plugin failed to load and is skipped", "plugin": "cuda", "distribution": "speculant-cuda 2.0"}.items() \
        <= next(e for e in warned if e.get("plugin") == "cuda").items()
    reg = load_registry()
    assert "raises-a" not in reg.names("speculator")  # what a failed plugin registered is taken back
    assert reg.pm.get_plugin("typo") is None and reg.pm.get_plugin("raises") is None


def test_disabled_plugins_only_with_all(capsys, monkeypatch):
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "suffix")
    _, out, _ = run(capsys, "plugins")
    assert "suffix" not in out
    _, out, _ = run(capsys, "plugins", "--all")
    line = next(l for l in out.splitlines() if l.startswith("suffix "))
    assert "speculant-suffix 0.1.0" in line and "disabled: SPECULANT_DISABLE_PLUGINS" in line
    monkeypatch.delenv("SPECULANT_DISABLE_PLUGINS")
    monkeypatch.setenv("SPECULANT_PLUGINS", "cpu,transformer")
    _, out, _ = run(capsys, "plugins", "--all", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cpu"]["status"] == "loaded" and rows["ngram"]["status"] == "disabled"
    assert rows["ngram"]["error"] == "disabled: not in SPECULANT_PLUGINS" and rows["ngram"]["registers"] == []


def test_two_plugins_claiming_one_spec_type_is_one_line_naming_both(capsys, install):
    install("speculant-other-suffix", "othersuffix", """
        from speculant import hookimpl

        @hookimpl
        def speculant_register_speculators(register):
            register("suffix", type("OtherSuffix", (), {}))
    """)
    for argv in (["plugins"], ["generate", "-m", "x.gguf", "-p", "hi"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith("speculant: error: speculator 'suffix' is registered twice")
        assert "(distribution speculant-suffix)" in err and "(distribution speculant-other-suffix)" in err


def test_a_plugin_whose_flags_fail_is_named(capsys, install):
    install("speculant-flags", "flags", """
        from speculant import hookimpl

        @hookimpl
        def speculant_add_options(parser):
            parser.add_argument("--spec-suffix-max-depth", type=int)
    """)
    code, _, err = run(capsys, "generate", "-m", "x.gguf", "-p", "hi")
    assert code == 2 and err.count("\n") == 1
    assert "plugin 'flags' (speculant-flags 2.0) adds a flag that clashes with another" in err
    assert "--spec-suffix-max-depth" in err
