"""Conformance fuzzing: find an allocator's own bugs before anyone misuses it.

    from kvguard.testing import check_allocator   # the public entry point

    def test_my_pool_conforms():
        check_allocator(lambda: MyPool(64), spec)   # raises ConformanceError naming each bug

``check_allocator`` drives the *unguarded* allocator with call sequences that hypothesis
generates and shrinks, and judges every answer with kvguard's ledger against the contract of
its pool kind (``kvguard.conformance.clauses``). One search per clause, so one bug never hides
another; then the clauses that end on the same harm are one finding (``report``), each with its
shortest call sequence, the harm shown (``harm``) and a regression test run before it is shown
(``findings``). An allocator may say which clauses it promises: a broken promise fails the
check, a clause it never promised is reported as "does not protect against".

Deterministic for a given ``seed``. ``examples`` sequences per clause (default 100) bound the
work; ``budget`` (default 30 s) bounds each clause (its share of what is left) and the whole
check: what finished is kept, a clause cut off is "not run". hypothesis and pytest are imported
only when a check runs: ``import kvguard`` never imports this module. Users import it as
``kvguard.testing``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..ids import result_ids
from ..spec import AllocatorSpec
from .clauses import CLAUSES, Driver, applicable, not_applicable, robustness_tier
from .contain import DEFAULT_HANG, GRACE, Cutoff, UserInterrupt, contained, merge
from .escapes import write_up
from .probes import PROBES
from .report import ConformanceReport, Finding, group
from .judge import judge
from .run import Run
from .shrink import shrink

__all__ = ["CLAUSES", "ConformanceError", "ConformanceReport", "Driver", "Finding",
           "MissingDependency", "by_id", "check_allocator", "ids_of"]

DEFAULT_EXAMPLES = 100
DEFAULT_BUDGET = 30.0

MAX_STEPS = 12

_log = logging.getLogger("kvguard")


def ids_of(value, id_attr=None) -> list:
    """Block ids as plain ints: from a list, a tensor, an array, or objects carrying the id
    (``id_attr``); used by the regression tests the fuzzer writes."""
    return result_ids(value, id_attr).ids


def by_id(value, id_attr) -> dict:
    """Block id -> the object an allocation returned for it (pools whose ids travel as objects)."""
    got = result_ids(value, id_attr)
    return dict(zip(got.ids, got.objects or ()))


class ConformanceError(AssertionError):
    """The allocator broke a clause it promises; ``.report`` holds everything found."""

    def __init__(self, report: ConformanceReport) -> None:
        super().__init__(report.render())
        self.report = report


class MissingDependency(ImportError):
    """hypothesis (or pytest) is not installed: the check cannot run at all."""


def _needs() -> None:
    for name in ("hypothesis", "pytest"):
        try:
            __import__(name)
        except ImportError:
            raise MissingDependency(f"the conformance fuzzer needs {name}: pip install "
                                    "'kvguard[fuzz]'") from None


def check_allocator(factory, spec: AllocatorSpec | None = None, *, promises=None,
                    examples: int = DEFAULT_EXAMPLES, seed: int = 0,
                    budget: float = DEFAULT_BUDGET, driver: Driver | None = None,
                    clauses=None, make: str | None = None, robustness: bool | None = None,
                    progress=None, hang: float = DEFAULT_HANG,
                    raise_on_broken: bool = True) -> ConformanceReport:
    """Fuzz a fresh allocator per sequence (``factory()``) against the allocator contract.

    ``spec`` says how to read it (default: its registered spec, else ``allocate``/``free``).
    ``promises``: the clause names it promises (default: every clause that applies);
    ``clauses`` limits which clauses are checked at all. ``driver`` (a
    ``kvguard.conformance.Driver``) says how to call an allocator whose methods need more than
    the ids. ``make``: the expression that builds the allocator in the regression tests
    (default: read from ``factory`` when it is a class, a partial or a one-line lambda).
    ``robustness``: also feed values outside a typed API's declared input (bools, tensors,
    masks, generators where block objects or arrays belong), reported apart; default: off on
    typed APIs (on a list-of-ints API those clauses are promises like the others).
    ``budget`` bounds each clause (a fair share of what is left) and the whole check.
    ``progress(clause, index, total, seconds)`` is called as each clause starts.

    Contained (``kvguard.conformance.contain``): a call sequence running past ``hang`` seconds
    (or a call still running when its clause's time is up), a ``BaseException`` from the
    allocator or ``factory`` (``sys.exit``, ``KeyboardInterrupt``, ``GeneratorExit``) and a
    fork in its code are each stopped and reported in ``report.escapes``, never the end of
    the run. The user's Ctrl-C raises ``KeyboardInterrupt`` (``UserInterrupt``) whose
    ``.report`` holds what finished.

    The allocators the check makes are never guarded (``kvguard.registry.unguarded``), also
    under ``pytest -p kvguard``: it tests the allocator, not the guard.

    Raises ``ConformanceError`` (an ``AssertionError``) when a promised clause breaks or the
    allocator escaped, unless ``raise_on_broken=False``; returns the ``ConformanceReport``
    otherwise.
    ``MissingDependency`` (an ``ImportError``) without hypothesis.
    """
    _needs()
    from ..registry import unguarded
    with unguarded():
        report = _check(factory, spec, promises, examples, seed, budget, driver, clauses,
                        make, robustness, progress, hang)
    _log.info("kvguard conformance: %s checked in %.2f s", report.allocator, report.seconds)
    if raise_on_broken and (report.broken_promises or report.escapes):
        raise ConformanceError(report)
    return report


def _check(factory, spec, promises, examples, seed, budget, driver, clauses, make,
           robustness, progress, hang) -> ConformanceReport:
    started = time.monotonic()
    sample, escape = contained(factory, hang=hang, deadline=started + budget + GRACE,
                               what="its factory")  # a named place: never a Cutoff
    if escape is not None:
        owner = factory if isinstance(factory, type) else escape.owner
        name = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else \
            getattr(factory, "__qualname__", repr(factory))
        if make is None and owner is not None:
            from .regression import factory_source
            make = factory_source(factory, owner)
        report = ConformanceReport(name, seed, examples, time.monotonic() - started)
        report.escapes = [write_up(escape, make, seed, hang, factory, owner)]
        report.not_run = [(c, "its factory escaped") for c in (clauses or CLAUSES)]
        return report
    cls = type(sample)
    if spec is None:
        from ..registry import spec_for
        spec = spec_for(cls) or AllocatorSpec()
    if not isinstance(spec, AllocatorSpec):
        raise TypeError(f"check_allocator() needs a kvguard.AllocatorSpec, not "
                        f"{type(spec).__name__}")
    unknown = [c for c in list(promises or ()) + list(clauses or ()) if c not in CLAUSES]
    if unknown:
        raise ValueError(f"unknown clause(s) {unknown}: the clauses are {', '.join(CLAUSES)}")
    wanted = applicable(spec, driver)
    tier = set(robustness_tier(spec, driver))
    promised = set(wanted if promises is None else promises) - tier
    report = ConformanceReport(f"{cls.__module__}.{cls.__qualname__}", seed, examples, 0.0)
    checked = []
    for c in CLAUSES:
        if clauses is not None and c not in clauses:
            continue
        why = not_applicable(c, spec, driver)
        if why is None and c in tier and not robustness:
            why = "robustness: off on a typed API; robustness=True (--robustness) runs it"
        if why is None:
            checked.append(c)
        else:
            report.not_run.append((c, why))
    if make is None:
        from .regression import factory_source
        make = factory_source(factory, cls)
    escapes, found = [], []
    try:
        if spec.tensor_ok or {"bool-mask", "tensor-id"} & set(checked):
            _preload()  # a slow first import of torch is not the allocator's hang
        try:
            rejects_with, escape = contained(lambda: _setup(sample, factory, spec, driver),
                                             hang=hang, deadline=started + budget + GRACE)
        except Cutoff:
            rejects_with, escape = "", None
        if escape is not None:
            escape.clauses.append("set-up")
            escapes.append(write_up(escape, make, seed, hang, factory))
        deadline = started + budget
        for i, clause in enumerate(checked):
            _clause(report, found, escapes, clause, i, checked, started, deadline, factory,
                    spec, driver, examples, seed, hang, make, clause in promised, tier,
                    rejects_with, progress)
    except KeyboardInterrupt:  # the user's (the allocator's are escapes by now)
        done = {c for c, _ in report.not_run} | set(report.passed) | {
            f.clause for f in found} | {c for e in escapes for c in e.clauses}
        at = next((c for c in checked if c not in done), None)
        report.interrupted = f"interrupted (Ctrl-C){f' in {at}' if at else ''}"
        report.not_run += [(c, "interrupted") for c in checked if c not in done]
        _finish(report, found, escapes, started)
        stop = UserInterrupt()
        stop.report = report
        raise stop from None
    return _finish(report, found, escapes, started)


def _preload() -> None:
    for name in ("numpy", "torch"):
        try:
            __import__(name)
        except Exception:  # not installed (or broken): the probes skip what needs it
            pass


def _setup(sample, factory, spec, driver) -> str:
    from .findings import contract_error
    Run(sample, spec, driver)  # a spec the fuzzer cannot use fails here, before any search
    return contract_error(factory, spec, driver)


def _clause(report, found, escapes, clause, i, checked, started, deadline, factory, spec,
            driver, examples, seed, hang, make, promised, tier, rejects_with, progress):
    """One clause's search (and its finding), contained, with its share of what is left."""
    from .findings import finding
    now = time.monotonic()
    if progress is not None:
        progress(clause, i, len(checked), now - started)
    if now >= deadline:
        report.not_run.append((clause, "budget spent before it started"))
        return
    share = (deadline - now) / (len(checked) - i)
    outcome = Outcome()

    def work():
        search_clause(factory, spec, driver, clause, examples, seed, now + share, outcome)
        if outcome.run is None:
            return None
        return finding(outcome.run, clause, promised, make, seed,
                       tier="robustness" if clause in tier else "promise",
                       rejects_with=rejects_with, factory=factory)
    try:
        got, escape = contained(work, hang=hang, deadline=now + share + GRACE)
    except Cutoff:
        report.not_run.append((clause, f"budget spent after {outcome.examples} of {examples} "
                               "examples (cut off)"))
        return
    if escape is not None:
        escape.clauses.append(clause)
        escapes.append(write_up(escape, make, seed, hang, factory))
    elif got is not None:
        found.append(got)
    elif outcome.cut_off:
        report.not_run.append((clause, f"budget spent after {outcome.examples} of "
                               f"{examples} examples"))
    elif CLAUSES[clause].probe and outcome.made == 0:
        report.not_run.append((clause, "its bad call was never made" + (
            ": no allocation succeeded" if outcome.allocated == 0 else "")))
    elif not CLAUSES[clause].probe and outcome.allocated == 0 and clause != "valid-trace":
        report.not_run.append((clause, "no allocation succeeded"))
    else:
        report.passed.append(clause)


def _finish(report, found, escapes, started) -> ConformanceReport:
    report.findings = group([f for f in found if f.tier == "promise" and f.harm])
    report.robustness = group([f for f in found if f.tier == "robustness" and f.harm])
    report.harmless = [f for f in found if not f.harm]
    report.escapes = merge(escapes)
    report.seconds = time.monotonic() - started
    return report


@dataclass
class Outcome:
    """How one clause's search ended."""

    run: object = None
    """The shrunk breaking ``Run``, or None."""
    examples: int = 0
    cut_off: bool = False
    """The deadline came before the search finished (and before it found anything)."""
    made: int = 0
    """Bad calls made (a probe clause) and allocations that succeeded."""
    allocated: int = 0


def kinds_for(clause: str, spec) -> tuple:
    kinds = ("allocate", "free") + (("share",) if spec.share else ())
    return kinds + ((clause, clause) if clause in PROBES else ())  # probes in ~2 of 5 calls


def decode(data: bytes, kinds: tuple) -> list:
    """Bytes -> abstract operations, three bytes each: which operation, then two small numbers
    (how many blocks, which live blocks, which variant of a probe). hypothesis draws one byte
    string per example (cheap) and shrinks it toward fewer, smaller bytes: fewer, simpler calls.
    """
    ops = []
    for i in range(0, len(data) - 2, 3):
        which, x, y = data[i], data[i + 1] % 16, data[i + 2]
        kind = kinds[which % len(kinds)]
        if kind == "allocate":
            ops.append(("allocate", 1 + x % 4))
        elif kind in ("free", "share"):
            ops.append((kind, (x,) if y % 16 == 0 else (x, y % 16)))
        else:
            ops.append((kind, (x,) if y < 4 else (x, (y // 4) % 16), y % 4))
    return ops


class _Stop(Exception):
    """Raised inside the hypothesis test to end the search: found, or out of time."""


def search_clause(factory, spec, driver, clause, examples, seed, deadline,
                  outcome: Outcome | None = None) -> Outcome:
    """The shortest sequence hypothesis finds that breaks ``clause`` before ``deadline``
    (filling in ``outcome`` as it goes, so a search cut off still says how far it got)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    kinds = kinds_for(clause, spec)
    tally: dict = {}
    outcome = outcome if outcome is not None else Outcome()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, verbosity=Verbosity.quiet, print_blob=False,
              suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.generate))  # shrink() below is cheaper
    @hypothesis_seed(seed)
    @given(st.binary(max_size=3 * MAX_STEPS))
    def draw(data):
        if time.monotonic() > deadline:
            outcome.cut_off = True
            raise _Stop()
        outcome.examples += 1
        run = judge(factory, spec, decode(data, kinds), clause, driver, tally)
        if run is not None:
            outcome.run = run
            raise _Stop()

    try:
        draw()
    except _Stop:
        pass
    outcome.made = tally.get("made", 0)
    outcome.allocated = tally.get("allocated", 0)
    if outcome.run is not None:
        outcome.cut_off = False

        def fails(ops):
            return time.monotonic() <= deadline + 1.0 and \
                judge(factory, spec, ops, clause, driver) is not None
        ops = shrink(outcome.run.ops, fails)
        outcome.run = judge(factory, spec, ops, clause, driver) or outcome.run
    return outcome
