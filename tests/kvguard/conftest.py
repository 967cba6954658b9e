"""Fixtures the runtime's tests share."""

import logging

import pytest


@pytest.fixture
def quiet_kvguard_log():
    """The ``kvguard`` logger off for one test: for tests that provoke many violations in log
    or repair mode and read them from the guard, not from the log. Not autouse: tests that read
    the logger (caplog) must see it."""
    logger = logging.getLogger("kvguard")
    logger.disabled = True
    yield
    logger.disabled = False
