"""The plugin contract over every installed plugin (first-party, contrib and any other):
what `pytest --pyargs speculant.testing.suite` runs, as part of the repository's tests."""
from speculant.testing import BackendContract, PluginContract, SpeculatorContract


class TestPlugins(PluginContract):
    pass


class TestSpeculators(SpeculatorContract):
    pass


class TestBackends(BackendContract):
    pass
