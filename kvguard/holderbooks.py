"""The ledger's books of holders: which requests hold references to a block.

One holder per block sits in the ledger's ``holder`` column; a refcounted block that several
holders reference (a prefix hit, a fork) has ``SEVERAL`` there and its holders in the sparse
``holders`` map, holder -> references, which is empty, and costs nothing, the rest of the time.
The column alone says whether to look in the map: a block is in it exactly when its column says
``SEVERAL``, so the fast paths (the compiled ones and the closures, which call ``shared_by`` /
``released_by`` after committing) touch the map only for the blocks really shared. These are
the exact, slower operations on them.
"""

from __future__ import annotations

from .owners import OWNERS

SEVERAL = 0xFFFFFFFF
"""The ``holder`` column's mark for a block of several holders (in ``holders``); no interned
holder reaches it (``OWNERS`` is bounded far below)."""


class HolderBooks:
    """What ``Ledger`` knows of holders (it provides ``holder``, ``holders``, ``stamp``,
    ``ref``)."""

    def shared_by(self, ids, holder: int) -> None:
        """After a fast path shared live ``ids`` for ``holder`` (references already counted):
        each block another holder holds gets ``holder`` beside it in ``holders``."""
        held_by, holders, ref = self.holder, self.holders, self.ref
        for b in ids:
            first = held_by[b]
            if first == SEVERAL:
                counts = holders.get(b)
                if counts is not None:
                    counts[holder] = counts.get(holder, 0) + 1
            elif first and first != holder and ref is not None:
                holders[b] = {first: max(ref[b] - 1, 1), holder: 1}
                held_by[b] = SEVERAL

    def released_by(self, ids, holder: int) -> None:
        """After a fast path released ``ids`` for ``holder``: its reference to blocks of
        several holders is dropped, and a block now free forgets its holders (``holder`` held
        it last)."""
        held_by, stamp = self.holder, self.stamp
        for b in ids:
            if held_by[b] != SEVERAL:
                continue
            if stamp[b] <= 0:
                self.forget_holders(b, holder)
            else:
                self.drop_holders((b,), holder)

    def drop_holders(self, ids, holder: int) -> None:
        """A release of ``ids`` by ``holder`` (0: unknown) drops its reference from blocks with
        several holders; a block left with one holder goes back to the ``holder`` column (with
        none, to 0: not known)."""
        holders, held_by = self.holders, self.holder
        for b in ids:
            counts = holders.get(b)
            if counts is None:
                continue
            left = counts.get(holder, 0) - 1
            if left > 0:
                counts[holder] = left
            else:
                counts.pop(holder, None)
            if len(counts) <= 1:
                del holders[b]
                held_by[b] = next(iter(counts)) if counts else 0

    def forget_holders(self, b: int, holder: int) -> None:
        """Block ``b`` is free: it forgets its several holders, ``holder`` the last."""
        if self.holder[b] == SEVERAL:
            self.holders.pop(b, None)
            self.holder[b] = holder

    def add_holder(self, ids, holder: int) -> None:
        """``holder`` took a reference to live ``ids`` above the allocator (an engine that
        shares blocks between requests in its own books, as Hugging Face's ``BlockLedger``)."""
        held_by, holders, stamp = self.holder, self.holders, self.stamp
        for b in ids:
            if not 0 <= b < len(stamp) or stamp[b] <= 0:
                continue
            first = held_by[b]
            if first == SEVERAL:
                counts = holders.setdefault(b, {})
                counts[holder] = counts.get(holder, 0) + 1
            elif not first:
                held_by[b] = holder
            elif first != holder:
                holders[b] = {first: 1, holder: 1}
                held_by[b] = SEVERAL

    def drop_holder(self, ids, holder: int) -> None:
        """``holder``'s reference to live ``ids`` ended above the allocator (the block stays
        out of the pool, cached or held by others): it no longer holds them."""
        held_by, stamp = self.holder, self.stamp
        for b in ids:
            if not 0 <= b < len(stamp) or stamp[b] <= 0:
                continue
            if held_by[b] == SEVERAL:
                self.drop_holders([b], holder)
            elif held_by[b] == holder:
                held_by[b] = 0

    def holds(self, b: int, holder: int) -> bool:
        """Whether ``holder`` may release block ``b``: it holds a reference, or the block's
        holders are not known (no holder recorded, or none active)."""
        if not holder:
            return True
        first = self.holder[b]
        if first == SEVERAL:
            return holder in self.holders.get(b, (holder,))
        return not first or first == holder

    def holder_of(self, b: int) -> object:
        """The label of the holder of ``b`` (the first of several), None when not known."""
        index = self.holder[b]
        if index == SEVERAL:
            index = next(iter(self.holders.get(b) or (0,)))
        return OWNERS.labels[index]
