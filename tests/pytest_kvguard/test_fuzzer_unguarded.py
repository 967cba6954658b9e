"""``check_allocator`` and the tests it emits under ``pytest -p kvguard``: they test the
allocator, not the guard, so the plugin leaves them unguarded without being told."""

import importlib

from .conftest import write

# Loaded here, before any pytester run: a run drops the modules it imported, and the fuzzer's
# modules imported lazily in one run must be the ones the next check uses.
for _name in ("kvguard.testing", "kvguard.conformance.findings", "kvguard.conformance.harm",
              "kvguard.conformance.regression", "kvguard.conformance.report"):
    importlib.import_module(_name)


def test_check_allocator_in_a_guarded_suite_judges_the_allocator_not_the_guard(suite):
    write(suite, """
    import pytest
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
    from kvguard.testing import ConformanceError, check_allocator

    def test_conforms():
        with pytest.raises(ConformanceError) as info:
            check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC, examples=20,
                            budget=600, clauses=["duplicate-id", "double-free"])
        assert info.value.report.broken == {"duplicate-id"}, info.value.report.render()

    def test_guarded_still():
        pool = LinkedFreeList(4)
        ids = pool.allocate(1)
        with pytest.raises(ValueError):
            pool.free([ids[0], ids[0]])
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=2)


def test_an_emitted_test_fails_under_the_plugin_on_the_allocator_it_was_written_for(suite):
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
    from kvguard.testing import check_allocator

    report = check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC, examples=20,
                             budget=600, clauses=["duplicate-id"], raise_on_broken=False)
    (finding,) = report.findings
    write(suite, finding.test, name="test_emitted")
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(failed=1)
    assert "DuplicateIdError" not in result.stdout.str()  # the allocator failed it
