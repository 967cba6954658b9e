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

    def render(self) -> str:
        status = f"{len(self.findings)} finding(s)" if self.findings else "nothing found"
        lines = [f"kvguard lifecycle: {self.engine}: {status}; {self.examples} event "
                 f"sequences, seed {self.seed}, took {self.seconds:.2f} s"
                 + (" (budget spent before every sequence ran)" if self.budget_spent else "")]
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
                    raise_on_finding: bool = True) -> LifecycleReport:
    """Fuzz the request lifecycle of ``make_engine()`` (a fresh engine per event sequence)
    through ``driver`` (a ``kvguard.testing.LifecycleDriver`` subclass, called with the
    engine). ``ignore``: problem kinds not to report (already triaged). Raises
    ``LifecycleError`` on a finding unless ``raise_on_finding=False``."""
    from .lifecycle import LifecycleDriver
    if not (isinstance(driver, type) and issubclass(driver, LifecycleDriver)):
        raise TypeError(f"check_lifecycle() needs a LifecycleDriver subclass, not {driver!r}")
    started = time.monotonic()

    def make_run() -> Run:
        return Run(driver(make_engine()), guard_mode=guard_mode, ignore=frozenset(ignore))

    found = search(make_run, examples=examples, steps=steps, seed=seed,
                   deadline=started + budget)
    probe = driver(make_engine())
    report = LifecycleReport(probe.name, seed, examples, 0.0, budget_spent=found == "budget")
    if found not in (None, "budget"):
        from .lifecycle_emit import generic_test
        test = generic_test(probe, found.events, found.problem,
                            f"Found by kvguard.testing.check_lifecycle (seed {seed}).")
        report.findings.append(LifecycleFinding(found.problem.kind, found.problem.message,
                                                found.events, test))
    probe.close()
    report.seconds = time.monotonic() - started
    _log.info("kvguard lifecycle: %s checked in %.2f s", report.engine, report.seconds)
    if raise_on_finding and report.findings:
        raise LifecycleError(report)
    return report
