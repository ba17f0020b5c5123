"""The contract suite with no code of your own:

    pytest --pyargs speculant.testing.suite                          # every installed plugin
    pytest --pyargs speculant.testing.suite --speculant-plugin NAME  # one (repeatable)
"""
from speculant.testing import BackendContract, PluginContract, SpeculatorContract


class TestPlugins(PluginContract):
    pass


class TestSpeculators(SpeculatorContract):
    pass


class TestBackends(BackendContract):
    pass
