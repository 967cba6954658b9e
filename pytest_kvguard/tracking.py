"""Every guard the run creates, noted without keeping its allocator alive, and leak scans.

A guard and its allocator reference each other, so a test's allocator dies only when the
cyclic garbage collector runs: at teardown it may or may not still exist. To judge leaks the
same way every time, the tracker notes each guard before any collection could take it (a
``gc.callbacks`` hook at the start of every collection, and the test's phase boundaries) and
keeps what a leak report needs (the ledgers, the flight recorder, the counters), never the guard
or the allocator: a test that checks its allocator is collected still sees it collected.
"""

from __future__ import annotations

import gc
import weakref

import kvguard
from kvguard import kinds
from kvguard.guard import Guard
from kvguard.guard.evidence import block_histories, operations
from kvguard.owners import OWNERS
from kvguard.stacks import SITES
from kvguard.violation import Violation

COUNTERS = ("alloc_calls", "free_calls", "share_calls", "blocks_allocated", "blocks_freed",
            "blocks_shared", "internal_errors")


class GuardRecord:
    """What outlives a guard for the plugin's purposes."""

    __slots__ = ("ref", "allocator_class", "name", "address", "alloc", "ledgers", "history",
                 "stats", "mark")

    def __init__(self, guard: Guard) -> None:
        self.ref = weakref.ref(guard)
        self.allocator_class = guard.allocator_class
        self.name = guard.name
        self.address = guard.address
        self.alloc = guard.spec.alloc or "allocate"
        self.ledgers = guard.ledgers  # a live view: sub-pools added later show up
        self.history = guard.history
        self.stats = guard.stats
        self.mark = 0
        """alloc + share calls at the last leak scan: a guard idle since is not scanned."""


class Tracker:
    """Notes guards; scans the ones a test used for blocks it still holds."""

    def __init__(self) -> None:
        self._known: dict[int, GuardRecord] = {}
        """Records of guards alive, or dead since the last ``end_test()``, by ``id(stats)``:
        the record holds the stats, so no other guard can have that key while it is here."""
        self._pending: list = []
        self._pending_keys: set = set()
        self._before: dict = {}
        """Stats of the guards alive before the session (held, so their ids stay theirs):
        another session's in the same process, or the caller's. Never counted or scanned."""
        self.totals: dict = {}
        """Counters of the guards already retired, per allocator class."""

    def install(self) -> None:
        self._before = {id(g.stats): g.stats for g in kvguard.guards()}
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase, info) -> None:
        # Runs inside the collector, maybe in another thread, maybe while note() iterates:
        # lookups and list appends only.
        if phase == "start":
            self._collect_new()

    def _collect_new(self) -> None:
        known, pending, keys = self._known, self._pending, self._pending_keys
        before = self._before
        for guard in kvguard.guards():
            key = id(guard.stats)
            if key not in known and key not in keys and key not in before:
                keys.add(key)
                pending.append(GuardRecord(guard))

    def add(self, guard: Guard) -> None:
        """Note one guard now (the fixture's ``guard()`` does, before anything can collect
        it)."""
        self._before.pop(id(guard.stats), None)
        self._pending.append(GuardRecord(guard))
        self.note()

    def note(self) -> None:
        self._collect_new()
        pending, self._pending = self._pending, []
        self._pending_keys = set()
        known = self._known
        for record in pending:
            known.setdefault(id(record.stats), record)

    def end_test(self, note: bool = True) -> None:
        """Retire the records of guards that died: their counters go into the totals, their
        ledgers are let go."""
        if note:
            self.note()
        for key, record in list(self._known.items()):
            if record.ref() is None:
                del self._known[key]
                _add_counters(self.totals, record)

    def records(self) -> list[GuardRecord]:
        self.note()
        return list(self._known.values())

    def counters(self) -> dict:
        """Per allocator class: guards, calls and blocks, violations per kind (JSON-ready)."""
        out = {cls: dict(entry, violations=dict(entry["violations"]))
               for cls, entry in self.totals.items()}
        for record in self.records():
            _add_counters(out, record)
        return out

    # --- leaks -------------------------------------------------------------------------------

    def leaks(self, owner_labels, test: str, *, only_changed: bool = True,
              at: str = "after its teardown") -> list[Violation]:
        """One ``leak`` violation per guard and sub-pool holding live blocks handed out under
        any of ``owner_labels``, blamed on ``test``. ``only_changed`` skips guards with no
        hand-out since the previous scan (the previous test's teardown)."""
        return [leak_violation(record, pool, record.ledgers[pool], ids, test, at)
                for record, pool, ids in self.leaked(owner_labels, only_changed=only_changed)]

    def leaked(self, owner_labels, *, only_changed: bool = True) -> list:
        """``(record, pool, ids)`` of each guard and sub-pool holding live blocks handed out
        under any of ``owner_labels``; see ``leaks()``."""
        wanted = None
        found = []
        for record in self.records():
            calls = record.stats.alloc_calls + record.stats.share_calls
            if only_changed:
                if calls == record.mark:
                    continue
                record.mark = calls
            if wanted is None:
                index = OWNERS.index
                wanted = {index[label] for label in owner_labels if label in index}
            if not wanted:
                continue
            for pool, ledger in list(record.ledgers.items()):
                ids = owned_live(ledger, wanted)
                if ids:
                    found.append((record, pool, ids))
        return found


def _add_counters(table: dict, record: GuardRecord) -> None:
    entry = table.get(record.allocator_class)
    if entry is None:
        entry = table[record.allocator_class] = dict.fromkeys(("guards", *COUNTERS), 0)
        entry["violations"] = {}
    entry["guards"] += 1
    stats = record.stats
    for name in COUNTERS:
        entry[name] += getattr(stats, name)
    by_kind = entry["violations"]
    for kind, n in stats.violations.items():
        by_kind[kind] = by_kind.get(kind, 0) + n


SMALL_LEDGER = 4096
"""Up to this many blocks a plain loop scans faster than numpy's set-up."""


def owned_live(ledger, wanted) -> list[int]:
    """Live blocks of ``ledger`` handed out under one of the owner indices ``wanted``."""
    owner_of, origin, stamp = SITES.owner, ledger.origin, ledger.stamp
    if len(stamp) <= SMALL_LEDGER:
        return [b for b, s in enumerate(stamp) if s > 0 and owner_of(origin[b]) in wanted]
    return [b for b in ledger.live_ids() if owner_of(origin[b]) in wanted]


def leak_violation(record: GuardRecord, pool, ledger, ids, test, at) -> Violation:
    """A ``leak`` report whose stack is where the first leaked block was handed out: that
    line is what the SUMMARY names, and what the reader has to fix."""
    blocks = block_histories(ledger, ids, with_frees=False)
    first_site = blocks[0].allocated_at
    history = operations(record.history)
    where = f" in pool {pool!r}" if pool is not None else ""
    return Violation(
        kind=kinds.LEAK, block_ids=tuple(ids),
        message=(f"{len(ids)} block(s){where} handed out during {test} are still live {at}: "
                 "free them when their sequence finishes, or they are lost to "
                 "the pool"),
        allocator=record.allocator_class, allocator_name=record.name,
        allocator_address=record.address, method=record.alloc, pool=pool,
        call_stack=first_site,
        blocks=[blk for blk in blocks[1:] if blk.allocated_at != first_site],
        owner=test, history=history,
    )
