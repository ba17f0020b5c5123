"""The contract suite's pytest plugin (entry point ``pytest11: speculant``, loaded automatically).

* ``--speculant-plugin NAME`` (repeatable): run the contract only over that plugin (its entry-point
  name, e.g. ``ngram``) or that registered speculator/backend (``ngram-simple``); default: every
  installed one. A name that matches nothing, or a plugin that failed to load, is a usage error.
* parametrizes the contract classes: ``speculator_name``, ``backend_name``, ``plugin_name``;
* turns a plugin's ``contract_xfail = {"test_x": "reason"}`` into strict expected failures;
* fails a contract test that a subclass redefined without ``@pytest.mark.xfail(reason=...)``;
* session fixtures: ``speculant_registry``, ``tiny_models`` (a tiny target/draft pair) and
  ``speculant_backend_weights``.

It is inert in test sessions that use no contract class: nothing is imported until a test asks.
"""
from __future__ import annotations

import inspect

import pytest

_REGISTRY = pytest.StashKey()
_OVERRIDDEN = pytest.StashKey()
UNSELECTED = "speculant_unselected"
KINDS = {"speculator_name": ("speculator", "spec_types"), "backend_name": ("backend", "backends")}


def pytest_addoption(parser):
    group = parser.getgroup("speculant", "speculant contract suite")
    group.addoption("--speculant-plugin", action="append", default=[], metavar="NAME",
                    help="run the speculant contract suite over this plugin only (entry-point name, or a "
                         "registered speculator/backend name); repeatable. Default: every installed plugin.")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{UNSELECTED}: a contract test for no selected plugin (deselected)")
    wanted = config.getoption("speculant_plugin", default=[])
    if not wanted:
        return
    reg = registry(config)
    plugins = {p.name: p for p in reg.plugins}
    known = set(plugins) | {name for _, name in reg.entries}
    for name in wanted:
        if name not in known:
            raise pytest.UsageError(f"--speculant-plugin {name}: no installed plugin or registered speculator/backend "
                                    f"of that name (plugins: {', '.join(sorted(plugins))}; "
                                    f"speculators: {', '.join(reg.names('speculator'))}; backends: {', '.join(reg.names('backend'))})")
        if name in plugins and plugins[name].error:
            raise pytest.UsageError(f"--speculant-plugin {name}: the plugin failed to load: {plugins[name].error}")


def registry(config):
    """One registry per test session, discovered afresh (not the process-wide default)."""
    reg = config.stash.get(_REGISTRY, None)
    if reg is None:
        from speculant.plugins import load_registry

        reg = config.stash[_REGISTRY] = load_registry()
    return reg


def _selected(config, kind: str, only) -> list[str]:
    reg = registry(config)
    wanted = config.getoption("speculant_plugin", default=[])
    if kind == "plugin":
        names = [p.name for p in reg.plugins]
        return [n for n in names if not wanted or n in wanted]
    names = list(only) if only is not None else reg.names(kind)
    if wanted:
        names = [n for n in names if n in wanted or ((kind, n) in reg.entries and reg.entries[(kind, n)].plugin.name in wanted)]
    return names


def pytest_generate_tests(metafunc):
    params = [(f, kind, getattr(metafunc.cls, attr, None)) for f, (kind, attr) in KINDS.items()]
    params.append(("plugin_name", "plugin", None))
    for fixture, kind, only in params:
        if fixture not in metafunc.fixturenames:
            continue
        names = _selected(metafunc.config, kind, only)
        if names:
            metafunc.parametrize(fixture, names, ids=names)
        else:  # nothing selected for this class (e.g. --speculant-plugin names a speculator): deselected below
            metafunc.parametrize(fixture, [pytest.param(None, marks=pytest.mark.speculant_unselected)], ids=["none"])


def _contract_base(cls):
    # Look at the class's bases by name first: test sessions without contract classes never
    # import the contract modules (and the engine with them).
    if cls is None or not any(b.__module__.startswith("speculant.testing.") for b in cls.__mro__):
        return None
    from speculant.testing.backends import BackendContract
    from speculant.testing.loading import PluginContract
    from speculant.testing.speculators import SpeculatorContract

    for base in (SpeculatorContract, BackendContract, PluginContract):
        if issubclass(cls, base):
            return base
    return None


def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker(UNSELECTED) else keep).append(item)
        base = _contract_base(getattr(item, "cls", None))
        if base is None or item in drop:
            continue
        _declared_xfail(config, item)
        _check_override(item, base)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _declared_xfail(config, item) -> None:
    """The plugin's (or the test class's) contract_xfail entry for this test, as a strict xfail."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    declared = dict(getattr(item.cls, "contract_xfail", {}))
    for fixture, (kind, _) in KINDS.items():
        name = params.get(fixture)
        entry = registry(config).entries.get((kind, name))
        if entry is not None:
            declared.update(getattr(entry.obj, "contract_xfail", {}) or {})
            who = f"{kind} '{name}'"
            break
    else:
        who = "the test class"
    reason = declared.get(item.originalname)
    if isinstance(reason, str) and reason.strip():
        item.add_marker(pytest.mark.xfail(reason=f"declared by {who}: {reason}", strict=True))


def _check_override(item, base) -> None:
    name = item.originalname
    if not hasattr(base, name):
        return  # the subclass's own extra test
    mine = inspect.getattr_static(item.cls, name)
    if mine is inspect.getattr_static(base, name):
        return
    marks = [m for m in getattr(mine, "pytestmark", []) if m.name == "xfail" and m.kwargs.get("reason")]
    if not marks:
        item.stash[_OVERRIDDEN] = (f"{item.cls.__name__}.{name} overrides the contract test {base.__name__}.{name}; "
                                   f"contract tests may not be replaced. Declare a known failure instead: "
                                   f"contract_xfail = {{'{name}': 'reason'}} on the plugin class, or "
                                   f"@pytest.mark.xfail(reason=...) on the override")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    message = pyfuncitem.stash.get(_OVERRIDDEN, None)
    if message:
        pytest.fail(message, pytrace=False)


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def speculant_registry(request):
    return registry(request.config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, speculant_registry):
    from speculant.testing.tiny import TinyModels

    return TinyModels.create(tmp_path_factory.mktemp("speculant-contract"), speculant_registry)


@pytest.fixture(scope="session")
def speculant_backend_weights(tmp_path_factory):
    """name -> TensorInfo: the backend contract's weights, of every GGUF type, from a real file."""
    from speculant.gguf.file import open_gguf
    from speculant.testing.backends import write_weights

    return open_gguf(write_weights(str(tmp_path_factory.mktemp("backend-contract") / "weights.gguf"))).tensors
