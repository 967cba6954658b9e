"""Conformance fuzzing: find an allocator's own bugs before anyone misuses it.

    from kvguard.testing import check_allocator

    def test_my_pool_conforms():
        check_allocator(lambda: MyPool(64), spec)   # raises ConformanceError naming each clause

The public entry point of the conformance face (``kvguard/conformance/``): ``check_allocator``
drives the *unguarded* allocator with call sequences that hypothesis generates and shrinks, and
judges every answer against the allocator contract (``kvguard.conformance.clauses``). hypothesis
and pytest are imported only when a check runs: ``import kvguard`` never imports this module.
"""

from .conformance.search import (
    CLAUSES, DEFAULT_BUDGET, DEFAULT_EXAMPLES, ConformanceError, ConformanceReport, Driver,
    Finding, MissingDependency, by_id, check_allocator, ids_of,
)
from .conformance.lifecycle import LifecycleDriver
from .conformance.lifecycle_check import LifecycleError, LifecycleReport, check_lifecycle

__all__ = ["CLAUSES", "ConformanceError", "ConformanceReport", "DEFAULT_BUDGET",
           "DEFAULT_EXAMPLES", "Driver", "Finding", "LifecycleDriver", "LifecycleError",
           "LifecycleReport", "MissingDependency", "by_id", "check_allocator", "check_lifecycle",
           "ids_of"]
