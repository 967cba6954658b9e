"""Whether the guard runs on its compiled parts (``kvguard._fastpath``), decided once at import.

Three modules depend on it: the guard's ``shadowing`` (the wrappers, the lock, the flight
recorder) and ``telemetry`` (``Stats``, whose counters are C integers there), and ``owners`` (the
holder slot of request boundaries), so the decision lives here, where none imports another.
"""

from __future__ import annotations

import importlib
import os
import sys


def load():
    """``kvguard._fastpath`` (the wrappers compiled: see ``shadowing.accelerated``), or None
    when it was not built, does not load, or ``KVGUARD_PURE=1`` asks for the closures. A
    free-threaded interpreter running without the GIL gets the closures too: the C wrappers rely
    on the GIL (importing them there would turn it back on for the whole process)."""
    if os.environ.get("KVGUARD_PURE", "") not in ("", "0"):
        return None
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    try:
        return importlib.import_module("kvguard._fastpath")
    except ImportError:  # not built (no compiler at install), or another interpreter's build
        return None


FASTPATH = load()
"""The compiled module as loaded at import (None: pure Python). ``shadowing.ACCEL`` starts as
this; tests switch that one, never this."""
