"""Conformance fuzzing: find an allocator's own bugs before anyone misuses it.

    from kvguard.testing import check_allocator   # the public entry point

    def test_my_pool_conforms():
        check_allocator(lambda: MyPool(64), spec)   # raises ConformanceError naming each clause

``check_allocator`` drives the *unguarded* allocator with call sequences that hypothesis
generates and shrinks, and judges every answer with kvguard's ledger (``kvguard.conformance``
names the clauses). One search per clause, so one bug never hides another; each broken clause
comes back with its shortest call sequence, what the allocator did, what the contract required,
and a pytest regression test to paste. An allocator may say which clauses it promises: a broken
promise fails the check, a clause it never promised is reported as "does not protect against".

Deterministic for a given ``seed``. ``examples`` sequences per clause (default 100) bound the
work; ``budget`` (default 30 s) is a safety cap on the whole check, after which the remaining
clauses are reported as not run. The report says how long it took. hypothesis and pytest are
imported only when a check runs: ``import kvguard`` never imports this module. Users import
it as ``kvguard.testing``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..ids import result_ids
from ..spec import AllocatorSpec
from .clauses import CLAUSES, Broken, Driver, applicable
from .probes import PROBES
from .run import Run, judge, shrink

__all__ = ["CLAUSES", "ConformanceError", "ConformanceReport", "Driver", "Finding",
           "by_id", "check_allocator", "ids_of"]

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


@dataclass
class Finding:
    """One broken clause, with the shortest call sequence that shows it."""

    clause: str
    promised: bool
    did: str
    required: str
    calls: list
    """The calls, one line each, as ``repr``-like text (the last one broke the clause)."""
    test: str
    """A pytest test that fails on the allocator as it is, and passes once it is fixed."""

    def render(self) -> str:
        lines = [f"  {self.clause} ({CLAUSES[self.clause].summary})",
                 "    calls (shrunk):"]
        lines += [f"      {c}" for c in self.calls]
        lines += [f"    the allocator: {self.did}", f"    the contract: {self.required}",
                  "    regression test:"]
        lines += [f"      {line}" if line else "" for line in self.test.splitlines()]
        return "\n".join(lines)


@dataclass
class ConformanceReport:
    """What ``check_allocator`` found."""

    allocator: str
    seed: int
    examples: int
    seconds: float
    findings: list = field(default_factory=list)
    passed: list = field(default_factory=list)
    not_run: list = field(default_factory=list)
    """Clauses skipped: they do not apply, or the budget ran out (with why)."""

    @property
    def broken_promises(self) -> list:
        return [f for f in self.findings if f.promised]

    @property
    def unprotected(self) -> list:
        return [f for f in self.findings if not f.promised]

    @property
    def broken(self) -> set:
        return {f.clause for f in self.findings}

    def render(self) -> str:
        lines = [f"kvguard conformance: {self.allocator}: {len(self.broken_promises)} broken "
                 f"promise(s), {len(self.unprotected)} unprotected clause(s); "
                 f"{self.examples} examples per clause, seed {self.seed}, "
                 f"took {self.seconds:.2f} s"]
        if self.broken_promises:
            lines += ["", "breaks a promise it makes:"]
            lines += [f.render() for f in self.broken_promises]
        if self.unprotected:
            lines += ["", "does not protect against (not promised):"]
            lines += [f.render() for f in self.unprotected]
        if self.passed:
            lines += ["", f"keeps: {', '.join(self.passed)}"]
        if self.not_run:
            lines += [f"not run: {', '.join(f'{c} ({why})' for c, why in self.not_run)}"]
        return "\n".join(lines)


class ConformanceError(AssertionError):
    """The allocator broke a clause it promises; ``.report`` holds everything found."""

    def __init__(self, report: ConformanceReport) -> None:
        super().__init__(report.render())
        self.report = report


def _kinds(clause: str, spec: AllocatorSpec) -> tuple:
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


def _search(factory, spec, driver, clause, examples, seed, deadline):
    """The shortest sequence hypothesis finds that breaks ``clause`` (a ``Run``), or None;
    ``"budget"`` when time ran out before the search could finish."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    kinds = _kinds(clause, spec)

    class Found(Exception):
        pass

    out_of_time = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, verbosity=Verbosity.quiet, print_blob=False,
              suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.generate))  # shrink() below is cheaper
    @hypothesis_seed(seed)
    @given(st.binary(max_size=3 * MAX_STEPS))
    def search(data):
        if time.monotonic() > deadline:
            out_of_time.append(True)
            return
        run = judge(factory, spec, decode(data, kinds), clause, driver)
        if run is not None:
            raise Found(run)

    try:
        search()
    except Found as found:
        ops = shrink(found.args[0].ops,
                     lambda o: judge(factory, spec, o, clause, driver) is not None)
        return judge(factory, spec, ops, clause, driver)
    return "budget" if out_of_time else None


def _describe(run: Run) -> list:
    """The steps of ``run`` as calls on ``a``, with what each returned or raised."""
    from .regression import Writer
    writer = Writer(run, None)
    calls = []
    for s in run.steps:
        if s.op == "allocate":
            calls.append(f"{writer.call('allocate', n=s.n)} -> {s.outcome}")
            continue
        value = s.form if s.form in ("bool-list", "bool") else ""
        shown = repr(s.value) if s.form == "bool" else f"{value} {s.ids}".strip()
        if s.form not in ("list", "bool", "bool-list"):
            shown = f"{s.form} {s.ids}"
        label = f"  <- the {s.op} call" if s.op in PROBES else ""
        tail = f"; the caller then overwrites its tensor with {s.mutate_to}" \
            if s.mutate_to is not None else ""
        call = writer.call("free" if s.op in PROBES else s.op, shown)
        calls.append(f"{call} -> {s.outcome}{tail}{label}")
    return calls


def check_allocator(factory, spec: AllocatorSpec | None = None, *, promises=None,
                    examples: int = DEFAULT_EXAMPLES, seed: int = 0,
                    budget: float = DEFAULT_BUDGET, driver: Driver | None = None,
                    clauses=None, make: str | None = None,
                    raise_on_broken: bool = True) -> ConformanceReport:
    """Fuzz a fresh allocator per sequence (``factory()``) against the allocator contract.

    ``spec`` says how to read it (default: its registered spec, else ``allocate``/``free``).
    ``promises``: the clause names it promises (default: every clause that applies);
    ``clauses`` limits which clauses are checked at all. ``driver`` (a
    ``kvguard.conformance.Driver``) says how to call an allocator whose methods need more than
    the ids. ``make``: the expression that builds the allocator in the regression tests
    (default: read from ``factory`` when it is a class, a partial or a one-line lambda).

    Raises ``ConformanceError`` (an ``AssertionError``) when a promised clause breaks, unless
    ``raise_on_broken=False``; returns the ``ConformanceReport`` otherwise.
    """
    started = time.monotonic()
    sample = factory()
    cls = type(sample)
    if spec is None:
        from ..registry import spec_for
        spec = spec_for(cls) or AllocatorSpec()
    if not isinstance(spec, AllocatorSpec):
        raise TypeError(f"check_allocator() needs a kvguard.AllocatorSpec, not "
                        f"{type(spec).__name__}")
    Run(sample, spec, driver)  # a spec the fuzzer cannot use fails here, before any search
    wanted = applicable(spec)
    unknown = [c for c in list(promises or ()) + list(clauses or ()) if c not in CLAUSES]
    if unknown:
        raise ValueError(f"unknown clause(s) {unknown}: the clauses are {', '.join(CLAUSES)}")
    promised = set(wanted if promises is None else promises)
    checked = [c for c in wanted if clauses is None or c in clauses]
    report = ConformanceReport(f"{cls.__module__}.{cls.__qualname__}", seed, examples, 0.0)
    report.not_run += [(c, "does not apply") for c in CLAUSES
                       if c not in wanted and (clauses is None or c in clauses)]
    if make is None:
        from .regression import factory_source
        make = factory_source(factory, cls)
    deadline = started + budget
    for clause in checked:
        if time.monotonic() > deadline:
            report.not_run.append((clause, "budget spent"))
            continue
        run = _search(factory, spec, driver, clause, examples, seed, deadline)
        if run == "budget":
            report.not_run.append((clause, "budget spent"))
        elif run is None:
            report.passed.append(clause)
        else:
            report.findings.append(_finding(run, clause, clause in promised, make, seed))
    report.seconds = time.monotonic() - started
    _log.info("kvguard conformance: %s checked in %.2f s", report.allocator, report.seconds)
    if raise_on_broken and report.broken_promises:
        raise ConformanceError(report)
    return report


def _finding(run: Run, clause: str, promised: bool, make, seed) -> Finding:
    from .regression import regression_test
    broken: Broken = run.steps[-1].broken
    test = regression_test(run, make=make, origin=f"Found by kvguard.testing (seed {seed}).")
    return Finding(clause, promised, broken.did, broken.required, _describe(run), test)
