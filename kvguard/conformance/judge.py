"""The judge: one call sequence on a fresh allocator, and whether its break counts.

A bad call's break counts only where the same calls without it keep every clause, so a bug of
valid calls is never charged to a bad call that happens to sit in front of it.
"""

from __future__ import annotations

from ..spec import AllocatorSpec
from .clauses import CLAUSES, Broken, Driver, requirement
from .contain import note
from .run import Run


def judge(factory, spec: AllocatorSpec, ops, clause: str, driver: Driver | None = None,
          tally: dict | None = None):
    """Run ``ops`` on a fresh allocator, reporting only ``clause``; for a probe clause the
    break counts only if the same sequence without the probes keeps every clause (so a bug of
    a valid sequence is never blamed on a probe that happens to sit in front of it).
    ``tally`` counts the probes made and the allocations that succeeded (``made``,
    ``allocated``): a search that made none has tested nothing."""
    note()  # a fresh sequence: the containment's hang limit counts from here
    run = Run(factory(), spec, driver, checks=[clause] if not CLAUSES[clause].probe else None)
    note(run)
    run.ops = list(ops)
    broken = run.run(ops)
    if tally is not None:
        tally["made"] = tally.get("made", 0) + run.made
        tally["allocated"] = tally.get("allocated", 0) + run.allocated
    if broken is None:
        return None
    if CLAUSES[clause].probe:
        if broken.clause != clause and not any(s.op == clause for s in run.steps):
            return None
        if Run(factory(), spec, driver, dry=True).run(ops) is not None:
            return None
        if broken.clause != clause:
            probe = [s for s in run.steps if s.op == clause][-1]
            how = "rejected" if probe.rejected else "accepted"
            broken = Broken(clause, f"{how} the {clause} call ({probe.outcome}), but it did harm: "
                            f"afterwards {broken.check}: {broken.did}",
                            requirement(clause, spec), broken.clause)
            run.steps[-1].broken = broken
    return run
