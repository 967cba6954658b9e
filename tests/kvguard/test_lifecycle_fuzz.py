"""The lifecycle fuzzer on ``kvguard.conformance.lifecycle_example.ExampleScheduler``, a small
scheduler shaped like vLLM's v1 ``Scheduler`` (refcounted pool, preemption, async scheduling,
deferred frees): each bug engines have shipped is planted in turn, found, shrunk and emitted as a
regression test that fails on the buggy scheduler and passes on its fixed twin; the fixed
scheduler is clean. The real engines' drivers are exercised by ``benchmarks/lifecycle/``."""

import functools

import pytest

from kvguard.conformance.lifecycle import LifecycleDriver, check_invariants
from kvguard.conformance.lifecycle_example import BUGS, ExampleDriver, ExampleScheduler
from kvguard.testing import LifecycleError, check_lifecycle

EXAMPLES = 200

PLANTED = {  # bug -> (scheduler options, kind reported, events the shrunk sequence must hold)
    "stale-free-after-abort": ({"async_scheduling": True}, "double-free", ["abort", "process"]),
    "free-in-flight": ({"async_scheduling": True, "defer_frees": True}, "free-in-flight",
                       ["schedule", "abort"]),
    "preempt-double-free": ({"async_scheduling": True}, "stale-table", ["schedule"]),
}


def scheduler(bugs=(), num_blocks=4, **options):
    return functools.partial(ExampleScheduler, num_blocks, 2, bugs=bugs, **options)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_bug_is_found_shrunk_and_emitted(bug):
    options, kind, needed = PLANTED[bug]
    report = check_lifecycle(scheduler((bug,), **options), ExampleDriver, examples=EXAMPLES,
                             raise_on_finding=False)
    (finding,) = report.findings
    assert finding.kind == kind
    kinds = [e[0] for e in finding.events]
    assert kinds[0] == "add" and len(kinds) <= 6, finding.event_lines()
    at = 0
    for want in needed:  # in this order
        at = kinds.index(want, at) + 1

    buggy = {}
    exec(compile(finding.test, "emitted", "exec"), buggy)
    test = next(v for k, v in buggy.items() if k.startswith("test_lifecycle_"))
    with pytest.raises(AssertionError):
        test()
    fixed = {}
    exec(compile(finding.test.replace(f"bugs={[bug]!r}", "bugs=[]"), "emitted", "exec"), fixed)
    next(v for k, v in fixed.items() if k.startswith("test_lifecycle_"))()


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"async_scheduling": True, "defer_frees": True}],
                         ids=["sync", "async", "async-deferred"])
def test_the_fixed_scheduler_is_clean(options):
    report = check_lifecycle(scheduler(**options), ExampleDriver, examples=EXAMPLES)
    assert report.findings == [] and not report.budget_spent


def test_a_finding_raises_with_the_report_and_is_deterministic():
    make = scheduler(("free-in-flight",), async_scheduling=True, defer_frees=True)
    with pytest.raises(LifecycleError) as first:
        check_lifecycle(make, ExampleDriver, examples=EXAMPLES, seed=3)
    again = check_lifecycle(make, ExampleDriver, examples=EXAMPLES, seed=3,
                            raise_on_finding=False)
    assert first.value.report.findings[0].events == again.findings[0].events
    assert "free-in-flight" in str(first.value) and "regression test:" in str(first.value)


def test_ignored_kinds_are_not_reported():
    make = scheduler(("free-in-flight",), async_scheduling=True, defer_frees=True)
    report = check_lifecycle(make, ExampleDriver, examples=50, ignore={"free-in-flight"},
                             raise_on_finding=False)
    assert all(f.kind != "free-in-flight" for f in report.findings)


def test_the_budget_cuts_the_search_short_and_says_so():
    report = check_lifecycle(scheduler(), ExampleDriver, examples=10_000, budget=0.5)
    assert report.budget_spent and "budget spent" in report.render()


def test_a_driver_must_be_a_lifecycle_driver_class():
    with pytest.raises(TypeError, match="LifecycleDriver subclass"):
        check_lifecycle(scheduler(), ExampleDriver(ExampleScheduler()))
    with pytest.raises(ValueError, match="unknown bug"):
        ExampleScheduler(bugs=["nope"])
    assert set(PLANTED) == set(BUGS)


def refcounts(**counts):
    return lambda block: counts.get(f"b{block}", 0)


@pytest.mark.parametrize("tables, counts, leases, gens, outlive, kind", [
    ({"a": [1]}, {"b1": 1}, {}, {"a": 0}, False, None),
    ({"a": [1]}, {"b1": 0}, {}, {"a": 0}, False, "stale-table"),
    ({"a": [1], "b": [1]}, {"b1": 1}, {}, {"a": 0, "b": 0}, False, "shared-block"),
    ({"a": [1], "b": [1]}, {"b1": 2}, {}, {"a": 0, "b": 0}, False, None),
    ({}, {}, {1: {"a": (0, [2])}}, {"a": 0}, False, "free-in-flight"),   # running, freed
    ({}, {}, {1: {"a": (0, [2])}}, {"a": None}, False, None),   # ended: lease ended with it
    ({}, {}, {1: {"a": (0, [2])}}, {"a": 1}, False, None),      # preempted since
    ({}, {}, {1: {"a": (0, [2])}}, {"a": None}, True, "free-in-flight"),  # deferral promised
    ({}, {"b2": 1}, {1: {"a": (0, [2])}}, {"a": None}, True, None),
])
def test_check_invariants(tables, counts, leases, gens, outlive, kind):
    got = check_invariants(tables, refcounts(**counts), leases, gens.get, outlive)
    assert (got and got[0]) == kind


def test_the_base_driver_says_what_to_write():
    driver = LifecycleDriver(object())
    for call in (lambda: driver.add("r0", 0, 1, 1), driver.schedule, driver.tables,
                 lambda: driver.refcount(0), lambda: driver.generation("r0"), driver.held):
        with pytest.raises(NotImplementedError):
            call()
    assert driver.allocator() is None and driver.reset_prefix_cache() is None


def test_the_command_line(capsys, tmp_path):
    from kvguard.cli import main
    emitted = tmp_path / "test_found.py"
    assert main(["fuzz", "--lifecycle", "example", "--config", "free-in-flight",
                 "--examples", "100", "--emit", str(emitted)]) == 1
    out = capsys.readouterr().out
    assert "free-in-flight" in out and "abort r0" in out
    assert "def test_lifecycle_free_in_flight" in emitted.read_text()
    assert main(["fuzz", "--lifecycle", "example", "--examples", "50"]) == 0
    assert "nothing found" in capsys.readouterr().out
    assert main(["fuzz", "--lifecycle", "example", "--config", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown example configuration" in err[0]
