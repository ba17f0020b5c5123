"""The plugin contract over every installed plugin (first-party, contrib and any other):
what `pytest --pyargs speculant.testing.suite` runs, as part of the repository's tests."""
from speculant.testing.suite import TestBackends, TestPlugins, TestSpeculators  # noqa: F401 (collected here)
