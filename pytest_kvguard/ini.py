"""The names of kvguard's ini settings, registered by an entry point of their own
(``pytest11: kvguard-ini``) as well as by the plugin. ``-p no:kvguard`` keeps the plugin out of
a run; with this module still in, a project's ``kvguard = true`` or ``kvguard_allocators`` is a
known setting, not an ``Unknown config option`` warning (or an error under
``--strict-config``). It imports nothing of kvguard and registers no hook but this one.
"""

from __future__ import annotations

import pytest


def add_settings(parser: pytest.Parser) -> None:
    """The ini settings (pytest keeps the last registration of a name: adding them twice, by
    this module and by the plugin, is harmless)."""
    parser.addini("kvguard", "switch kvguard on (like -p kvguard)", type="bool", default=False)
    parser.addini("kvguard_mode", "default of --kvguard-mode", default="raise")
    parser.addini("kvguard_stacks", "default of --kvguard-stacks", default="cheap")
    parser.addini("kvguard_leaks", "default of --kvguard-leaks", default="summary")
    parser.addini("kvguard_report", "default of --kvguard-report (short, full and a PATH, "
                  "space separated)", default="")
    parser.addini("kvguard_allocators", "allocator classes to guard, one per line: "
                  "'package.module:Class' then AllocatorSpec keywords as key=value",
                  type="linelist", default=[])


def pytest_addoption(parser: pytest.Parser) -> None:
    add_settings(parser)
