"""The plugin-loading contract: every installed plugin of group ``speculant`` loads."""
from __future__ import annotations


class PluginContract:
    """Parametrized by ``plugin_name`` (entry-point names)."""

    def test_plugin_loads(self, speculant_registry, plugin_name):
        """It imports, its hooks match the hookspecs and its registrations succeed."""
        info = next(p for p in speculant_registry.plugins if p.name == plugin_name)
        assert info.error is None, f"plugin '{plugin_name}' ({info.distribution} {info.version}) failed to load: {info.error}"
