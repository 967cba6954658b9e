"""Stacks and tracebacks that end at the test.

A guard keeps up to 24 frames of the call that broke a rule; under pytest most of them are
pytest's and pluggy's own. Reports drop every frame from the first runner frame outwards, so
they end at the test function, the fixture or the hook that made the call. Likewise a
``KVGuardError`` escaping a test shows a traceback that stops at the caller's line: the guard's
own frames are hidden (``__tracebackhide__``) while the plugin runs, and its report says the
rest. ``--fulltrace`` shows them all.
"""

from __future__ import annotations

import os
import sys

import pluggy
import pytest

_RUNNER_DIRS = tuple({os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (pytest, pluggy, sys.modules["_pytest"])})
_runner_files: dict = {}

MACHINERY = ("kvguard.guard", "kvguard.ids", "kvguard.ledger", "kvguard.registry",
             "kvguard.dispatch", "kvguard.cache", "kvguard.staging")
"""Modules whose frames say nothing about the bug; the modules of the guard package
(``kvguard.guard.*``), the cache and staging faces (``kvguard.cache.*``, ``kvguard.staging.*``)
and the engine adapters' wrappers (``kvguard.adapters.*``) are hidden too."""


def _is_runner(code) -> bool:
    name = code.co_filename
    found = _runner_files.get(name)
    if found is None:
        found = _runner_files[name] = os.path.abspath(name).startswith(_RUNNER_DIRS)
    return found


def trim(stack):
    """``stack`` (raw ``(code, line)`` pairs, innermost first) up to its first runner frame."""
    if not stack or not isinstance(stack[0], tuple):
        return stack
    for n, (code, _) in enumerate(stack):
        if _is_runner(code):
            return tuple(stack[:n])
    return stack


def trim_violation(violation):
    violation.call_stack = trim(violation.call_stack)
    for block in violation.blocks:
        block.allocated_at = trim(block.allocated_at)
        block.freed_at = trim(block.freed_at)
    return violation


def hide_machinery() -> list:
    """Mark the guard's modules hidden in pytest tracebacks; returns what to undo."""
    undo = []
    inside = ("kvguard.guard.", "kvguard.adapters.", "kvguard.cache.", "kvguard.staging.")
    names = list(MACHINERY) + [n for n in list(sys.modules) if n.startswith(inside)]
    for name in names:
        module = sys.modules.get(name)
        if module is not None and "__tracebackhide__" not in vars(module):
            module.__tracebackhide__ = True
            undo.append(module)
    return undo


def show_machinery(modules) -> None:
    for module in modules:
        vars(module).pop("__tracebackhide__", None)
