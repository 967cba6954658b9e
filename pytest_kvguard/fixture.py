"""What the ``kvguard`` fixture hands a test."""

from __future__ import annotations

from typing import Callable

import kvguard
from kvguard.errors import error_for

from .expect import Expectation
from .frames import trim_violation
from .state import Record, TestState


class KVGuardFixture:
    """This test's view of kvguard.

    ``guard(obj, spec=None)`` guards an allocator that no registered class covers, with the
    run's mode and stacks, for this test (it is unguarded at teardown, after the leak check);
    ``violations`` lists what this test caused so far; ``expect(kind)`` declares a misuse the
    test means to cause; ``assert_no_leaks()`` checks the test body freed what it took.

    The manager hands it what it needs: the test's state, the run's guard options, the tracker
    that finds leaks, and how an expectation is declared.
    """

    def __init__(self, state: TestState, guard_options: dict, tracker,
                 expect: Callable[[TestState, object], Expectation]) -> None:
        self._state = state
        self._guard_options = guard_options
        """``on_violation`` and ``stacks`` of the run, for the guards this fixture makes."""
        self._tracker = tracker
        self._expect = expect
        self._guards: list = []

    @property
    def mode(self) -> str:
        return self._guard_options["on_violation"]

    @property
    def stacks(self) -> str:
        return self._guard_options["stacks"]

    def guard(self, allocator, spec=None, **options):
        fresh = kvguard.guard_of(allocator) is None
        g = kvguard.guard(allocator, spec, **{**self._guard_options, **options})
        if fresh:
            self._guards.append(g)
            self._tracker.add(g)
        return g

    @property
    def violations(self) -> list:
        """Every violation this test caused so far, expected ones included
        (``violation.expected`` tells them apart)."""
        return [record.violation for record in self._state.records]

    def expect(self, kind) -> Expectation:
        """``kvguard.expect("double-free")``: violations of that kind are expected in this
        test, which fails if none happens. ``with kvguard.expect(kind):`` narrows it to the
        block and swallows that kind's exception, so the block reads the same in both modes.
        ``kind`` may also be the exception class (``kvguard.DoubleFreeError``)."""
        return self._expect(self._state, kind)

    def assert_no_leaks(self) -> None:
        """Raise ``kvguard.LeakError`` if blocks the test body handed out are still live.
        Blocks of fixtures are not counted: they are freed at teardown, and checked then."""
        __tracebackhide__ = True
        state = self._state
        found = self._tracker.leaks((state.nodeid,), state.nodeid, only_changed=False, at="now")
        if found:
            for v in found:
                trim_violation(v)
                state.records.append(Record(v, state.phase or "call", "raise"))
            raise error_for(found[0])

    def close(self) -> None:
        while self._guards:
            self._guards.pop().unguard()

    def __repr__(self) -> str:
        return (f"<kvguard fixture for {self._state.nodeid}: mode={self.mode}, "
                f"{len(self._state.records)} violation(s)>")
