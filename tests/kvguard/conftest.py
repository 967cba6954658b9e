"""Fixtures the runtime's tests share."""

import contextlib
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


def compiled_wrappers():
    """``kvguard._fastpath`` when it was built (whatever ``KVGUARD_PURE`` says), else None."""
    try:
        from kvguard import _fastpath
    except ImportError:
        return None
    return _fastpath


def three_ways() -> list:
    """``(accel, fast_path)`` for a guard on the compiled wrappers (where built), on the Python
    closures, and on the careful path: the twins that must give the same verdicts."""
    built = compiled_wrappers()
    return ([(built, True)] if built is not None else []) + [(None, True), (None, False)]


@contextlib.contextmanager
def use_wrappers(accel):
    """Guards made inside use the compiled wrappers (``accel``) or the closures (None)."""
    from kvguard.guard import shadowing

    saved = shadowing.ACCEL
    shadowing.ACCEL = accel
    try:
        yield
    finally:
        shadowing.ACCEL = saved


@pytest.fixture(params=["compiled", "pure"])
def implementation(request, monkeypatch):
    """Run a test with the guard's compiled wrappers (kvguard._fastpath), then with the Python
    closures they must match: guards made in the test use the one asked for."""
    from kvguard.guard import shadowing

    if request.param == "compiled":
        built = compiled_wrappers()
        if built is None:
            pytest.skip("kvguard._fastpath is not built (no C compiler at install): "
                        "the pure run covers this test")
        monkeypatch.setattr(shadowing, "ACCEL", built)
    else:
        monkeypatch.setattr(shadowing, "ACCEL", None)
    return request.param
