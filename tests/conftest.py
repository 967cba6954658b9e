"""Shared fixtures: every test starts and ends with instrumentation off."""

import pytest

import kvguard
from kvguard import registry

# The plugin's tests run pytest inside pytest; pytest takes pytest_plugins only from a top-level
# conftest, so the fixture provider is declared here for the whole suite.
pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _instrumentation_off():
    yield
    if registry.instrumented():
        kvguard.uninstrument()
