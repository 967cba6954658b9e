"""The figures of every guard a process has had, summed per Prometheus label set: what the
collector and the multi-process writer of ``metrics`` read, on any thread, while other threads
make, use and drop guards."""

from __future__ import annotations

import threading
import weakref
from collections import Counter

from .. import kinds


def _identity(guard) -> tuple:
    spec = guard.spec
    return guard.allocator_class, spec.alloc, spec.free, spec.share


def _figures_to_samples(identity, figures) -> tuple:
    """One guard's figures as ``({(metric, labels): value} counters, gauges)``."""
    cls, alloc, free, share = identity
    counters = {("kvguard_calls_checked", (cls, alloc)): figures["alloc_calls"],
                ("kvguard_calls_checked", (cls, free)): figures["free_calls"],
                ("kvguard_ids_learned", (cls,)): figures["learned"],
                ("kvguard_ids_seeded", (cls,)): figures.get("seeded", 0),
                ("kvguard_internal_errors", (cls,)): figures["internal_errors"]}
    if share:
        counters[("kvguard_calls_checked", (cls, share))] = figures["share_calls"]
    # Every kind from zero: a counter that first appears at 1 hides its first increase
    # from rate() and increase().
    for kind in (*kinds.MEANING, *figures["violations"]):
        counters[("kvguard_violations", (cls, kind))] = figures["violations"].get(kind, 0)
    gauges = {("kvguard_blocks_live", (cls,)): figures.get("blocks_live", 0),
              ("kvguard_guards", (cls,)): 1,
              ("kvguard_steps_in_flight", (cls,)): figures.get("steps_in_flight", 0),
              ("kvguard_blocks_leased", (cls,)): figures.get("blocks_leased", 0)}
    return counters, gauges


class Totals:
    """The figures of every guard this process has had, summed per label set.

    Counters never go down: a guard that is unguarded keeps counting what it checked, and once
    it is garbage collected its last counts move into ``retired``, at the first read after, in
    the same step that stops counting it alive (no finalizer: a finalizer waiting for the lock
    while a read ran made that read count the guard nowhere, and the counters dropped under
    churn). A guard created and collected between two reads was never seen, so its calls are
    not counted (engines keep their allocators for the life of the process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # kvguard's own bookkeeping, never a guard's lock
        self._seen: dict = {}
        """weak reference to a guard -> [identity, stats, seeded]: what its last counts need
        once it is gone."""
        self.retired: Counter = Counter()

    def read(self) -> tuple:
        """``(counters, gauges)``: ``{(metric, labels): value}`` over every guard."""
        from ..guard import guards
        current = guards()
        with self._lock:
            alive = self._sweep(current)
            counters = Counter(self.retired)
        gauges: Counter = Counter()
        guarded = {id(guard) for guard in current}  # an unguarded one counts, but holds none
        for guard, entry in alive:  # held strongly: none can go before it is counted
            figures = guard.snapshot()
            entry[2] = figures["seeded"]
            c, g = _figures_to_samples(entry[0], figures)
            counters.update(c)
            if id(guard) in guarded:
                gauges.update(g)
        return dict(counters), dict(gauges)

    def _sweep(self, current) -> list:
        """Under ``_lock``: note the guards in ``current`` not seen yet, move the counts of
        those gone into ``retired``, and return ``(guard, entry)`` for those alive."""
        for guard in current:
            ref = weakref.ref(guard)
            entry = self._seen.get(ref)
            if entry is None:
                self._seen[ref] = [_identity(guard), guard.stats, 0]
            else:
                entry[1] = guard.stats
        alive = []
        for ref, entry in list(self._seen.items()):
            guard = ref()
            if guard is None:
                identity, stats, seeded = entry
                figures = {**stats.to_dict(), "seeded": seeded}
                self.retired.update(_figures_to_samples(identity, figures)[0])
                del self._seen[ref]
            else:
                alive.append((guard, entry))
        return alive

    def after_fork_in_child(self) -> dict:
        """In a forked child: a fresh lock (another thread may have held ours at the fork), and
        the counters as they stand at the fork, over every guard alive, whether a read has seen
        it or not (the child counts from there: once only the guards read before the fork were
        in it, a fork before the writer's first push made the child count the parent's calls
        again). Guards' locks are free by now (kvguard.guard's own at-fork hook runs first)."""
        from ..guard import guards
        self._lock = threading.Lock()
        alive = self._sweep(guards())
        counters = Counter(self.retired)
        for guard, entry in alive:
            try:
                figures = guard.snapshot()
            except Exception:  # a guard half-made at the fork: its counters alone
                figures = {**guard.stats.to_dict(), "seeded": entry[2]}
            entry[2] = figures["seeded"]
            counters.update(_figures_to_samples(entry[0], figures)[0])
        return dict(counters)
