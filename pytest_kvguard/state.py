"""What the plugin knows about the running test: its phase, owner labels, violations heard and
expectations declared. Shared by the manager (which writes it as the run moves) and the fixture
(which reads it and adds to it), so neither has to reach into the other."""

from __future__ import annotations

from .markers import TestSettings


class Record:
    """One violation heard during a test."""

    __slots__ = ("violation", "when", "mode")

    def __init__(self, violation, when, mode) -> None:
        self.violation = violation
        self.when = when
        self.mode = mode


class TestState:
    """What the manager knows about the running test."""

    __test__ = False

    def __init__(self, item, settings: TestSettings) -> None:
        self.item = item
        self.nodeid = item.nodeid
        self.labels = (f"{item.nodeid} (setup)", item.nodeid, f"{item.nodeid} (teardown)")
        """Owner labels of the blocks handed out in each phase; the call phase's is the bare
        node id, which reports show and ``assert_no_leaks()`` checks."""
        self.settings = settings
        self.phase: str | None = None
        """``setup``, ``call`` or ``teardown`` from the phase's start through its report; None
        before the first phase and once the test has ended."""
        self.records: list[Record] = []
        self.expectations: list = []
        self.failed = False
        self.fixture = None
        self.marker_error = None
        self.owners: list = []
