"""Plugin discovery: load entry points of group ``speculant`` and collect what they register.

Built-in plugins are found exactly like third-party ones. ``SPECULANT_PLUGINS`` (comma list)
loads only the named entry points; ``SPECULANT_DISABLE_PLUGINS`` blocks names (and wins). A
plugin that fails to import, implements a hook that does not exist, or raises while
registering is recorded with its error, logged as a warning and skipped: start-up goes on. Two
plugins registering one name is an error naming both distributions.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
from typing import Any

import attrs
import pluggy

from speculant import hookspecs
from speculant.errors import SpeculantError
from speculant.logs import get_logger

log = get_logger(__name__)

KINDS = ("speculator", "backend", "architecture")


@attrs.frozen
class PluginInfo:
    name: str  # entry-point name
    distribution: str
    version: str
    module: Any = attrs.field(default=None, repr=False)
    error: str | None = None
    disabled: str | None = None  # why the environment kept it from loading (Registry.disabled)


@attrs.frozen
class Registered:
    kind: str
    name: str
    obj: Any
    plugin: PluginInfo


@attrs.define
class Registry:
    pm: pluggy.PluginManager
    plugins: list[PluginInfo] = attrs.field(factory=list)  # every plugin it tried to load (error set if that failed)
    entries: dict[tuple[str, str], Registered] = attrs.field(factory=dict)
    disabled: list[PluginInfo] = attrs.field(factory=list)  # found but not loaded: SPECULANT_PLUGINS / _DISABLE_PLUGINS

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.entries if k == kind)

    def get(self, kind: str, name: str) -> Any:
        entry = self.entries.get((kind, name))
        if entry is None:
            known = ", ".join(self.names(kind)) or "none installed"
            raise SpeculantError(f"unknown {kind} '{name}' (available: {known})")
        return entry.obj

    def add(self, kind: str, name: str, obj: Any, plugin: PluginInfo) -> None:
        old = self.entries.get((kind, name))
        if old is not None and old.obj is not obj:
            raise SpeculantError(
                f"{kind} '{name}' is registered twice: by plugin '{old.plugin.name}' "
                f"(distribution {old.plugin.distribution}) and by plugin '{plugin.name}' "
                f"(distribution {plugin.distribution}); uninstall or disable one (SPECULANT_DISABLE_PLUGINS)"
            )
        self.entries[(kind, name)] = Registered(kind, name, obj, plugin)

    def registered_by(self, plugin_name: str) -> list[Registered]:
        return [e for e in self.entries.values() if e.plugin.name == plugin_name]

    def hooks_of(self, plugin_name: str) -> list[str]:
        """The discovery hooks a loaded plugin implements."""
        plugin = self.pm.get_plugin(plugin_name)
        return sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()) if plugin is not None else []

    def add_options(self, parser: Any) -> None:
        """Every plugin's speculant_add_options, one at a time, so a failure names its plugin."""
        by_name = {p.name: p for p in self.plugins}
        for impl in reversed(self.pm.hook.speculant_add_options.get_hookimpls()):  # registration order
            info = by_name.get(impl.plugin_name)
            try:
                impl.function(parser=parser)
            except argparse.ArgumentError as e:
                raise SpeculantError(f"plugin '{impl.plugin_name}' ({_dist(info)}) adds a flag that clashes with another: {e}") from None
            except Exception as e:
                raise SpeculantError(f"plugin '{impl.plugin_name}' ({_dist(info)}) failed to add its flags: "
                                     f"{type(e).__name__}: {e}; uninstall or disable it (SPECULANT_DISABLE_PLUGINS)") from None

    def add_commands(self, subparsers: Any) -> dict[str, Any]:
        """Every plugin's speculant_add_commands; returns {command name: run}. A failure, or a
        command two plugins add, is an error naming the plugin."""
        return self._add_runnables("speculant_add_commands", "command", subparsers)

    def add_trainers(self, subparsers: Any) -> dict[str, Any]:
        """Every plugin's speculant_add_trainers; returns {method: run}, as add_commands does."""
        return self._add_runnables("speculant_add_trainers", "trainer", subparsers)

    def _add_runnables(self, hook: str, kind: str, subparsers: Any) -> dict[str, Any]:
        by_name = {p.name: p for p in self.plugins}
        found: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls()):  # registration order
            info = by_name.get(impl.plugin_name)

            def register(name: str, run: Any, plugin: str = impl.plugin_name) -> None:
                if name in found:
                    raise SpeculantError(f"{kind} '{name}' is added twice: by plugin '{owners[name]}' and by plugin '{plugin}'")
                found[name], owners[name] = run, plugin

            try:
                impl.function(subparsers=subparsers, register=register)
            except SpeculantError:
                raise
            except Exception as e:  # argparse's clash of names included
                raise SpeculantError(f"plugin '{impl.plugin_name}' ({_dist(info)}) failed to add its {kind}s: "
                                     f"{type(e).__name__}: {e}; uninstall or disable it (SPECULANT_DISABLE_PLUGINS)") from None
        return found

    def _fail(self, name: str, error: str) -> None:
        """Record a plugin as broken and take back what it registered."""
        for i, info in enumerate(self.plugins):
            if info.name == name:
                self.plugins[i] = info = attrs.evolve(info, module=None, error=error)
                log.warning("plugin failed to load and is skipped", plugin=name, distribution=_dist(info), error=error)
        for key in [k for k, e in self.entries.items() if e.plugin.name == name]:
            del self.entries[key]
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)


def _dist(info: PluginInfo | None) -> str:
    return "?" if info is None else f"{info.distribution} {info.version}".strip()


def _env_list(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


def load_registry(extra_plugins: list[tuple[str, Any]] = ()) -> Registry:
    """Discover entry-point plugins (plus `extra_plugins`, (name, module-or-object) pairs, used by
    tests) and collect their registrations."""
    pm = pluggy.PluginManager("speculant")
    pm.add_hookspecs(hookspecs.DiscoverySpec)
    registry = Registry(pm)
    allow, block = _env_list("SPECULANT_PLUGINS"), _env_list("SPECULANT_DISABLE_PLUGINS") or set()

    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != "speculant":
                continue
            info = PluginInfo(ep.name, dist.metadata["Name"], dist.version)
            if ep.name in block or (allow is not None and ep.name not in allow):
                why = "SPECULANT_DISABLE_PLUGINS" if ep.name in block else "not in SPECULANT_PLUGINS"
                registry.disabled.append(attrs.evolve(info, disabled=why))
                continue
            if pm.get_plugin(ep.name) is not None:
                registry.plugins.append(attrs.evolve(info, error="duplicate entry-point name, skipped"))
                continue
            try:
                module = ep.load()
                pm.register(module, name=ep.name)
            except Exception as e:  # a broken plugin must not stop start-up
                registry.plugins.append(attrs.evolve(info, error=f"{type(e).__name__}: {e}"))
                log.warning("plugin failed to load and is skipped", plugin=ep.name, distribution=_dist(info),
                            error=f"{type(e).__name__}: {e}")
                continue
            registry.plugins.append(attrs.evolve(info, module=module))
    for name, obj in extra_plugins:
        pm.register(obj, name=name)
        registry.plugins.append(PluginInfo(name, "(registered in process)", "", obj))
    # pm.check_pending() would raise for the first misspelled hook of any plugin; find them per plugin.
    for hook in vars(pm.hook).values():
        if isinstance(hook, pluggy.HookCaller) and not hook.has_spec():
            for impl in hook.get_hookimpls():
                if not impl.optionalhook:
                    registry._fail(impl.plugin_name, f"unknown hook '{hook.name}' (not a speculant hook; misspelled?)")

    # Call each implementation ourselves (pluggy validated them) so every registration is
    # attributed to its plugin: needed for the duplicate-name error and `speculant plugins`.
    by_name = {info.name: info for info in registry.plugins if info.module is not None}
    for kind in KINDS:
        for impl in getattr(pm.hook, f"speculant_register_{kind}s").get_hookimpls():
            info = by_name.get(impl.plugin_name)
            if info is None or registry.pm.get_plugin(impl.plugin_name) is None:
                continue  # failed earlier
            try:
                impl.function(register=lambda name, obj, kind=kind, info=info: registry.add(kind, name, obj, info))
            except SpeculantError:
                raise  # a name registered twice: an error naming both distributions
            except Exception as e:
                registry._fail(impl.plugin_name, f"speculant_register_{kind}s raised {type(e).__name__}: {e}")
    return registry


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _default
    if _default is None:
        _default = load_registry()
    return _default


# --- `speculant plugins` ---------------------------------------------------------------------------
def _lifecycle_hooks(obj: Any) -> list[str]:
    """The speculator lifecycle hooks a registered class implements (methods marked hookimpl)."""
    names = [n for n in vars(hookspecs.SpeculatorSpec) if not n.startswith("_")]
    return sorted(n for n in names if getattr(getattr(obj, n, None), "speculant_impl", None) is not None)


def describe(registry: Registry, include_disabled: bool = False) -> list[dict]:
    """One dict per plugin: name, kind, distribution, version, status, error, hooks, registers."""
    rows = []
    for info in registry.plugins + (registry.disabled if include_disabled else []):
        status = "disabled" if info.disabled else "error" if info.error else "loaded"
        regs = sorted(registry.registered_by(info.name), key=lambda r: (r.kind, r.name)) if status == "loaded" else []
        rows.append({
            "name": info.name,
            "kind": sorted({r.kind for r in regs}, key=KINDS.index),
            "distribution": info.distribution,
            "version": info.version,
            "status": status,
            "error": info.error or (f"disabled: {info.disabled}" if info.disabled else None),
            "hooks": registry.hooks_of(info.name) if status == "loaded" else [],
            "registers": [{"kind": r.kind, "name": r.name,
                           "object": f"{getattr(r.obj, '__module__', '?')}.{getattr(r.obj, '__qualname__', type(r.obj).__name__)}",
                           "hooks": _lifecycle_hooks(r.obj) if r.kind == "speculator" else []} for r in regs],
        })
    return sorted(rows, key=lambda r: r["name"])


def format_table(rows: list[dict]) -> str:
    """`speculant plugins`' text: a line per plugin, then one per name it registers."""
    if not rows:
        return "no speculant plugins installed"
    w_name = max(len(r["name"]) for r in rows) + 2
    w_kind = max([len(", ".join(r["kind"]) or "-") for r in rows] + [4]) + 2
    w_dist = max(len(f"{r['distribution']} {r['version']}") for r in rows) + 2
    lines = [f"{'NAME':<{w_name}}{'KIND':<{w_kind}}{'DISTRIBUTION':<{w_dist}}HOOKS"]
    for r in rows:
        tail = (r["error"] or "") if r["status"] != "loaded" else ", ".join(h.removeprefix("speculant_") for h in r["hooks"])
        if r["status"] == "error":
            tail = f"FAILED: {tail}"
        lines.append(f"{r['name']:<{w_name}}{', '.join(r['kind']) or '-':<{w_kind}}{r['distribution'] + ' ' + r['version']:<{w_dist}}{tail}")
        for reg in r["registers"]:
            hooks = f": {', '.join(reg['hooks'])}" if reg["hooks"] else ""
            lines.append(f"    {reg['kind']} {reg['name']}{hooks}")
    return "\n".join(lines)
