"""A violation fails the test, and the phase, in which it happened; expected ones do not."""

import pytest

from .conftest import write


def test_raised_violation_fails_its_test_with_the_report(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_clean():
            pool = LinkedFreeList(8)
            pool.free(pool.allocate(3))

        def test_bad():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            pool.free([ids[0], ids[0]])
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "test_suite.py::test_bad - kvguard.errors.DuplicateIdError" in out
    result.stdout.fnmatch_lines([
        ">       pool.free([ids[0], ids[0]])",
        "E       kvguard.errors.DuplicateIdError: ==*==ERROR: kvguard: duplicate-id of block 0 on*",
        "E           #0 test_bad *test_suite.py:10",
        "E       SUMMARY: kvguard: duplicate-id *test_suite.py:10 in test_bad",
    ])
    assert "kvguard/guard/" not in out, "the guard's own frames are hidden from the traceback"
    frames = [line for line in out.splitlines() if line.lstrip("E ").startswith("#")]
    assert frames and not any("_pytest" in f or "pluggy" in f for f in frames), \
        "report stacks end at the test"


def test_a_violation_the_code_swallowed_still_fails_the_test(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def release(pool, ids):
            try:
                pool.free(ids + ids[:1])
            except ValueError:
                pass  # a serving loop that must not die

        def test_swallowed():
            pool = LinkedFreeList(8)
            release(pool, pool.allocate(2))
    """)
    result = suite.runpytest("-p", "kvguard", "-rf")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "kvguard: duplicate-id of block 0 on LinkedFreeList#*",
        "1 violation in the call phase of this test (raised into the code under test, which "
        "caught it)*",
        "==*==ERROR: kvguard: duplicate-id of block 0*",
        "    #0 release *test_suite.py:5",
        "    #1 test_swallowed *test_suite.py:11",
        "SUMMARY: kvguard: duplicate-id *test_suite.py:5 in release",
        "*- kvguard -*",
        "duplicate-id of block 0 on LinkedFreeList#* at *test_suite.py:5 in release",
        "FAILED test_suite.py::test_swallowed - kvguard: duplicate-id of block 0 on *",
    ])


def test_log_mode_fails_the_test_too(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_logged():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            pool.free([ids[0], ids[0]])   # goes through: the allocator is now corrupt
            assert pool.free_blocks == 8
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-mode=log")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*recorded in log mode, the call went through*"])


def test_each_phase_is_judged_on_its_own(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        def double_free(pool):
            ids = pool.allocate(1)
            pool.free(ids)
            try:
                pool.free(ids)
            except ValueError:
                pass

        @pytest.fixture
        def bad_setup():
            double_free(LinkedFreeList(4))

        @pytest.fixture
        def bad_teardown():
            yield
            double_free(LinkedFreeList(4))

        def test_in_setup(bad_setup):
            pass

        def test_in_teardown(bad_teardown):
            pass
    """)
    result = suite.runpytest("-p", "kvguard", "-rA")
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines_random([
        "ERROR test_suite.py::test_in_setup - kvguard: double-free of block 0*",
        "ERROR test_suite.py::test_in_teardown - kvguard: double-free of block 0*",
        "PASSED test_suite.py::test_in_teardown",
        "*1 violation in the setup phase*",
        "*1 violation in the teardown phase*",
    ])


@pytest.mark.parametrize("expectation", [
    "pytest.raises(kvguard.KVGuardError)",
    "pytest.raises(kvguard.DuplicateIdError)",
    "pytest.raises(ValueError)",  # as DeepSpeed's own tests say it
    "pytest.raises(ValueError, match='duplicate-id')",
])
def test_pytest_raises_marks_the_violation_expected(suite, expectation):
    write(suite, f"""
        import pytest
        import kvguard
        from kvguard.examples import LinkedFreeList

        def test_expected():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            with {expectation}:
                pool.free([ids[0], ids[0]])
            pool.free(ids)
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "kvguard: 1 allocator guarded (1 LinkedFreeList), 1 alloc / 1 free calls: no "
        "violations, no leaks (1 expected violation)"])


def test_raises_marks_only_the_exception_it_caught(suite):
    """A violation swallowed inside the raises block is not the one the test expected."""
    write(suite, """
        import pytest
        import kvguard
        from kvguard.examples import LinkedFreeList

        def test_two():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            with pytest.raises(kvguard.KVGuardError):
                try:
                    pool.free([ids[1], ids[1]])
                except ValueError:
                    pass
                pool.free([ids[0], ids[0]])
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kvguard: duplicate-id of block 1 on*",
                                 "*1 violation in the call phase*"])


def test_raises_also_covers_the_causes_and_the_call_siblings(suite):
    write(suite, """
        import unittest
        import pytest
        import kvguard
        from kvguard.examples import LinkedFreeList

        class SchedulerError(RuntimeError):
            pass

        def finish(pool, ids):
            try:
                pool.free(ids)
            except kvguard.KVGuardError as e:
                raise SchedulerError("could not release the sequence") from e

        def test_wrapped():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            with pytest.raises(SchedulerError):
                finish(pool, [ids[0], ids[0]])

        def test_one_call_two_faults():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            with pytest.raises(ValueError):
                pool.free([ids[0], ids[0], 99])   # invalid-id and duplicate-id at once

        def test_group():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            with pytest.RaisesGroup(kvguard.DuplicateIdError):
                try:
                    pool.free([ids[0], ids[0]])
                except kvguard.KVGuardError as e:
                    raise ExceptionGroup("requests failed", [e])

        class TestUnittest(unittest.TestCase):
            def test_assert_raises(self):
                pool = LinkedFreeList(8)
                ids = pool.allocate(2)
                with self.assertRaises(kvguard.DuplicateIdError):
                    pool.free([ids[0], ids[0]])
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=off")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*no violations, no leaks (5 expected violations)"])


def test_violations_outside_any_test_fail_the_run(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        @pytest.fixture(scope="session")
        def engine():
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)
            pool.free(ids)
            try:
                pool.free(ids)      # a double free while the session is set up
            except ValueError:
                pass
            return pool

        def test_uses_engine(engine):
            pass

        def test_also_uses_engine(engine):
            pass
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*= kvguard =*",
        "violations: 1 (double-free 1), 1 outside any test",
        "outside any test: 1 violation(s); they fail the run",
        "during setup of session-scoped fixture 'engine':",
        "==*==ERROR: kvguard: double-free of block 0 on LinkedFreeList#*",
        "    #0 engine *test_suite.py:10",
    ])


def test_collection_time_violations_are_outside_any_test(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        POOL = LinkedFreeList(8)
        try:
            POOL.free([0])           # never handed out: foreign-id at import time
        except ValueError:
            pass

        def test_fine():
            pass
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["during collection of test_suite.py:",
                                 "*ERROR: kvguard: foreign-id of block 0*"])


def test_marker_off_leaves_a_test_alone(suite):
    write(suite, """
        import pytest
        import kvguard
        from kvguard.examples import LinkedFreeList

        @pytest.mark.kvguard(off=True)
        def test_unguarded():
            pool = LinkedFreeList(8)
            assert kvguard.guard_of(pool) is None
            pool.allocate(2)

        def test_guarded_again():
            assert kvguard.guard_of(LinkedFreeList(8)) is not None
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail")
    result.assert_outcomes(passed=2)


def test_violations_in_a_guarded_but_off_test_are_not_held_against_it(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        POOL = None

        def test_make():
            global POOL
            POOL = LinkedFreeList(8)

        @pytest.mark.kvguard(off=True)
        def test_misuse_while_off():
            ids = POOL.allocate(2)
            try:
                POOL.free([ids[0], ids[0]])
            except ValueError:
                pass
    """)
    result = suite.runpytest("-p", "kvguard", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("marker, message", [
    ("kvguard('fail')", "takes keywords only"),
    ("kvguard(leak='fail')", "unknown keyword(s) leak"),
    ("kvguard(leaks='always')", "leaks='always': choose one of 'off', 'summary', 'warn', 'fail'"),
    ("kvguard(off='yes')", "off='yes': use off=True or off=False"),
])
def test_a_malformed_marker_errors_its_test_with_one_line(suite, marker, message):
    write(suite, f"""
        import pytest

        @pytest.mark.{marker}
        def test_marked():
            pass
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.kvguard on test_suite.py::test_marked: "
                                 f"{message}*"])


def test_an_xfail_test_whose_violation_escapes_stays_xfailed(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        @pytest.mark.xfail(reason="known double free", strict=True)
        def test_known_bug():
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)
            pool.free(ids)
            pool.free(ids)
    """)
    suite.runpytest("-p", "kvguard").assert_outcomes(xfailed=1)


def test_a_violation_in_another_thread_belongs_to_the_running_test(suite):
    write(suite, """
        import threading
        from kvguard.examples import LinkedFreeList

        def test_engine_thread():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)

            def step():
                try:
                    pool.free(ids + ids)
                except ValueError:
                    pass

            worker = threading.Thread(target=step, name="engine-loop")
            worker.start()
            worker.join()

        def test_after():
            pass
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=off", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*free() was called here (thread 'engine-loop'):",
                                 "FAILED test_suite.py::test_engine_thread - kvguard: *"])


def test_a_broken_report_never_crashes_the_session(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList
        from kvguard.violation import Violation

        def test_patched(monkeypatch):
            def broken(self):
                raise RuntimeError("render is broken")
            monkeypatch.setattr(Violation, "render", broken)
            monkeypatch.setattr(Violation, "to_dict", broken)
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)
            try:
                pool.free(ids + ids)
            except ValueError:
                pass
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=off")
    result.assert_outcomes(failed=1)
    assert "INTERNALERROR" not in result.stdout.str()


def test_wide_fixture_teardown_is_outside_any_test(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        @pytest.fixture(scope="module")
        def engine():
            pool = LinkedFreeList(8)
            ids = pool.allocate(2)
            yield pool
            pool.free(ids)
            try:
                pool.free(ids[:1])       # shutting down twice
            except ValueError:
                pass

        def test_one(engine):
            pass

        def test_two(engine):
            pass
    """)
    result = suite.runpytest("-p", "kvguard", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["during teardown of module-scoped fixture 'engine':",
                                 "*ERROR: kvguard: double-free of block 0*"])


def test_an_uncaught_call_with_several_faults_is_not_said_to_be_caught(suite):
    """One call, three faults (a bool, a repeated id, an id never handed out): the first is
    raised and fails the test, the other two are recorded beside it. Nothing caught anything,
    so the failure must not say the code under test caught it; their reports are shown."""
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_uncaught():
            pool = LinkedFreeList(8)
            pool.allocate(3)
            pool.free([0, 0, 7, True])
    """)
    result = suite.runpytest("-p", "kvguard", "-rf")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "kvguard.errors.BoolIdError" in out
    assert "which caught it" not in out
    result.stdout.fnmatch_lines([
        "*3 violations in the call phase of this test (2 raised with the one above, by the same "
        "call)*",
        "==*==ERROR: kvguard: duplicate-id of block 0*",
        "==*==ERROR: kvguard: foreign-id of block 7*",
    ])


def test_a_swallowed_call_with_several_faults_is_said_to_be_caught(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_swallowed():
            pool = LinkedFreeList(8)
            pool.allocate(3)
            try:
                pool.free([0, 0, 7])
            except ValueError:
                pass
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["2 violations in the call phase of this test (raised into the "
                                 "code under test, which caught it)*"])
