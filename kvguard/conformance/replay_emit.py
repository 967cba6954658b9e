"""``kvguard replay FILE --emit-test``: a staging log's flight recorder as a regression test.

The replay (``kvguard.staging.replay``) shows where an allocator's state first went wrong, judged
against a model. This goes one step further: it makes a fresh instance of the real allocator
class the log names, replays the recorded calls on it (unguarded, judged by the conformance
clauses of ``kvguard.conformance``), shrinks them to the fewest calls that still break the same
clause, and writes those calls as a pytest test that fails on the allocator as it is and
passes once it is fixed.

Recorded ids are the ones the engine's allocator handed out; the fresh allocator may hand out
others, so each recorded allocation names, in order, the ids the replay got in its place.
Blocks the window frees without having seen them handed out (allocated before the record
starts) are allocated first.
"""

from __future__ import annotations

from .clauses import CLAUSES
from .run import Run
from .shrink import shrink


_REPLAYABLE = {"duplicate-id": 2, "double-free": 1, "foreign-id": 1}
"""Kinds a report's own ids reproduce (a duplicated id is named once: it was passed twice)."""


def recorded_ops(steps, reports=()) -> list:
    """The replay's recorded steps as exact operations, with blocks allocated before the window
    handed out first. A report's own call is not in its window (it is recorded after the
    report): when no later window holds it, it is rebuilt from the report's kind and ids."""
    steps = [step for step in steps if not step.reported]  # rebuilt below, with their repeats
    calls = {step.call for step in steps}
    rebuilt: dict = {}
    for after, violation in reports:
        times = _REPLAYABLE.get(violation.get("kind"))
        ids = [b for b in violation.get("block_ids") or () if type(b) is int]
        if times and ids and after + 1 not in calls and violation.get("method") != "allocate":
            rebuilt.setdefault(after, []).append(("free", tuple(ids * times)))
    seen: set = set()
    earlier: list = []
    ops = []

    def add(op, ids):
        if op != "allocate":
            earlier.extend(b for b in dict.fromkeys(ids) if b not in seen and b not in earlier)
        seen.update(ids)
        ops.append(("exact", op, ids))

    placed: dict = {}  # each rebuilt call after the last recorded step at or before it
    for after, extra in rebuilt.items():
        last = max((step.call for step in steps if step.call <= after), default=None)
        placed.setdefault(last, []).extend(extra)
    for op, ids in placed.get(None, ()):
        add(op, ids)
    for step in steps:
        if step.op in ("allocate", "free", "share"):  # a reset: the replay goes on
            add(step.op, tuple(b for b in step.ids if type(b) is int))
        for op, ids in placed.get(step.call, ()):
            add(op, ids)
    return ([("exact", "allocate", tuple(earlier))] if earlier else []) + ops


def hands_out_first(ops) -> bool:
    """Whether each block a recorded free or share names was handed out by a recorded call
    before it: the shrinker keeps the allocation a bad free needs (freeing a block never
    handed out is the caller's bug, not the one the log shows)."""
    handed: set = set()
    for _, op, ids in ops:
        if op == "allocate":
            handed.update(ids)
        elif not handed.issuperset(ids):
            return False
    return True


def emit(replay, factory, spec, driver=None, make=None):
    """``(test source, clause, calls kept, calls recorded)`` for the first clause the replayed
    calls break on a fresh allocator; ValueError when they break none."""
    ops = recorded_ops(replay.steps, replay.reports)

    def broken(candidate):
        run = Run(factory(), spec, driver)
        found = run.run(candidate)
        return run, found

    run, found = broken(ops)
    if found is None:
        first = replay.reports[0][1].get("kind") if replay.reports else None
        if first in ("stale-free", "free-in-flight"):
            raise ValueError(f"the guard reported {replay.headline()}: who holds a block, and "
                             "which step still uses it, are the engine's to know, not the "
                             "allocator's, so its calls alone break no clause on a fresh "
                             f"{replay.guard.get('class', 'allocator')}; the report's stacks "
                             "show the late free and where the block went to its holder")
        raise ValueError(f"the {len(ops)} recorded call(s) break no clause on a fresh "
                         f"{replay.guard.get('class', 'allocator')}: the violation needs "
                         "state from before the record starts (a longer record: "
                         "KVGUARD_HISTORY=N), or a bigger pool (--factory)")
    clause = found.clause
    kept = shrink(ops, lambda c: hands_out_first(c) and (broken(c)[1] or _NONE).clause == clause)
    run, found = broken(kept)
    from .findings import contract_error
    from .harm import drive_on, of_break
    from .regression import regression_test
    shown = of_break(run, found) if not CLAUSES[found.check].probe else drive_on(run)
    origin = (f"Replayed from {replay.file} ({replay.guard.get('name', '?')}, pid "
              f"{replay.pid}): {len(kept)} of {len(ops)} recorded call(s). The guard "
              f"reported {replay.headline()}.")
    return regression_test(run, make=make, origin=origin, harm=shown.text if shown else "",
                           rejects_with=contract_error(factory, spec, driver)), \
        CLAUSES[clause].name, len(kept), len(ops)


class _NONE:
    clause = None


def trusted_class(name: str, trust: bool) -> str:
    """Why the class a log names may be imported (importing runs its module's code, and a
    log is untrusted input): it is registered with kvguard (the built-in engines' classes are,
    by name), or the user said ``--trust``. Otherwise a ``UsageError``: nothing is imported."""
    from ..cli import UsageError
    from ..registry import registered
    if name and name in registered():
        return "registered with kvguard"
    if trust:
        return "--trust"
    raise UsageError(f"kvguard replay: error: the log names the class {name!r}, which is not "
                     "registered with kvguard; importing it would run its module's code: pass "
                     "--trust if you trust this log and that module")


def emit_command(replay, args) -> int:
    """``kvguard replay FILE --emit-test``: the test on stdout, how it was shrunk on stderr."""
    import sys

    from ..cli import UsageError
    from .fuzz import imported, spec_option, target_for
    from ..spec import AllocatorSpec
    name = replay.guard.get("class") or ""
    why = trusted_class(name, getattr(args, "trust", False))
    sys.stderr.write(f"kvguard replay: importing {name}, the class the log names ({why})\n")
    cls = imported(name, "replay", f"the allocator class {name or '(none recorded)'}")
    spec = spec_option(args.spec, "replay")
    try:
        make, spec, driver, source = target_for(cls, args.factory, spec)
        if spec is None:
            from ..registry import spec_for
            spec = spec_for(cls) or AllocatorSpec()
        test, clause, kept, total = emit(replay, make, spec, driver, source)
    except SyntaxError as exc:
        raise UsageError(f"kvguard replay: error: --factory: {exc.msg}") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"kvguard replay: error: {exc}") from None
    sys.stdout.write(test)
    sys.stderr.write(f"kvguard replay: {clause}: {kept} of {total} recorded call(s) kept\n")
    return 0
