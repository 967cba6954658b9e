"""What a guard tells the world: its counters, its violations' listeners, its throttled log.

Nothing here decides whether a call goes ahead (``decisions`` does); everything here must never
raise into the guarded call: a listener's bug or a logging handler that fails costs a line of
output, never the allocator's call.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from ..logger import emit

_subscribers: list = []
_attach_listeners: list = []


class Stats:
    """Counters a guard keeps; ``to_dict()`` is what summaries and JSON reports show."""

    __slots__ = ("alloc_calls", "free_calls", "share_calls", "blocks_allocated", "blocks_freed",
                 "blocks_shared", "learned", "internal_errors", "violations")

    def __init__(self) -> None:
        self.alloc_calls = self.free_calls = self.share_calls = 0
        self.blocks_allocated = self.blocks_freed = self.blocks_shared = 0
        self.learned = self.internal_errors = 0
        self.violations: Counter = Counter()

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__slots__ if name != "violations"}
        d["violations"] = dict(self.violations)
        return d

    def __repr__(self) -> str:
        return f"Stats({self.to_dict()})"


def subscribe(callback):
    """Call ``callback(guard, violation)`` for every violation of every guard; returns an
    unsubscribe function. The pytest plugin and the staging sink listen here."""
    _subscribers.append(callback)

    def unsubscribe() -> None:
        if callback in _subscribers:
            _subscribers.remove(callback)
    return unsubscribe


def on_attach(callback):
    """Call ``callback(guard)`` for every guard attached from now on; returns an unsubscribe
    function. Staging listens here to write a guard's stats line when it is collected."""
    _attach_listeners.append(callback)

    def unsubscribe() -> None:
        if callback in _attach_listeners:
            _attach_listeners.remove(callback)
    return unsubscribe


def announce(guard) -> None:
    """Tell the attach listeners about a newly attached guard."""
    for callback in list(_attach_listeners):
        try:
            callback(guard)
        except Exception as exc:  # a listener's bug must not stop the guarding
            internal_error(guard, exc)


def internal_error(guard, exc: BaseException) -> None:
    """Count a bug of kvguard's own (or of a listener); log the first of each guard."""
    guard.stats.internal_errors += 1
    if guard.stats.internal_errors == 1:
        emit(logging.ERROR, "kvguard: internal error in the guard of %s, call forwarded "
             "unchecked (logged once per guard): %r", guard.name, exc, exc_info=exc)


class Journal:
    """A guard's violations: the last ``keep`` of them; ``log`` writes the first occurrence
    of each kind and call site, then one in ``every``."""

    __slots__ = ("kept", "every", "logged")

    def __init__(self, keep: int, every: int) -> None:
        self.kept = deque(maxlen=keep)
        self.every = max(1, every)
        self.logged: Counter = Counter()

    def log(self, violation) -> None:
        key = (violation.kind, violation.summary())
        self.logged[key] += 1
        n = self.logged[key]
        if n == 1 or n % self.every == 0:
            again = f" (occurrence {n})" if n > 1 else ""
            emit(logging.WARNING, "%s%s", violation.render(), again)


def record(guard, violation, *, log: bool) -> None:
    """Keep, count, log (when told: the guard does not raise it) and publish one violation."""
    guard.journal.kept.append(violation)
    guard.stats.violations[violation.kind] += 1
    if log:
        guard.journal.log(violation)
    for callback in list(_subscribers):
        try:
            callback(guard, violation)
        except Exception as exc:  # a listener's bug must not break the guarded call
            internal_error(guard, exc)
