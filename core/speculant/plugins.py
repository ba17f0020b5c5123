"""Plugin discovery: load entry points of group ``speculant`` and collect what they register.

Built-in plugins are found exactly like third-party ones. ``SPECULANT_PLUGINS`` (comma list)
loads only the named entry points; ``SPECULANT_DISABLE_PLUGINS`` blocks names. A plugin that
fails to import is recorded with its error and skipped; two plugins registering one name is an
error naming both distributions.
"""
from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import attrs
import pluggy

from speculant import hookspecs
from speculant.errors import SpeculantError

KINDS = ("speculator", "backend", "architecture")


@attrs.frozen
class PluginInfo:
    name: str  # entry-point name
    distribution: str
    version: str
    module: Any = attrs.field(default=None, repr=False)
    error: str | None = None


@attrs.frozen
class Registered:
    kind: str
    name: str
    obj: Any
    plugin: PluginInfo


@attrs.define
class Registry:
    pm: pluggy.PluginManager
    plugins: list[PluginInfo] = attrs.field(factory=list)
    entries: dict[tuple[str, str], Registered] = attrs.field(factory=dict)

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
            if ep.group != "speculant" or ep.name in block or (allow is not None and ep.name not in allow):
                continue
            info = PluginInfo(ep.name, dist.metadata["Name"], dist.version)
            if pm.get_plugin(ep.name) is not None:
                registry.plugins.append(attrs.evolve(info, error="duplicate entry-point name, skipped"))
                continue
            try:
                module = ep.load()
                pm.register(module, name=ep.name)
            except Exception as e:  # a broken plugin must not stop start-up
                registry.plugins.append(attrs.evolve(info, error=f"{type(e).__name__}: {e}"))
                continue
            registry.plugins.append(attrs.evolve(info, module=module))
    for name, obj in extra_plugins:
        pm.register(obj, name=name)
        registry.plugins.append(PluginInfo(name, "(registered in process)", "", obj))
    pm.check_pending()

    # Call each implementation ourselves (pluggy validated them) so every registration is
    # attributed to its plugin: needed for the duplicate-name error and `speculant plugins`.
    by_name = {info.name: info for info in registry.plugins if info.module is not None}
    for kind in KINDS:
        for impl in getattr(pm.hook, f"speculant_register_{kind}s").get_hookimpls():
            info = by_name[impl.plugin_name]
            impl.function(register=lambda name, obj, kind=kind, info=info: registry.add(kind, name, obj, info))
    return registry


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _default
    if _default is None:
        _default = load_registry()
    return _default
