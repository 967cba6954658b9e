"""What a broken clause corrupted, shown: after the break the fuzzer drives on until it shows.

"accepted it (returned None)" tells a maintainer nothing about why it matters. So the run that
broke a clause goes on, on the same allocator: it allocates every block the ledger says is
free, then as many more as the allocator's own count claims, and reads the count. What comes
out is the harm the report and the emitted test end on: a block handed to two owners, an id
that is no block of the pool handed out, a later call that raises (an ``assert``, a leaked
block), a reference count gone negative, or a free count that lies. Two clauses whose runs
end on the same harm are one bug (``Harm.key``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .clauses import Broken, Step
from .probes import PROBES
from .run import Run

TWO_OWNERS = "two owners"
NOT_A_BLOCK = "not a block handed out"
LATER_ERROR = "a later call raises"
COUNT_LIES = "the free count lies"
NEGATIVE_COUNT = "a negative reference count"


@dataclass(frozen=True)
class Harm:
    kind: str
    text: str
    error: str = ""
    """The exception class a later call raised (``LATER_ERROR``); for a reference count,
    whether the block is one the bad call named or another (an id that wrapped)."""

    @property
    def key(self) -> tuple:
        """Runs that end on the same key end in the same corrupt state: one bug."""
        return (self.kind, self.error)


def of_break(run: Run, broken: Broken) -> Harm | None:
    """The harm a break of a valid-call check shows by itself (None: it shows none)."""
    step = run.steps[-1]
    check = broken.check
    if check == "no-live-handout":
        ids = step.ids
        twice = sorted({b for b in ids if ids.count(b) > 1} | (set(ids) & set(step.expect_live)))
        from .regression import Writer
        call = f"{Writer(run, None).call('allocate', n=step.n)} {step.outcome}"
        if twice:
            return Harm(TWO_OWNERS, f"{call}: block(s) {twice} handed to two owners")
        reserved = [b for b in ids if b in run.driver.reserved]
        outside = [b for b in ids if not run.ledger.in_range(b)]
        what = (f"reserved id(s) {reserved} handed out (a padding slot or null block, never "
                "one to hand out)" if reserved else f"id(s) {outside} handed out, not blocks "
                "of the pool" if outside else "")
        return Harm(NOT_A_BLOCK, f"{call}: {what}" if what else broken.did)
    if check == "valid-trace" and step.error is not None:
        from .regression import Writer
        call = Writer(run, None).call(step.op, repr(step.ids), n=step.n) \
            if step.op in ("allocate", "free", "share") else step.op
        text = f"a later {call} raises {step.error!r}"
        if step.op == "allocate":
            text += f" with {run.capacity - len(step.expect_live)} block(s) free"
        return Harm(LATER_ERROR, text, type(step.error).__name__)
    if check == "valid-trace":
        return Harm(LATER_ERROR, broken.did, "no result")
    if check == "free-count":
        return Harm(COUNT_LIES, broken.did)
    return None


def drive_on(run: Run, *, batched: bool = False) -> Harm | None:
    """Go on from the break until the corruption shows; the calls made are ``harm`` steps of
    ``run`` (the emitted test makes them too). None when nothing shows.

    A reference count gone negative is read first (an allocation resets it); then blocks are
    allocated, as many as the ledger says are free and then as many more as the allocator's
    own count claims: one at a time, so a block handed out twice shows before a free list
    that loops on itself crashes the pool, or (``batched``) in one call each, which makes a
    shorter test where the pool survives it; last the count is read."""
    counted = _negative_count(run)
    if counted is not None:  # and what it leads to, told (the test ends on the count)
        kept = len(run.steps)
        later = _drive(run, batched)
        del run.steps[kept:]
        if later is not None and later.kind in (TWO_OWNERS, NOT_A_BLOCK, LATER_ERROR):
            counted = Harm(counted.kind, f"{counted.text}; then {later.text}", counted.error)
        return counted
    return _drive(run, batched)


def _drive(run: Run, batched: bool) -> Harm | None:
    run.checks = {"valid-trace", "no-live-handout"}
    first = len(run.steps)
    try:
        while run.expected_free() > 0:
            run.allocate(run.expected_free() if batched else 1)
        claims = run.read_free()
        while claims is not None and claims > 0:
            run.allocate(claims if batched else 1, force=True)  # the count says more: take
            if run.steps[-1].rejected:
                run.steps.pop()
                return _lies(run, first, claims, 0)
            claims = run.read_free()
        run.allocate(1, force=True)  # empty by every count: a block handed out now is live
        if run.steps[-1].rejected:
            run.steps.pop()
    except Broken as broken:
        _mark(run, first)
        run.steps[-1].broken = broken
        return of_break(run, broken)
    counted = run.read_free()
    want = run.expected_free()
    if counted is not None and counted != want:
        return _lies(run, first, counted, want)
    _mark(run, first)
    return None


def _negative_count(run: Run) -> Harm | None:
    """A reference count gone negative, or one that disagrees with the references the
    ledger says are held (a repeat dropped one reference too many, a rejected call dropped
    some): read before anything resets it."""
    if run.driver.refcount is None or run.size is None:
        return None
    counts = run.refcounts(range(run.size))
    bad = next((s for s in reversed(run.steps) if s.op in PROBES), None)
    named = set(bad.ids) if bad is not None else set()

    def which(b):
        return "a block it named" if b in named else "another block"
    for b, count in counts.items():
        if count < 0:
            run.steps.append(Step("refcount", [b], outcome=f"{count}", harm=True))
            return Harm(NEGATIVE_COUNT, f"block {b}'s reference count is {count}: released "
                        "past zero, it is no longer counted right", which(b))
    for b, count in counts.items():
        held = run.ledger.refcount(b) if run.ledger.is_live(b) else 0
        if count != held:
            run.steps.append(Step("refcount", [b], outcome=f"{count}", harm=True,
                                  expect_free=held))
            return Harm(COUNT_LIES, f"block {b}'s reference count is {count} where {held} "
                        "reference(s) are held", which(b))
    return None


def _lies(run: Run, first: int, counted: int, want: int) -> Harm:
    run.steps.append(Step("count", [], outcome=f"says {counted}", expect_free=want,
                          free_after=counted))
    _mark(run, first)
    return Harm(COUNT_LIES, f"the free count says {counted} where {want} block(s) are free")


def _mark(run: Run, first: int) -> None:
    for step in run.steps[first:]:
        step.harm = True
