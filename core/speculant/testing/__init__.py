"""Testing tools for speculant and its plugins.

* The contract suite every plugin must pass: :class:`SpeculatorContract`,
  :class:`BackendContract`, :class:`PluginContract`, run over every installed plugin by the pytest
  plugin ``speculant.testing.pytest_plugin`` (loaded automatically). With no code of your own:
  ``pytest --pyargs speculant.testing.suite --speculant-plugin NAME``. See docs/plugins.md.
* ``tiny_gguf``: tiny random GGUF models; ``driver``: a speculator driven as the engine does.
"""
from __future__ import annotations

__all__ = ["BackendContract", "PluginContract", "SpeculatorContract"]


def __getattr__(name: str):
    # Imported on first use: the pytest plugin is loaded into every test session, and the
    # contract classes import the engine.
    if name == "SpeculatorContract":
        from speculant.testing.speculators import SpeculatorContract

        return SpeculatorContract
    if name == "BackendContract":
        from speculant.testing.backends import BackendContract

        return BackendContract
    if name == "PluginContract":
        from speculant.testing.loading import PluginContract

        return PluginContract
    raise AttributeError(f"module 'speculant.testing' has no attribute {name!r}")
