"""The ledger: what kvguard believes about every block of one pool.

Four parallel ``array`` columns, 20 bytes per block (24 for refcounted pools):

- ``stamp`` (int64): ``+n`` while the block is live, handed out by the guard's call number
  ``n``; ``-m`` once it is free again, freed by call ``m``; ``0`` if the ledger never saw it
  handed out. One read says live / tombstone / unknown, and the numbers order events in reports.
- ``origin`` (uint32): the interned allocation site together with the owner active then.
- ``freed_at`` (uint32): the interned site of the last free.
- ``holder`` (uint32): the interned holder (``kvguard.owners``) the block was handed to, 0 for
  none, ``holderbooks.SEVERAL`` for a block several holders reference (in ``holders``); kept after the
  block is freed (who held it last).
- ``ref`` (int32, refcounted pools only): references held.

Two sparse maps cost nothing while empty: ``holders`` (a refcounted block referenced by more
than one holder: holder -> references) and ``leased`` (blocks a step still in flight uses:
block -> open leases).

Tombstones are kept forever, so a double free is caught however late it comes (AddressSanitizer
only catches it inside its quarantine window). The guard reads and writes the columns directly
on its hot path; the methods here are the exact, slower operations, and the one place the slow
path changes state.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from .holderbooks import HolderBooks
from .owners import ACTIVE_HOLDER, OWNERS
from .stacks import SITES
from .violation import BlockHistory

MAX_DENSE = 1 << 28
"""Largest pool the ledger grows to without a declared ``size`` (4 GiB of columns)."""


@dataclass(frozen=True)
class LiveBlock:
    """One live block as ``Guard.live`` shows it."""

    block_id: int
    refcount: int
    owner: object
    allocated_by_call: int
    allocated_at: list
    pool: object = None
    holder: object = None
    """The request holding it (``kvguard.owner`` or an engine adapter), None if not known."""


def _zeros(code: str, n: int) -> array:
    return array(code, bytes(array(code).itemsize * n))


class Ledger(HolderBooks):
    """One pool's blocks. Not thread-safe by itself: the guard's lock covers every call."""

    def __init__(self, size: int | None = None, pool=None, *, refcounted: bool = False,
                 learn: bool = False) -> None:
        self.size = size
        self.pool = pool
        n = size or 0
        self.stamp = _zeros("q", n)
        self.origin = _zeros("I", n)
        self.freed_at = _zeros("I", n)
        self.holder = _zeros("I", n)
        self.ref = _zeros("i", n) if refcounted else None
        self.holders: dict = {}
        """Blocks referenced by more than one holder: ``{block: {holder: references}}``."""
        self.leased: dict = {}
        """Blocks an open in-flight lease covers: ``{block: open leases}``."""
        self.refcounted = refcounted
        self.learn = learn
        """Accept frees of never-seen ids as blocks handed out before the guard attached."""
        self.learn_budget: int | None = None
        """How many more never-seen ids ``learn`` accepts (the blocks that were out at attach,
        less those learned since); None: no bound known. At 0 ``learn`` turns off."""
        self.adopted = 0
        """Blocks made live without a hand-out the guard saw (seeded or learned)."""
        self.uncertain: set = set()
        """Adopted blocks of a refcounted pool: their true reference count is unknown, so
        dropping below the ledger's count is learned rather than called a double free, and a
        hand-out while the ledger holds them live is no ``shared-block``, until the allocator
        hands them out again."""
        self.hot = (self.stamp, self.origin, self.freed_at, self.ref, self.uncertain, pool,
                    self.holder, self.holders, self.leased, ACTIVE_HOLDER, self.shared_by,
                    self.released_by)
        """What the guard's fast path reads and writes, in one tuple (columns grow in place
        and are never replaced, so it stays valid). The last item is the context variable the
        holder of a call is read from, then the two methods a fast path calls after committing a
        share or a release that touched blocks of several holders."""

    def __len__(self) -> int:
        return len(self.stamp)

    def columns(self) -> tuple:
        cols = (self.stamp, self.origin, self.freed_at, self.holder)
        return cols + (self.ref,) if self.ref is not None else cols

    def nbytes(self) -> int:
        return sum(c.buffer_info()[1] * c.itemsize for c in self.columns())

    def grow(self, needed: int) -> bool:
        """Make room for id ``needed - 1``; False when that is past every sane pool size."""
        if needed <= len(self.stamp):
            return True
        if self.size is not None or needed > MAX_DENSE:
            return False
        target = min(MAX_DENSE, max(needed, 2 * len(self.stamp), 1024))
        extra = target - len(self.stamp)
        for column in self.columns():
            column.extend(_zeros(column.typecode, extra))
        return True

    def in_range(self, block: int) -> bool:
        return 0 <= block and (self.size is None or block < self.size) and block < MAX_DENSE

    def resize(self, size: int) -> None:
        """The allocator was rebuilt with ``size`` ids (SGLang's ``resize()``): ids past it are
        gone, so a later free of one is out of range; new ids are unseen; tombstones below it
        stay, so a free through an id held across the resize is still a double free."""
        n = len(self.stamp)
        for column in self.columns():
            if size < n:
                del column[size:]
            else:
                column.extend(_zeros(column.typecode, size - n))
        self.size = size
        # In place: ``hot`` holds this very set, and the fast path writes through it.
        self.uncertain.difference_update([b for b in self.uncertain if b >= size])
        for sparse in (self.holders, self.leased):
            for b in [b for b in sparse if b >= size]:
                del sparse[b]

    # --- state changes: each takes ids the guard has already validated ---

    def allocate(self, ids, clock: int, site: int, holder: int = 0) -> None:
        """Hand out ``ids`` (each free or unknown, in range, room made, each once)."""
        stamp, origin, ref, holders = self.stamp, self.origin, self.ref, self.holders
        held_by = self.holder
        for b in ids:
            stamp[b] = clock
            origin[b] = site
            held_by[b] = holder
            if holders:
                holders.pop(b, None)
        if ref is not None:
            for b in ids:
                ref[b] = 1
            if self.uncertain:
                self.uncertain.difference_update(ids)

    def release(self, ids, clock: int, site: int, holder: int = 0) -> int:
        """Drop one reference from each of ``ids`` (each live, each once); return blocks freed.
        ``holder``'s own reference is the one dropped where the block has several holders."""
        stamp, freed_at, ref = self.stamp, self.freed_at, self.ref
        if self.holders:
            self.drop_holders(ids, holder)
            for b in ids:
                if ref is None or ref[b] <= 1:  # free after this call
                    self.forget_holders(b, holder)
        if ref is None:
            for b in ids:
                stamp[b] = -clock
                freed_at[b] = site
            return len(ids)
        freed = 0
        for b in ids:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                stamp[b] = -clock
                freed_at[b] = site
                freed += 1
        return freed

    def share(self, ids, clock: int, site: int, holder: int = 0) -> None:
        """Add a reference to each of ``ids``; a free cached block (tombstone) comes back live.
        A live block ``holder`` takes a reference to beside another holder gets a ``holders``
        entry."""
        stamp, origin, ref, held_by, holders = (self.stamp, self.origin, self.ref, self.holder,
                                                self.holders)
        for b in ids:
            if stamp[b] <= 0:
                stamp[b] = clock
                origin[b] = site
                held_by[b] = holder
                if holders:
                    holders.pop(b, None)
            if ref is not None:
                ref[b] += 1
        if holder and ref is not None:
            self.shared_by(ids, holder)

    def adopt(self, ids, clock: int) -> None:
        """Mark ids as live without a known allocation (seeded or learned on attach)."""
        self.grow(max(ids, default=-1) + 1)
        for b in ids:
            if self.stamp[b] <= 0:
                self.stamp[b] = clock
                self.adopted += 1
                if self.ref is not None:
                    self.ref[b] = 1
                    self.uncertain.add(b)

    def reset(self, clock: int, site: int) -> list:
        """Every live block is free as of ``clock`` (the allocator took them all back: a reset,
        a resize); returns their ids."""
        live = self.live_ids()
        stamp, freed_at, ref = self.stamp, self.freed_at, self.ref
        for b in self.holders:
            self.holder[b] = 0
        self.holders.clear()
        for b in live:
            stamp[b] = -clock
            freed_at[b] = site
            if ref is not None:
                ref[b] = 0
        return live

    def follow(self, live, clock: int) -> None:
        """Make the live set exactly ``live``: the allocator's own word, after a call the guard
        let through with bad input. Blocks it no longer holds are free as of ``clock``; blocks
        it holds that the ledger had free or never saw are adopted."""
        truth = set(live)
        stamp, ref = self.stamp, self.ref
        for b in self.live_ids():
            if b not in truth:
                stamp[b] = -clock
                if ref is not None:
                    ref[b] = 0
        self.adopt([b for b in truth if not self.is_live(b)], clock)

    # --- queries ---

    def refcount(self, b: int) -> int:
        if not 0 <= b < len(self.stamp) or self.stamp[b] <= 0:
            return 0
        return self.ref[b] if self.ref is not None else 1

    def is_live(self, b: int) -> bool:
        return 0 <= b < len(self.stamp) and self.stamp[b] > 0

    def seen(self, b: int) -> bool:
        """Handed out at least once (live or a tombstone)."""
        return 0 <= b < len(self.stamp) and self.stamp[b] != 0

    @property
    def free_delta(self) -> int:
        """Blocks that went live -> free minus free -> live since the guard attached: what the
        allocator's own free count should have moved by. Derived by a scan, so the hot path
        keeps no counter."""
        return self.adopted - len(self.live_ids())

    def live_ids(self, owner_label=None, *, any_owner: bool = True) -> list[int]:
        live = _positive(self.stamp)
        if any_owner:
            return live
        who = OWNERS.index.get(owner_label, -1) if owner_label is not None else 0
        site_owner, origin = SITES.owner, self.origin
        return [b for b in live if site_owner(origin[b]) == who]

    def count_live(self) -> int:
        """Blocks live now, counted from a copy of the stamp column: safe without the guard's
        lock (the copy is one memcpy under the GIL, and a copy is never resized by the guard),
        so a metrics scrape never holds up the allocator for a scan. A call in flight on
        another thread may be half counted."""
        return _count_positive(self.stamp.tobytes())

    def history(self, b: int, *, with_frees: bool = True) -> BlockHistory:
        """What a report says of block ``b`` (seen by the ledger): state, references, owner,
        the call that last changed it, where it was handed out and last freed."""
        stamp = self.stamp[b]
        site = self.origin[b]
        return BlockHistory(b, "live" if stamp > 0 else "free", self.refcount(b),
                            OWNERS.labels[SITES.owner(site)], abs(stamp), SITES.pairs(site),
                            SITES.pairs(self.freed_at[b]) if with_frees else (),
                            self.holder_of(b))

    def block(self, b: int) -> LiveBlock:
        if not self.seen(b):
            return LiveBlock(b, 0, None, 0, [], self.pool)
        site = self.origin[b]
        return LiveBlock(b, self.refcount(b), OWNERS.labels[SITES.owner(site)],
                         max(self.stamp[b], 0), SITES.frames(site), self.pool,
                         self.holder_of(b) if self.stamp[b] > 0 else None)


def _positive(column) -> list[int]:
    """Indices of the positive entries of an int64 column: numpy when it can be had (a 1M-block
    scan in about a millisecond), a plain loop otherwise."""
    try:
        import numpy
    except ImportError:
        return [b for b, v in enumerate(column) if v > 0]
    if not len(column):
        return []
    return numpy.flatnonzero(numpy.frombuffer(column, dtype=numpy.int64) > 0).tolist()


def _count_positive(data: bytes) -> int:
    """How many int64 values in ``data`` are positive: numpy when it can be had, else a loop."""
    try:
        import numpy
    except ImportError:
        return sum(1 for v in array("q", data) if v > 0)
    return int(numpy.count_nonzero(numpy.frombuffer(data, dtype=numpy.int64) > 0))
