"""pytester runs of the plugin, in this process unless a test needs a fresh interpreter.

Modules a pytester run imports are dropped from ``sys.modules`` afterwards; numpy, hypothesis
(its pytest plugin imports it at the end of every run), kvguard and its examples are imported
here first, so they are loaded once and stay loaded.
Every test checks that the run it made left kvguard as it found it: the registry, the
subscribers, instrumentation, the raises contexts, stepping aside and the gc hook.
"""

import gc
import importlib
import textwrap

import hypothesis  # noqa: F401
import numpy  # noqa: F401  (the ledger scans with it; a second import of numpy warns)
import pytest
from _pytest import raises as pytest_raises

import kvguard
import kvguard.examples  # noqa: F401
from kvguard import registry

telemetry = importlib.import_module("kvguard.guard.telemetry")
decisions = importlib.import_module("kvguard.guard.decisions")

# pytest_plugins = ["pytester"] is in tests/conftest.py: pytest refuses it in a nested conftest.

CONFTEST = """
import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC

kvguard.register("kvguard.examples.LinkedFreeList", LINKED_FREE_LIST_SPEC)
kvguard.register("kvguard.examples.RefcountedPool", REFCOUNTED_POOL_SPEC)
"""

SWALLOWED = """
    from kvguard.examples import LinkedFreeList

    def test_swallowed():
        pool = LinkedFreeList(8)
        ids = pool.allocate(2)
        try:
            pool.free([ids[0], ids[0]])
        except ValueError:
            pass
"""
"""A misuse the code under test catches: the plugin must still fail the test."""


@pytest.fixture(autouse=True)
def _run_leaves_kvguard_as_it_was():
    specs, builtins_loaded = dict(registry._specs), registry._builtins_loaded
    subscribers = list(telemetry._subscribers)
    exits = {(cls, name): cls.__dict__[name]
             for cls in (pytest_raises.RaisesExc, pytest_raises.RaisesGroup)
             for name in ("__enter__", "__exit__")}
    yield
    registry._specs.clear()
    registry._specs.update(specs)
    registry._builtins_loaded = builtins_loaded
    assert not registry.instrumented(), "the run left instrumentation on"
    assert telemetry._subscribers == subscribers, "the run left a subscriber"
    assert not [cb for cb in gc.callbacks
                if type(getattr(cb, "__self__", None)).__module__.startswith("pytest_kvguard")
                ], "the run left its gc callback"
    for (cls, name), method in exits.items():
        assert cls.__dict__[name] is method, f"the run left {cls.__name__}.{name} patched"
    assert decisions._step_aside[0] is None, "the run left guards stepping aside"


@pytest.fixture
def suite(pytester):
    """A pytester directory whose conftest registers the example allocators."""
    pytester.makeconftest(CONFTEST)
    return pytester


def write(pytester, source: str, name: str = "test_suite"):
    return pytester.makepyfile(**{name: textwrap.dedent(source)})
