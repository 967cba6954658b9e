"""``check_lifecycle``: the lifecycle fuzzer's entry point, and its report.

    from kvguard.testing import check_lifecycle

    def test_my_scheduler_lifecycle():
        check_lifecycle(lambda: MyScheduler(num_blocks=8), MyDriver)  # raises LifecycleError

Deterministic for a given ``seed``: hypothesis draws ``examples`` event sequences of up to
``steps`` events; the first that breaks an invariant is shrunk to the fewest events that still
break one of the same kind and comes back with a standalone regression test. ``budget`` (seconds)
caps the search; the report says whether it ran out. hypothesis is imported only here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .contain import DEFAULT_HANG, GRACE, Cutoff, UserInterrupt, contained, merge, note
from .lifecycle_search import Run, search

__all__ = ["LifecycleError", "LifecycleFinding", "LifecycleReport", "check_lifecycle"]

_log = logging.getLogger("kvguard")


@dataclass
class LifecycleFinding:
    """One broken invariant, with the shortest event sequence that shows it."""

    kind: str
    message: str
    events: list
    test: str
    """A standalone test (the engine's own API only) that fails while the bug is there."""

    def event_lines(self) -> list:
        return [describe(e) for e in self.events]

    def render(self) -> str:
        lines = [f"  {self.kind}: {self.message}", "    events (shrunk):"]
        lines += [f"      {line}" for line in self.event_lines()]
        lines += ["    regression test:"]
        lines += [f"      {line}" if line else "" for line in self.test.splitlines()]
        return "\n".join(lines)


@dataclass
class LifecycleReport:
    engine: str
    seed: int
    examples: int
    seconds: float
    findings: list = field(default_factory=list)
    budget_spent: bool = False
    escapes: list = field(default_factory=list)
    """What the engine did to the process, contained: a hang, an exit, a fork, ..."""
    interrupted: str = ""

    def render(self) -> str:
        status = f"{len(self.findings)} finding(s)" if self.findings else "nothing found"
        if self.escapes:
            status += f", {len(self.escapes)} escape(s)"
        lines = [f"kvguard lifecycle: {self.engine}: {status}; {self.examples} event "
                 f"sequences, seed {self.seed}, took {self.seconds:.2f} s"
                 + (" (budget spent before every sequence ran)" if self.budget_spent else "")
                 + (f"; {self.interrupted}" if self.interrupted else "")]
        lines += [e.render() for e in self.escapes]
        lines += [f.render() for f in self.findings]
        return "\n".join(lines)


class LifecycleError(AssertionError):
    """The engine broke a lifecycle invariant; ``.report`` holds the finding."""

    def __init__(self, report: LifecycleReport) -> None:
        super().__init__(report.render())
        self.report = report


def describe(event) -> str:
    kind = event[0]
    if kind == "add":
        _, rid, doc, length, max_tokens = event
        return f"add {rid}: {length} tokens of document {doc}, max_tokens={max_tokens}"
    if kind == "schedule":
        return f"schedule step {event[1]}" if event[1] else "schedule (nothing to run)"
    if kind == "process":
        eos = f", EOS for {', '.join(event[2])}" if event[2] else ""
        return f"process step {event[1]}'s output{eos}"
    if kind == "abort":
        return f"abort {event[1]}"
    if kind == "reset":
        return "reset the prefix cache"
    return "end: every request ended, every step processed"


def check_lifecycle(make_engine, driver, *, examples: int = 200, steps: int = 24,
                    seed: int = 0, budget: float = 60.0, ignore=(), guard_mode: str = "raise",
                    hang: float = DEFAULT_HANG, raise_on_finding: bool = True
                    ) -> LifecycleReport:
    """Fuzz the request lifecycle of ``make_engine()`` (a fresh engine per event sequence)
    through ``driver`` (a ``kvguard.testing.LifecycleDriver`` subclass, called with the
    engine). ``ignore``: problem kinds not to report (already triaged). Raises
    ``LifecycleError`` on a finding (or an escape) unless ``raise_on_finding=False``.

    Contained as ``check_allocator`` is: an event sequence running past ``hang`` seconds (or
    an engine call still running ``GRACE`` seconds past ``budget``), a ``BaseException`` from
    the engine or its driver, and a fork in their code are stopped and reported in
    ``report.escapes``; the user's Ctrl-C raises ``KeyboardInterrupt`` with ``.report``."""
    from .lifecycle import LifecycleDriver
    if not (isinstance(driver, type) and issubclass(driver, LifecycleDriver)):
        raise TypeError(f"check_lifecycle() needs a LifecycleDriver subclass, not {driver!r}")
    started = time.monotonic()

    def make_run() -> Run:
        note()
        run = Run(driver(make_engine()), guard_mode=guard_mode, ignore=frozenset(ignore))
        note(run)
        return run

    keep: dict = {}
    escapes = []
    report = LifecycleReport(getattr(driver, "name", driver.__name__), seed, examples, 0.0)
    try:
        try:
            found, escape = contained(lambda: search(
                make_run, examples=examples, steps=steps, seed=seed,
                deadline=started + budget, keep=keep), hang=hang,
                deadline=started + budget + GRACE, who="the engine")
        except Cutoff:
            found, escape = keep.get("found", "budget"), None
        if escape is not None:
            escapes.append(_written(escape))
            found = keep.get("found")
        probe, escape = contained(lambda: driver(make_engine()), hang=hang, what="its factory",
                                  who="the engine")
    except KeyboardInterrupt:  # the user's: the engine's are escapes by now
        report.interrupted = "interrupted (Ctrl-C)"
        report.escapes = escapes
        report.seconds = time.monotonic() - started
        stop = UserInterrupt()
        stop.report = report
        raise stop from None
    if escape is not None:
        escapes.append(_written(escape))
    report.escapes = merge(escapes)
    report.budget_spent = found == "budget"
    if probe is not None:
        report.engine = probe.name
    if found not in (None, "budget") and probe is not None:
        from .lifecycle_emit import generic_test
        test = generic_test(probe, found.events, found.problem,
                            f"Found by kvguard.testing.check_lifecycle (seed {seed}).")
        report.findings.append(LifecycleFinding(found.problem.kind, found.problem.message,
                                                found.events, test))
    if probe is not None:
        probe.close()
    report.seconds = time.monotonic() - started
    _log.info("kvguard lifecycle: %s checked in %.2f s", report.engine, report.seconds)
    if raise_on_finding and (report.findings or report.escapes):
        raise LifecycleError(report)
    return report


def _written(escape):
    """A lifecycle escape with the events it stopped (no test: the driver's calls are not
    written out for an escape)."""
    run, escape.run = escape.run, None
    events = list(getattr(run, "events", None) or ())
    if events:
        escape.calls = [describe(e) for e in events]
        escape.calls[-1] += "  <- escaped here"
    escape.test_note = "the lifecycle fuzzer writes none for an escape: the events show it"
    return escape
