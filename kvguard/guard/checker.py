"""The checker: a ledger and normalized ids in, faults and a plan out.

It answers "what is wrong with this call, and what would the ledger do with it" and nothing
else: no lock, no mode, no allocator, no reports. Faults of the argument itself (bools, tensors,
duplicates...) come from ``kvguard.ids``; the faults here are those that need the ledger (an id
out of range, never handed out, already free; a block handed out while live). Testable with a
``Ledger`` and a ``Normalized`` alone.
"""

from __future__ import annotations

from .. import kinds
from ..normalized import Fault
from ..owners import OWNERS


class Plan:
    """What a checked free()/share() call will do, between its check and its commit."""

    __slots__ = ("method", "pool", "ledger", "norm", "good", "learned", "site", "faults",
                 "held_objects", "held", "aside", "holder", "stale")

    def __init__(self, method, pool, ledger, norm, good, learned, site, held=None,
                 faults=()) -> None:
        self.site = site
        self.held = held
        """[refcount_attr] The engine's count of each of ``norm.ids`` before the call."""
        self.method = method
        self.pool = pool
        self.ledger = ledger
        self.norm = norm
        self.good = good
        """Ids live in the ledger (for a share: handed out at least once), each once."""
        self.learned = learned
        """Ids never seen, taken as handed out before the guard attached."""
        self.faults = faults
        """What is wrong with the call, most severe first."""
        self.aside = False
        """The guard steps aside for this faulty call (``step_aside_when``)."""
        self.held_objects: dict = {}
        self.holder = 0
        """The interned holder the call was made for (0: none)."""
        self.stale: list = []
        """Live ids the holder does not hold (``stale-free``): held back from ``good``, but
        released in the ledger when the call reaches the allocator as given (log mode)."""

    @property
    def faulty(self) -> bool:
        return bool(self.faults)


def check_release(ledger, norm, *, method, pool, site, what, share=False, learn_shares=False,
                  refcount_attr=None, holder=0) -> Plan:
    """Check the ids of a free() (or, with ``share``, a share()) against ``ledger``.

    ``learn_shares``: a share of a never-seen id learns it (a refcounted pool attached while
    blocks sat in its prefix cache) rather than calling it foreign. ``refcount_attr``: the block
    objects' own reference count, read before the call, which must be positive for a release.
    ``holder``: the interned holder the call is made for (0: none); releasing a live block it
    holds no reference to, while another holder does, is a ``stale-free``.
    """
    faults = norm.faults
    ids = norm.ids
    stamp = ledger.stamp
    n = len(stamp)
    held = engine_refcounts(refcount_attr, norm) if (
        refcount_attr is not None and not share) else None
    if not faults:
        # The common case, checked in one pass: every id live (or, for a share, handed out
        # at least once) and inside the ledger. Anything else is sorted out below.
        for b in ids:
            if not b < n or stamp[b] <= 0 and (not share or stamp[b] == 0):
                break
        else:  # (b < len(stamp) means in range: a sized ledger is exactly its size long)
            # (a count of None, unreadable, is the ledger's to decide: no engine count to heed)
            if (held is None or min((c for c in held if c is not None), default=1) > 0) and (
                    not holder or share or all(ledger.holds(b, holder) for b in ids)):
                plan = Plan(method, pool, ledger, norm, ids, [], site, held)
                plan.holder = holder
                return plan
    faults = list(faults)
    good, learned, foreign, double, out_of_range = [], [], [], [], []
    unknown = 0  # ids never seen, learned by this call (bounded by the ledger's budget)
    for b in dict.fromkeys(ids):
        if not ledger.in_range(b):
            out_of_range.append(b)
        elif b >= len(stamp) or stamp[b] == 0:
            if share:
                (learned if learn_shares else foreign).append(b)
            elif ledger.learn and (ledger.learn_budget is None
                                   or unknown < ledger.learn_budget):
                learned.append(b)
                unknown += 1
            else:
                foreign.append(b)
        elif stamp[b] < 0 and not share:
            (learned if b in ledger.uncertain else double).append(b)
        else:
            good.append(b)
    stale = []
    if holder and not share:
        stale = [b for b in good if not ledger.holds(b, holder)]
        if stale:
            good = [b for b in good if b not in set(stale)]
    drained = []
    if held is not None:  # [refcount_attr] live in the ledger, but the engine holds none
        count = dict(zip(ids, held))
        drained = [b for b in good if count[b] is not None and count[b] <= 0]
        if drained:
            good = [b for b in good if b not in set(drained)]
    if out_of_range:
        faults.append(Fault(kinds.INVALID_ID, (
            f"{what} got block id {out_of_range[0]}, outside the pool [0, {ledger.size})"
            + more(out_of_range)), tuple(out_of_range)))
    if foreign:
        faults.append(Fault(kinds.FOREIGN_ID, (
            f"{what} got block id {foreign[0]}, which this allocator never handed out"
            + more(foreign) + "; was it allocated from another pool or allocator?"),
            tuple(foreign)))
    if double:
        faults.append(Fault(kinds.DOUBLE_FREE, (
            f"{what} got block id {double[0]}, which is already free" + more(double)
            + ": a second free puts it on the free list twice, and two requests will share "
            "it; free each block once, and forget ids after freeing them"), tuple(double)))
    if drained:
        faults.append(Fault(kinds.DOUBLE_FREE, (
            f"{what} got block id {drained[0]}" + more(drained) + ", whose own "
            f"{refcount_attr} is already {count[drained[0]]}: every reference to it "
            "was released, so this release takes the count below zero and the block goes "
            "back on the free list while it may still be in use; free each reference once"),
            tuple(drained)))
    if stale:
        faults.append(Fault(kinds.STALE_FREE, stale_message(ledger, what, stale, holder),
                            tuple(stale)))
    faults.sort(key=lambda f: kinds.PRECEDENCE[f.kind])
    plan = Plan(method, pool, ledger, norm, good, learned, site, held, faults)
    plan.holder = holder
    plan.stale = stale
    return plan


def stale_message(ledger, what, stale, holder) -> str:
    """What a ``stale-free`` says: who frees, who holds, and the two calls between."""
    b = stale[0]
    freeing = OWNERS.labels[holder]
    held_by = ledger.holder_of(b)
    return (f"{what} for {freeing!r} got block {b}" + more(stale)
            + f", which {freeing!r} does not hold: {held_by!r} holds it, handed out by call "
            f"#{ledger.stamp[b]} (below: where it was last freed, where it was handed out)"
            + f". A late free on behalf of {freeing!r} (an abort, a preemption or a finish "
            "racing the path that already freed it) would put a block another request is "
            "using back on the free list; free a request's blocks once, on the path that ends "
            "its reference")


def check_leases(ledger, fresh, method) -> list:
    """``free-in-flight`` faults for blocks an allocation hands out while an open in-flight
    lease still covers them (freed while a step using them was in flight, then reused)."""
    leased = ledger.leased
    reused = [b for b in fresh if b in leased]
    if not reused:
        return []
    return [Fault(kinds.FREE_IN_FLIGHT, (
        f"{method}() handed out block {reused[0]}" + more(reused) + ", which a step still in "
        "flight uses: it was freed before that step's output was processed, and its new "
        "owner's writes race the step's reads (and the step's writes corrupt the new owner); "
        "defer the free until the step is processed, or keep the block out of the free list "
        "until then"), tuple(reused))]


def check_handout(ledger, norm, method) -> tuple:
    """Check the ids an allocation handed out against ``ledger``: ``(fresh, faults)``, the ids
    that may become live (free or never seen, each once) and what is wrong with the rest. An
    unsized ledger grows to take a new id."""
    faults = list(norm.faults)
    ids = norm.ids
    stamp = ledger.stamp
    n = len(stamp)
    fresh, shared, bad = [], [], []
    if not faults and len(set(ids)) == len(ids):
        for b in ids:  # the common case in one pass: each id free or new, inside the ledger
            if not b < n or stamp[b] > 0:
                break
        else:
            return ids, faults + check_leases(ledger, ids, method) if ledger.leased else faults
    seen = set()
    for b in ids:
        if b in seen:
            shared.append(b)
            continue
        seen.add(b)
        if not ledger.in_range(b) or not ledger.grow(b + 1):
            bad.append(b)
        elif ledger.stamp[b] > 0 and b not in ledger.uncertain:
            shared.append(b)
        else:
            fresh.append(b)
    if bad:
        faults.append(Fault(kinds.INVALID_ID, (
            f"{method}() handed out block id {bad[0]}, outside the pool [0, {ledger.size})"
            + more(bad) + ": the allocator's free list is corrupt"), tuple(bad)))
    if shared:
        faults.append(Fault(kinds.SHARED_BLOCK, (
            f"{method}() handed out block {shared[0]}" + more(shared)
            + " while it is still live: two owners now share one KV block and overwrite "
            "each other's attention state; the allocator's free list is corrupt (a "
            "duplicate or double free earlier?)"), tuple(shared)))
    if ledger.leased:
        faults += check_leases(ledger, fresh, method)
    faults.sort(key=lambda f: kinds.PRECEDENCE[f.kind])
    return fresh, faults


def engine_refcounts(attr, norm):
    """[refcount_attr] Each block object's own reference count, in the order of ``norm.ids``
    (None for an object without one, or an unreadable one: the ledger decides those)."""
    objects = norm.objects
    if objects is None:
        return None
    return [_count_or_none(obj, attr) for obj in objects]


def _count_or_none(obj, attr):
    """A count the ledger can take: an int in the int32 column's range (negative ones are
    the engine's to answer for: they read as none held). Anything else (not an int, past
    int32, unreadable) is None: that block's ledger decides, and no other block's."""
    try:
        value = getattr(obj, attr)
    except Exception:
        return None
    return value if type(value) is int and value <= 2 ** 31 - 1 else None


def more(ids) -> str:
    """`` (and N more: [...])`` after the first id a message names."""
    return f" (and {len(ids) - 1} more: {list(ids[1:9])})" if len(ids) > 1 else ""
