"""``@pytest.mark.kvguard(...)``: per-test settings, on a test, a class or a module.

    @pytest.mark.kvguard(leaks="fail")   # this test's leaks fail it ("warn", "summary", "off")
    @pytest.mark.kvguard(off=True)       # kvguard leaves this test alone

A test that ``kvguard.testing.check_allocator`` (or ``kvguard replay --emit-test``) wrote tests the
allocator itself, so a guard must not stand in front of it: such a test (its docstring begins
``kvguard conformance``) gets ``kvguard(off=True)`` at collection, unless it carries a
``kvguard`` marker of its own.

Several markers merge, the closest to the test winning keyword by keyword, so a module can say
``pytestmark = pytest.mark.kvguard(leaks="fail")`` and one test in it ``leaks="off"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .options import LEAKS

MARKER = "kvguard"
MARKER_HELP = (
    "kvguard(leaks='summary'|'warn'|'fail'|'off', off=False): kvguard settings for a test: "
    "what its leaked blocks do, or off=True to leave it unguarded (allocators it creates are not "
    "guarded and violations are not held against it)"
)


@dataclass(frozen=True)
class TestSettings:
    __test__ = False  # not a test class, whatever pytest's python_classes say

    leaks: str
    off: bool = False


_DEFAULTS = {leaks: TestSettings(leaks) for leaks in LEAKS}


def settings_for(item: pytest.Item, leaks: str) -> TestSettings:
    """The item's settings; a malformed marker fails the test's setup with one line."""
    marks = list(item.iter_markers(MARKER))  # closest first
    if not marks:
        return _DEFAULTS[leaks]
    merged: dict = {}
    for mark in marks:
        if mark.args:
            _fail(item, f"takes keywords only (leaks=..., off=...), not {mark.args!r}")
        for key, value in mark.kwargs.items():
            merged.setdefault(key, value)
    unknown = set(merged) - {"leaks", "off"}
    if unknown:
        _fail(item, f"unknown keyword(s) {', '.join(sorted(unknown))}: it takes leaks= and off=")
    leaks = merged.get("leaks", leaks)
    if leaks not in LEAKS:
        _fail(item, f"leaks={leaks!r}: choose one of {', '.join(map(repr, LEAKS))}")
    off = merged.get("off", False)
    if not isinstance(off, bool):
        _fail(item, f"off={off!r}: use off=True or off=False")
    return TestSettings(leaks, off)


def _fail(item: pytest.Item, why: str):
    pytest.fail(f"@pytest.mark.kvguard on {item.nodeid}: {why}", pytrace=False)


EMITTED = "kvguard conformance"
"""How the docstring of a test the conformance fuzzer wrote begins."""


def mark_emitted(items) -> None:
    """Run the fuzzer's regression tests unguarded: they assert what the allocator itself
    does with a bad call, which a guard would reject first (and ``pytest.raises`` would
    take kvguard's error for the allocator's)."""
    for item in items:
        doc = getattr(getattr(item, "obj", None), "__doc__", None) or ""
        if doc.lstrip().startswith(EMITTED) and item.get_closest_marker(MARKER) is None:
            item.add_marker(pytest.mark.kvguard(off=True))
