"""The part of ``Guard`` its user calls: assertions (``check``, ``assert_no_leaks``,
``check_tables``), what is live, the in-flight leases of engine steps and a snapshot of the
counters. A base class of ``Guard`` and nothing else: it works on the guard's own state, under
the guard's lock, through the modules beside it (``baseline``, ``decisions``, ``leases``).
"""

from __future__ import annotations

from .. import kinds
from ..ids import result_ids
from ..owners import OWNERS, holding
from . import baseline, decisions, leases
from .checker import stale_message
from .arguments import MISSING


class Assertions:
    """What a ``Guard``'s user asks it (see ``Guard``)."""

    def check(self) -> dict:
        """Compare the allocator's own free count with the ledger's; raises ``inconsistent``
        (in every mode: it is an assertion) when they disagree. Returns the figures."""
        self.verify()
        with self.lock:
            if self.spec.free_count is None:
                raise ValueError(f"cannot check {self.name}: its AllocatorSpec has no "
                                 "free_count to compare with; guard it with AllocatorSpec("
                                 "free_count=...), the attribute, method or callable giving "
                                 "the allocator's own count of free blocks")
            figures = baseline.compare(self, self.allocator)
            bad = {p: f for p, f in figures.items() if f[0] != f[1]}
            if bad:
                pool, (theirs, ours) = next(iter(bad.items()))
                decisions.flag(self, kinds.INCONSISTENT, (), (
                    f"the allocator's free count changed by {theirs:+d} since the guard "
                    f"attached, but the ledger saw {ours:+d}: the allocator is corrupt, or was "
                    "called behind the guard's back"), "check", pool,
                    ledger=self.ledger(pool if self.spec.pool_arg is not None else None),
                    extra={"allocator_free_delta": theirs, "ledger_free_delta": ours},
                    assertion=True)
            return figures

    @property
    def live(self) -> dict:
        """Block id (or ``(pool, id)`` with sub-pools) -> record of each live block."""
        self.verify()
        with self.lock:
            out = {}
            for pool, ledger in self._ledgers.items():
                for b in ledger.live_ids():
                    out[b if self.spec.pool_arg is None else (pool, b)] = ledger.block(b)
            return out

    def assert_no_leaks(self, owner=MISSING) -> None:
        """Raise ``leak`` if blocks are still live (of ``owner`` only, when given)."""
        with self.lock:
            for pool, ledger in self._ledgers.items():
                if owner is MISSING:
                    ids = ledger.live_ids()
                else:
                    ids = ledger.live_ids(owner, any_owner=False)
                if ids:
                    whose = "" if owner is MISSING else f" owned by {owner!r}"
                    decisions.flag(self, kinds.LEAK, ids, (
                        f"{len(ids)} block(s){whose} are still live: free them when their "
                        "sequence finishes, or they are lost to the pool"),
                        "assert_no_leaks", pool, ledger=ledger, assertion=True)

    def check_tables(self, tables, pool=None, *, refs=None) -> list:
        """Check block tables against the ledger: ids that are not live are ``stale-table``; a
        live block in more owners' tables than it has references is ``shared-block``.

        ``tables``: a mapping owner -> ids, or a 2-D integer tensor with one row per sequence
        and negative entries as padding (checked on its own device; see kvguard.cache.tables).
        ``refs``: block id -> references held, for an engine that shares blocks above its
        allocator (Hugging Face's ``BlockLedger.shared_ref_counts``).
        """
        from ..cache.tables import check_tables
        with self.lock:
            found = check_tables(self, tables, pool, refs)
            self.settle(found)
            return found

    def begin_step(self, step, ids, *, pool=None, request=None) -> None:
        """``step`` (any hashable: a step counter, a batch object's id) was scheduled and will
        read and write ``ids`` (for ``request``, when given) until ``end_step(step)``, when its
        output has been processed. Freeing those blocks meanwhile is fine (a deferred free);
        handing one out again before then is a ``free-in-flight``."""
        with self.lock:
            leases.begin(self, step, ids, pool, request)

    def add_holder(self, ids, holder, *, pool=None) -> None:
        """``holder`` (a request label) took a reference to live ``ids`` in the engine's own
        books, above the allocator (a prefix hit, a fork): its later release of them is not
        stale."""
        with self.lock:
            self.ledger(pool).add_holder(self._plain(ids), OWNERS.intern(holder))

    def drop_holder(self, ids, holder, *, pool=None) -> None:
        """``holder``'s reference to live ``ids`` ended in the engine's own books (the blocks
        stay out of the pool: cached, or held by others)."""
        with self.lock:
            self.ledger(pool).drop_holder(self._plain(ids), OWNERS.intern(holder))

    def release_by(self, ids, holder, *, pool=None, method="free") -> list:
        """``holder`` is about to release its references to ``ids`` in the engine's own books,
        above the allocator, where the pool may never see it (Hugging Face's ``BlockLedger``
        keeps a complete block in its prefix cache instead of freeing it). A live block it
        holds no reference to, while another holder does, is a ``stale-free``, reported here
        before the engine's books change (raise mode raises). Returns those stale ids (empty
        when there are none): the caller leaves them out in repair mode."""
        with self.lock:
            ledger = self.ledger(pool)
            index = OWNERS.intern(holder)
            stamp = ledger.stamp
            stale = [b for b in dict.fromkeys(self._plain(ids))
                     if 0 <= b < len(stamp) and stamp[b] > 0 and not ledger.holds(b, index)]
            if stale:
                message = stale_message(ledger, f"{method}()", stale, index)
                with holding(holder):
                    decisions.flag(self, kinds.STALE_FREE, tuple(stale), message, method, pool)
            return stale

    def _plain(self, ids) -> list:
        spec = self.spec
        return result_ids(ids, spec.id_attr, spec.skip).ids

    def void_in_flight(self, request) -> int:
        """The engine discards ``request``'s part of the steps in flight (it preempted or
        aborted it and will drop that output): its blocks may be reused at once."""
        with self.lock:
            return leases.void(self, request)

    def end_step(self, step) -> bool:
        """``step``'s output was processed: its blocks may be reused. False if it was not
        begun (or already ended)."""
        with self.lock:
            return leases.end(self, step)

    def in_flight(self, step, ids, *, pool=None):
        """``with guard.in_flight(step, ids):`` a lease for the body."""
        return leases.InFlight(self, step, ids, pool)

    @property
    def open_steps(self) -> list:
        """The steps whose lease is open, oldest first."""
        with self.lock:
            return list(self._leases)

    def snapshot(self) -> dict:
        """The counters (``stats.to_dict()``) plus ``blocks_live``, ``seeded`` (ids made live
        at attach from the spec's ``live_ids``), ``steps_in_flight`` (open leases) and
        ``blocks_leased`` (blocks they cover), for readers on other threads such as a metrics
        scrape. The guard's lock is held for the counters' copy alone: the ledgers are counted
        after it from copies of their columns, so the allocator never waits for a scan."""
        self.verify()
        with self.lock:
            figures = self.stats.to_dict()
        figures["steps_in_flight"] = len(self._leases)  # one read of a dict's size
        ledgers = list(self._ledgers.values())
        figures["blocks_leased"] = sum(len(ledger.leased) for ledger in ledgers)
        adopted = sum(ledger.adopted for ledger in ledgers)
        figures["blocks_live"] = sum(ledger.count_live() for ledger in ledgers)
        figures["seeded"] = max(adopted - figures["learned"], 0)
        return figures
