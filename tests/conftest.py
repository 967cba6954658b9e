"""Shared fixtures: every test starts and ends with instrumentation off."""

import pytest

import kvguard
from kvguard import registry


@pytest.fixture(autouse=True)
def _instrumentation_off():
    yield
    if registry.instrumented():
        kvguard.uninstrument()
