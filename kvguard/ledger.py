"""The ledger: what kvguard believes about every block of one pool.

Five parallel ``array`` columns, 20 bytes per block: refcount, generation, allocation site, free
site, owner. A block is live while its refcount is above zero; a block with generation > 0 and
refcount 0 is a tombstone, kept forever, so a double free is caught however late it comes
(AddressSanitizer only catches it inside its quarantine window). Generation 0 means the ledger
never saw the block handed out.

The guard reads the columns directly on its hot path; the methods here are the slow, exact
operations (reports, tables, leaks) and the single place state changes.
"""

from __future__ import annotations

from array import array
from contextvars import ContextVar
from dataclasses import dataclass

from .stacks import SITES

MAX_DENSE = 1 << 28
"""Largest pool the ledger grows to without a declared ``size`` (5 GiB of columns at 20 B/id)."""

_current_owner: ContextVar = ContextVar("kvguard_owner", default=0)


class _Owners:
    """Interns owner labels (a request id, a test's node id) to small ints; 0 is "no owner"."""

    def __init__(self) -> None:
        self.labels: list = [None]
        self.index: dict = {}

    def intern(self, label) -> int:
        if label is None:
            return 0
        try:
            return self.index[label]
        except KeyError:
            self.index[label] = n = len(self.labels)
            self.labels.append(label)
            return n
        except TypeError:
            return self.intern(repr(label))


OWNERS = _Owners()


class owner:
    """``with kvguard.owner("req-7"):`` blocks handed out inside belong to "req-7".

    Reports name the owner of a block, and ``Guard.live`` / leak checks can filter by it. The
    pytest plugin sets each test's node id as the owner while it runs.
    """

    def __init__(self, label) -> None:
        self._index = OWNERS.intern(label)
        self._token = None

    def __enter__(self):
        self._token = _current_owner.set(self._index)
        return self

    def __exit__(self, *exc) -> None:
        _current_owner.reset(self._token)


def current_owner() -> object:
    return OWNERS.labels[_current_owner.get()]


@dataclass(frozen=True)
class LiveBlock:
    """One live block as ``Guard.live`` shows it."""

    block_id: int
    refcount: int
    owner: object
    generation: int
    allocated_at: list
    pool: object = None


def _zeros(code: str, n: int) -> array:
    return array(code, bytes(array(code).itemsize * n))


class Ledger:
    """One pool's blocks. Not thread-safe by itself: the guard's lock covers every call."""

    def __init__(self, size: int | None = None, pool=None, learn: bool = False) -> None:
        self.size = size
        self.pool = pool
        n = size or 0
        self.ref = _zeros("i", n)
        self.gen = _zeros("I", n)
        self.alloc_site = _zeros("I", n)
        self.free_site = _zeros("I", n)
        self.owner = _zeros("I", n)
        self.free_delta = 0
        """Blocks that went live -> free minus free -> live since the guard attached."""
        self.learn = learn
        """Accept frees of never-seen ids as live blocks handed out before the guard attached."""
        self.learned = 0
        self.high = 0
        """One past the highest id ever handed out: scans stop here."""

    def __len__(self) -> int:
        return len(self.ref)

    def nbytes(self) -> int:
        return sum(c.buffer_info()[1] * c.itemsize for c in self.columns())

    def columns(self):
        return (self.ref, self.gen, self.alloc_site, self.free_site, self.owner)

    def grow(self, needed: int) -> bool:
        """Make room for id ``needed - 1``; False when that is past every sane pool size."""
        if needed <= len(self.ref):
            return True
        if self.size is not None or needed > MAX_DENSE:
            return False
        target = min(MAX_DENSE, max(needed, 2 * len(self.ref), 1024))
        extra = target - len(self.ref)
        for column in self.columns():
            column.extend(_zeros(column.typecode, extra))
        return True

    def in_range(self, block: int) -> bool:
        return 0 <= block and (self.size is None or block < self.size) and block < MAX_DENSE

    # --- the state changes: each takes ids the guard has already validated ---

    def allocate(self, ids, site: int) -> None:
        """Hand out ``ids`` (each free, in range, room made)."""
        ref, gen, asite, owner = self.ref, self.gen, self.alloc_site, self.owner
        who = _current_owner.get()
        high = self.high
        for b in ids:
            ref[b] = 1
            gen[b] += 1
            asite[b] = site
            owner[b] = who
            if b >= high:
                high = b + 1
        self.high = high
        self.free_delta -= len(ids)

    def release(self, ids, site: int) -> int:
        """Drop one reference from each of ``ids`` (each live, each once); return blocks freed."""
        ref, fsite = self.ref, self.free_site
        freed = 0
        for b in ids:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                fsite[b] = site
                freed += 1
        self.free_delta += freed
        return freed

    def share(self, ids, site: int) -> None:
        """Add a reference to each of ``ids``; a free cached block (tombstone) comes back live."""
        ref, gen, asite, owner = self.ref, self.gen, self.alloc_site, self.owner
        who = _current_owner.get()
        for b in ids:
            if ref[b] == 0:
                gen[b] += 1
                asite[b] = site
                owner[b] = who
                self.free_delta -= 1
            ref[b] += 1

    def adopt(self, ids) -> None:
        """Mark ids as live without a known allocation (seeded or learned on attach)."""
        self.grow(max(ids, default=-1) + 1)
        for b in ids:
            if self.ref[b] == 0:
                self.ref[b] = 1
                self.gen[b] += 1
                if b >= self.high:
                    self.high = b + 1

    # --- queries ---

    def is_live(self, block: int) -> bool:
        return 0 <= block < len(self.ref) and self.ref[block] > 0

    def state(self, block: int) -> str:
        if not self.in_range(block):
            return "invalid"
        if block >= len(self.ref) or self.gen[block] == 0:
            return "unknown"
        return "live" if self.ref[block] > 0 else "free"

    def live_ids(self, owner_label=None, *, any_owner: bool = True) -> list[int]:
        ref = self.ref
        if any_owner:
            return [b for b in range(self.high) if ref[b] > 0]
        who = OWNERS.index.get(owner_label, -1) if owner_label is not None else 0
        own = self.owner
        return [b for b in range(self.high) if ref[b] > 0 and own[b] == who]

    def live_count(self) -> int:
        ref = self.ref
        return sum(1 for b in range(self.high) if ref[b] > 0)

    def block(self, b: int) -> LiveBlock:
        if b >= len(self.ref):
            return LiveBlock(b, 0, None, 0, [], self.pool)
        return LiveBlock(b, self.ref[b], OWNERS.labels[self.owner[b]], self.gen[b],
                         SITES.frames(self.alloc_site[b]), self.pool)
