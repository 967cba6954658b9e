"""The plugin's one object, registered only when kvguard is switched on.

It instruments the run (``kvguard.instrument()``), hears every violation through
``kvguard.subscribe()``, and attributes it to where the run is: a test's setup, call or
teardown, a fixture wider than one test, or collection. A test's violations that nothing
expected fail that phase's report in a ``pytest_runtest_makereport`` wrapper, also when the
code under test caught the exception or the guard only logged. Blocks are handed out under an
owner label per phase (``kvguard.owner``), which is how the teardown finds what a test leaked.
What happened travels on the reports (``report.kvguard``, ``user_properties``), so the summary
and the JSON report are built the same way alone and on the xdist controller.
"""

from __future__ import annotations

import pytest

import kvguard
from kvguard.owners import labelled
from kvguard import registry

from . import results
from .expect import Expectation, RaisesHook
from .fixture import KVGuardFixture
from .frames import hide_machinery, show_machinery, trim_violation
from .leaks import LeakSummary
from .markers import TestSettings, mark_emitted, settings_for
from .state import Record, TestState
from .tracking import Tracker


def site_table_full() -> bool:
    """Past twice its capacity the site table stops interning new stacks (it bounds a server's
    memory) and keeps only the owner of each new allocation: leaks are still told, but their
    allocation stacks are missing. Each test's owner label makes its allocation sites new ones,
    so a very large suite can get there; the summary says so rather than go quiet."""
    from kvguard.stacks import SITES

    return len(SITES) >= 2 * SITES.capacity


class KVGuardLeakWarning(pytest.PytestWarning):
    """Blocks a test handed out and never freed (``--kvguard-leaks=warn``)."""


class Manager:
    def __init__(self, config: pytest.Config, settings) -> None:
        self.config = config
        self.settings = settings
        self.tracker = Tracker()
        self.leak_summary = LeakSummary(self.tracker)
        self.results = results.Results()
        self.worker = getattr(config, "workerinput", {}).get("workerid")
        self._state: TestState | None = None
        self._where = "start of the session"
        """Where a violation outside any test happened."""
        self._fixtures: list = []
        """Stack of ``(fixturedef, label, owner context)`` of wider-than-a-test fixtures
        being set up or torn down."""
        self._outside: list = []
        self._unsubscribe = None
        self._raises = RaisesHook(self._caught)
        self._registered: list = []
        self._guard_options = {"on_violation": settings.mode, "stacks": settings.stacks}
        self._hidden: list = []

    # --- session ---------------------------------------------------------------------------

    def start(self) -> None:
        before = registry.registered()
        for name, spec in self.settings.allocators:
            self._registered.append((name, before.get(name)))
            kvguard.register(name, spec)
        self._unsubscribe = kvguard.subscribe(self._heard)
        self._raises.install()
        self._hidden = hide_machinery()
        self.tracker.install()
        self.leak_summary.install()
        kvguard.instrument(**self._guard_options)

    def pytest_unconfigure(self, config) -> None:
        kvguard.uninstrument()
        self.tracker.uninstall()
        self.leak_summary.uninstall()
        self._raises.uninstall()
        show_machinery(self._hidden)
        if self._unsubscribe is not None:
            self._unsubscribe()
        for name, previous in reversed(self._registered):
            kvguard.unregister(name)
            if previous is not None:
                kvguard.register(name, previous)

    def pytest_collection_modifyitems(self, session, config, items) -> None:
        mark_emitted(items)

    def pytest_collection_finish(self, session) -> None:
        """A spec of the run's own that fits nothing of its class, imported by now (a method
        it names is missing): a usage error before any test, not a TypeError in each."""
        mine = {name for name, _ in self.settings.allocators}
        wrong = [problem for name, problem in registry.misfits().items() if name in mine]
        if wrong:
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            raise pytest.UsageError(f"kvguard_allocators: {wrong[0]}{more}")

    def pytest_report_header(self, config) -> str:
        s = self.settings
        return (f"kvguard: on (mode={s.mode}, stacks={s.stacks}, leaks={s.leaks}), "
                f"{len(registry.registered())} allocator classes registered")

    # --- hearing violations ----------------------------------------------------------------

    def _heard(self, guard, violation) -> None:
        """Every violation of every guard lands here, in the thread that made it."""
        trim_violation(violation)
        if violation.extra.get("stepped_aside"):
            self._raises.attach(violation)
        if self._fixtures:
            self._outside.append((self._fixtures[-1][1], violation))
            return
        state = self._state
        if state is not None and state.phase is not None:
            if not state.settings.off:
                state.records.append(Record(violation, state.phase, guard.mode))
            return
        self._outside.append((self._where, violation))

    def _caught(self, violation) -> None:
        """A raises context caught this violation's exception: it, and the violations the same
        call reported with it, were expected."""
        violation.expected = True
        also = violation.extra.get("also")
        state = self._state
        if also and state is not None:
            for record in state.records:
                other = record.violation
                if (other is not violation and other.allocator_address
                        == violation.allocator_address and other.headline() in also):
                    other.expected = True

    # --- where the run is ------------------------------------------------------------------

    def _begin(self, item) -> TestState:
        leaks = self.settings.leaks
        try:
            settings, error = settings_for(item, leaks), None
        except pytest.fail.Exception as exc:
            settings, error = TestSettings(leaks), exc
        state = self._state = TestState(item, settings)
        state.marker_error = error  # raised once pytest's own setup ran: see below
        if state.settings.off:
            kvguard.uninstrument()
        return state

    def _enter(self, item, phase: str, label_index: int) -> None:
        """A phase starts: violations are the test's, blocks handed out are its own. Plain
        hooks (not wrappers) and owner contexts closed only at the end of the test keep this
        to a few microseconds; the phase stays set through its report."""
        state = self._state
        if state is None or state.item is not item:
            state = self._begin(item)
        state.phase = phase
        owner = labelled(state.labels[label_index])
        owner.__enter__()
        state.owners.append(owner)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        self._enter(item, "setup", 0)

    @pytest.hookimpl(trylast=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_marker_error(self, item) -> None:
        # After pytest's own setup, so the teardown that follows finds everything it expects.
        state = self._state
        if state is not None and state.marker_error is not None:
            raise state.marker_error

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item) -> None:
        self._enter(item, "call", 1)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem) -> None:
        self._enter(item, "teardown", 2)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        if self._state is not None:
            self._end(self._state)

    def _end(self, state: TestState) -> None:
        state.phase = None
        while state.owners:
            state.owners.pop().__exit__(None, None, None)
        if state.settings.off:
            kvguard.instrument(**self._guard_options)
        if state.fixture is not None:
            state.fixture.close()
        self._state = None
        self._where = f"between tests, after {state.nodeid}"
        self.tracker.end_test(note=False)  # the leak scan noted every guard just now

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            return (yield)
        label = f"{fixturedef.scope}-scoped fixture {fixturedef.argname!r}"
        self.leak_summary.wide_labels.add(label)
        context = labelled(label)
        self._fixtures.append((fixturedef, f"setup of {label}", context))
        try:
            with context:
                return (yield)
        finally:
            self._fixtures.pop()
            fixturedef.addfinalizer(lambda: self._fixture_teardown(fixturedef, label))

    def _fixture_teardown(self, fixturedef, label) -> None:
        # Finalizers run last-in first-out: this one runs before the fixture's own teardown,
        # and pytest_fixture_post_finalizer closes the span after it.
        context = labelled(label)
        context.__enter__()
        self._fixtures.append((fixturedef, f"teardown of {label}", context))

    def pytest_fixture_post_finalizer(self, fixturedef, request) -> None:
        if self._fixtures and self._fixtures[-1][0] is fixturedef:
            _, _, context = self._fixtures.pop()
            context.__exit__(None, None, None)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        previous, self._where = self._where, f"collection of {collector.nodeid or 'the session'}"
        try:
            return (yield)
        finally:
            self._where = previous

    # --- verdicts --------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and isinstance(call.excinfo.value, kvguard.KVGuardError):
            self._hidden += hide_machinery()  # modules imported since the start
        report = yield
        state = self._state
        if state is None or state.item is not item:
            return report
        try:
            self._judge(state, item, call, report)
        except Exception:
            import traceback

            # A bug of the plugin, or kvguard patched by the test itself: fail this report
            # with the traceback rather than crash the session.
            report.outcome = "failed"
            report.longrepr = ("kvguard: internal error in the pytest plugin while judging "
                               f"this test:\n{traceback.format_exc()}")
        return report

    def _judge(self, state: TestState, item, call, report) -> None:
        when = call.when
        records = [r for r in state.records if r.when == when] if state.records else []
        problems = []
        if state.expectations:
            for expectation in state.expectations:
                if not expectation.scoped:
                    expectation.claim(records)
            if when != "setup" and not state.failed:
                problems += self._unmet(state, when)
        leaks, leak_mode = [], state.settings.leaks
        if when == "teardown" and leak_mode == "summary":
            self._note_leaks(state)
        elif when == "teardown":
            leaks = self._leaks(state)
            if leaks and leak_mode == "warn":
                try:
                    item.warn(KVGuardLeakWarning(results.leak_warning(leaks)))
                except KVGuardLeakWarning:  # -W error::...KVGuardLeakWarning
                    leak_mode = "fail"
        if records or problems or leaks:
            results.judge(report, call, records, problems, leaks, leak_mode if leaks else None,
                          style=self.settings.style)
        if report.failed:
            state.failed = True
        if when == "teardown":
            results.add_properties(item, report, state.records, leaks)

    def _unmet(self, state: TestState, when: str) -> list[str]:
        out = []
        for expectation in state.expectations:
            if not expectation.scoped and not expectation.met and not expectation.reported:
                expectation.reported = True
                out.append(f"kvguard.expect({expectation.kind!r}): no {expectation.kind} "
                           "violation happened in this test")
        return out

    def _leaks(self, state: TestState) -> list:
        if state.settings.off or state.settings.leaks == "off" or state.failed:
            self.tracker.leaks((), state.nodeid)  # moves the scan marks on all the same
            return []
        return [trim_violation(v) for v in self.tracker.leaks(state.labels, state.nodeid)]

    def _note_leaks(self, state: TestState) -> None:
        """``--kvguard-leaks=summary``: the test's leaks are candidates, judged at the end."""
        if state.settings.off or state.failed:
            self.tracker.leaked(())  # moves the scan marks on all the same
            return
        self.leak_summary.note(state.nodeid, self.tracker.leaked(state.labels))

    def pytest_runtest_logreport(self, report) -> None:
        self.results.add_report(report)

    # --- the fixture -----------------------------------------------------------------------

    def fixture(self, item) -> KVGuardFixture:
        state = self._state
        if state is None or state.item is not item:
            raise RuntimeError("the kvguard fixture was requested outside a running test")
        if state.fixture is None:
            state.fixture = KVGuardFixture(state, self._guard_options, self.tracker, self.expect)
        return state.fixture

    def expect(self, state: TestState, kind) -> Expectation:
        expectation = Expectation(state, kind, self._raises)
        state.expectations.append(expectation)
        return expectation

    # --- the end ---------------------------------------------------------------------------

    def _late_leaks(self) -> list[dict]:
        """``--kvguard-leaks=summary``'s findings, judged now that every test has run."""
        if self.settings.leaks != "summary" and not self.leak_summary.candidates:
            return []
        return [results.as_dict(trim_violation(v), nodeid=nodeid, when="end of run",
                                mode="summary")
                for nodeid, v in self.leak_summary.judge()]

    def _outside_entries(self) -> list[dict]:
        return [results.outside_entry(where, v, self.worker) for where, v in self._outside]

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self._state is not None:  # the run was interrupted inside a test
            self._end(self._state)
        late = self._late_leaks()
        self.tracker.end_test()
        sites_full = site_table_full()
        if self.worker is not None:
            self.config.workeroutput["kvguard"] = {
                "leaks": late,
                "outside": self._outside_entries(),
                "allocators": self.tracker.counters(),
                "sites_full": sites_full,
                "misfits": registry.misfits(),
            }
            return
        self.results.misfits.update(registry.misfits())
        self.results.add_outside(self._outside_entries())
        self.results.add_leaks(late)
        self.results.add_counters(self.tracker.counters())
        self.results.sites_full |= sites_full
        if (self.results.outside_unexpected() or self.results.misfits) and \
                session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.settings.report:
            self.results.write_json(self.settings.report, self.settings)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        data = getattr(node, "workeroutput", {}).get("kvguard")
        if data:
            self.results.add_outside(data.get("outside", ()))
            self.results.add_leaks(data.get("leaks", ()))
            self.results.add_counters(data.get("allocators", {}))
            self.results.sites_full |= bool(data.get("sites_full"))
            self.results.misfits.update(data.get("misfits", {}))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        if self.worker is None:
            self.results.summary(terminalreporter, self.settings)
