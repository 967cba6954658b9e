"""Which guards are alive: a weak set (a guard never keeps an allocator or itself alive), the
engine's own methods behind kvguard's class-level dispatchers, and locks made free after a fork.
"""

from __future__ import annotations

import os
import weakref

GUARDS: "weakref.WeakSet" = weakref.WeakSet()


def guards() -> list:
    """Every guard alive in this process. Read from a copy of the set's references, taken in
    one step (``set.copy`` runs no Python code): iterating the weak set itself raised "Set
    changed size during iteration" whenever another thread made a guard meanwhile."""
    return [g for g in (ref() for ref in GUARDS.data.copy()) if g is not None]


def engine_method(obj, name):
    """``obj.name``, past the class-level dispatcher ``kvguard.dispatch`` puts on guarded
    classes: what a guard wraps and forwards to is the engine's own function. A method the
    class holds as anything but a plain function (a property, a descriptor) is read afresh at
    each call (``descriptors``)."""
    if not isinstance(obj, type):
        from .descriptors import PLAIN, Routed, class_attribute, is_data, reread
        owner, attr = class_attribute(type(obj), name)
        attr = attr.original if isinstance(attr, Routed) else attr
        if owner is not None and not isinstance(attr, PLAIN) and (
                is_data(attr) or name not in getattr(obj, "__dict__", {})):
            return reread(obj, name, attr)
    method = getattr(obj, name)
    func = getattr(getattr(method, "__func__", method), "__kvguard_function__", None)
    if func is None:
        return method
    return func.__get__(obj) if not isinstance(obj, type) else func


def _after_fork_in_child() -> None:
    """A fork copies a lock held by another thread as held, and that thread does not exist in
    the child: the child's first guarded call would wait forever. Every guard's lock starts
    free in the child. (A call that was under way in the parent is not replayed: the child's
    ledger is as it was before that call.)"""
    for g in list(GUARDS):
        reinit = getattr(g.lock, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
