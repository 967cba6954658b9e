"""What a guard tells the world: its counters, its violations' listeners, its throttled log.

Nothing here decides whether a call goes ahead (``decisions`` does); everything here must never
raise into the guarded call: a listener's bug or a logging handler that fails costs a line of
output, never the allocator's call.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from ..logger import emit
from ..compiled import FASTPATH

_subscribers: list = []
_attach_listeners: list = []


COUNTERS = ("alloc_calls", "free_calls", "share_calls", "blocks_allocated", "blocks_freed",
            "blocks_shared", "learned", "internal_errors")
"""The counters of ``Stats``, in ``to_dict()`` order; each an int, starting at 0."""


class _Counting:
    """What a guard's counters do, whichever way they are stored (``PlainStats``, ``Stats``)."""

    __slots__ = ()

    def __init__(self) -> None:
        for name in COUNTERS:
            setattr(self, name, 0)
        self.violations: Counter = Counter()

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in COUNTERS}
        d["violations"] = dict(self.violations)
        return d

    def __getstate__(self) -> dict:
        # copy and pickle by name (the same state for both kinds: C counters have no
        # object-slot state for the default protocol to take)
        return {**{name: getattr(self, name) for name in COUNTERS}, "violations": self.violations}

    def __reduce__(self):
        # every pickle protocol (0 and 1 cannot reduce C counters by themselves) and copy
        return type(self), (), self.__getstate__()

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"Stats({self.to_dict()})"


class PlainStats(_Counting):
    """Counters a guard keeps, as plain ints in ``__slots__``: ``Stats`` without the compiled
    parts, and the counters of a guard on the Python wrappers (which Python's attribute
    caches make cheapest to bump from Python code)."""

    __slots__ = COUNTERS + ("violations",)


_C_COUNTERS = getattr(FASTPATH, "Counters", None)

if _C_COUNTERS is not None:
    class Stats(_Counting, _C_COUNTERS):
        """Counters a guard keeps; ``to_dict()`` is what summaries and JSON reports show.

        With the compiled parts the counters are C integers (``kvguard._fastpath.Counters``)
        under the same names, read and written from Python as ints: a compiled wrapper adds to
        one in place, where a Python int counter costs a new int per bump."""

        __slots__ = ("violations",)
else:
    Stats = PlainStats


def new_stats(compiled: bool):
    """A new guard's counters: ``Stats`` for a guard on the compiled wrappers, ``PlainStats``
    for one on the Python wrappers (the same class where nothing is compiled)."""
    return Stats() if compiled else PlainStats()


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
            emit(logging.WARNING, "%s%s", violation.render(), again,
                 extra={"kvguard_violation": violation})


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
