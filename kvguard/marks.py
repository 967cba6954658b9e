"""The mark on a guarded allocator: the instance attribute that holds its guard.

``guard_of`` is one dict lookup and the mark dies with the allocator. Kept apart from the guard
package so that engine adapters can ask "is this object guarded?" without importing the guard.
"""

from __future__ import annotations

ATTR = "__kvguard__"
"""The instance attribute holding an allocator's guard (and marking kvguard's wrappers)."""


def guard_of(allocator):
    """The guard instrumenting ``allocator``, or None."""
    try:
        return vars(allocator).get(ATTR)
    except TypeError:
        return None


THE_ALLOCATOR = type("TheAllocator", (), {"__repr__": lambda self: "THE_ALLOCATOR"})()
"""In a ``keeps_all.identities`` declaration (see ``kvguard.guard.shadowing``): stands for the
guarded allocator itself."""
