"""In-flight leases: the blocks a scheduled step still uses until its output is processed.

An engine schedules step N (its kernels will read and write the blocks in N's block tables),
and, with async scheduling or an overlap loop, goes on to free and allocate before N's output
comes back. Freeing a block N uses is legitimate then (a deferred free: the block must simply
not be reused until N is done); handing it out again while N is in flight is not: the new
owner's writes race N's reads, and N's writes land in the new owner's KV. A lease records, per
ledger, how many open steps use each block (``Ledger.leased``); an allocation that hands out a
leased block is a ``free-in-flight`` (found by ``checker.check_leases`` on the careful path,
where the fast paths send any call touching a leased block). Leases are opened and closed by the
engines' adapters at their own step boundaries, or by the engine itself through
``Guard.begin_step`` / ``Guard.end_step``.
"""

from __future__ import annotations

from ..ids import result_ids


def begin(guard, step, ids, pool, request=None) -> None:
    """``step`` uses ``ids`` (any form a free takes) of sub-pool ``pool`` until ``end``, on
    behalf of ``request`` (None: the whole step). A step begun again adds to its lease."""
    ledger = guard.ledger(pool)
    spec = guard.spec
    blocks = result_ids(ids, spec.id_attr, spec.skip).ids
    blocks = [b for b in dict.fromkeys(blocks) if ledger.in_range(b)]
    guard._leases.setdefault(step, []).append((ledger, blocks, request))
    leased = ledger.leased
    for b in blocks:
        leased[b] = leased.get(b, 0) + 1


def _unlease(ledger, blocks) -> None:
    leased = ledger.leased
    for b in blocks:
        left = leased.get(b, 0) - 1
        if left > 0:
            leased[b] = left
        else:
            leased.pop(b, None)


def end(guard, step) -> bool:
    """Close ``step``'s lease; False when no lease of that step was open."""
    entries = guard._leases.pop(step, None)
    if entries is None:
        return False
    for ledger, blocks, _ in entries:
        _unlease(ledger, blocks)
    return True


def void(guard, request) -> int:
    """The engine dropped ``request``'s part of every step in flight (a preemption or an abort
    that discards the step's output for it): its blocks are no longer leased. Returns how many
    lease entries ended."""
    ended = 0
    for step, entries in list(guard._leases.items()):
        keep = []
        for entry in entries:
            if request is not None and entry[2] == request:
                _unlease(entry[0], entry[1])
                ended += 1
            else:
                keep.append(entry)
        guard._leases[step] = keep
    return ended


def steps_using(guard, ledger, b) -> list:
    """The open steps whose lease covers block ``b`` of ``ledger`` (for reports)."""
    return [step for step, entries in guard._leases.items()
            if any(led is ledger and b in blocks for led, blocks, _ in entries)]


class InFlight:
    """``with guard.in_flight(step, ids):``: a lease for the body (a synchronous engine's step,
    or a test)."""

    def __init__(self, guard, step, ids, pool) -> None:
        self.guard, self.step, self.ids, self.pool = guard, step, ids, pool

    def __enter__(self):
        self.guard.begin_step(self.step, self.ids, pool=self.pool)
        return self

    def __exit__(self, *exc) -> None:
        self.guard.end_step(self.step)
