"""Blocks a test handed out and never freed: warned by default, failed or ignored on request."""

import pytest

from .conftest import write

LEAKY = """
    import gc
    import pytest
    from kvguard.examples import LinkedFreeList

    def test_leaky():
        pool = LinkedFreeList(8)
        pool.allocate(3)

    def test_tidy():
        pool = LinkedFreeList(8)
        pool.free(pool.allocate(3))
"""


def test_leaks_warn_per_test_on_request(suite):
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=warn")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines([
        "test_suite.py::test_leaky",
        "*KVGuardLeakWarning: kvguard: this test never freed 3 block(s) of LinkedFreeList#*, "
        "handed out at *test_suite.py:7 in test_leaky*",
        "*= kvguard =*",
        "leaks (warn): 3 block(s) in 1 test(s) still live after teardown",
        "  test_suite.py::test_leaky: 3 block(s) of LinkedFreeList#* handed out at "
        "*test_suite.py:7 in test_leaky",
    ])
    assert result.ret == pytest.ExitCode.OK


def test_leaks_fail_the_teardown_on_request(suite):
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail", "-rA")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaky*",
        "kvguard: leak of blocks [[]0, 1, 2] on LinkedFreeList#*",
        "This test leaked 3 block(s), and leaks fail tests in this run.",
        "==*==ERROR: kvguard: leak of blocks [[]0, 1, 2] on LinkedFreeList#*",
        "3 block(s) handed out during test_suite.py::test_leaky are still live after its "
        "teardown*",
        "allocate() was called here*",
        "    #0 test_leaky *test_suite.py:7",
        "        pool.allocate(3)",
        "SUMMARY: kvguard: leak *test_suite.py:7 in test_leaky",
    ])


def test_leak_warnings_made_errors_fail_the_teardown(suite):
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=warn", "-W",
                             "error::pytest_kvguard.manager.KVGuardLeakWarning")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaky*",
                                 "SUMMARY: kvguard: leak *test_suite.py:7 in test_leaky"])


def test_leaks_off_says_nothing(suite):
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=off")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["kvguard: 2 allocators guarded*: no violations, no leaks"])


def test_markers_set_the_leak_mode_per_test_closest_wins(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        pytestmark = pytest.mark.kvguard(leaks="fail")

        def test_module_says_fail():
            LinkedFreeList(8).allocate(1)

        @pytest.mark.kvguard(leaks="off")
        def test_off():
            LinkedFreeList(8).allocate(1)

        @pytest.mark.kvguard(leaks="warn")
        def test_warn():
            LinkedFreeList(8).allocate(1)
    """)
    result = suite.runpytest("-p", "kvguard", "-rA")
    result.assert_outcomes(passed=3, errors=1, warnings=1)
    result.stdout.fnmatch_lines_random([
        "ERROR test_suite.py::test_module_says_fail - kvguard: leak of block 0*",
        "*KVGuardLeakWarning: kvguard: this test never freed 1 block(s)*",
    ])


def test_only_the_test_that_took_the_blocks_is_blamed(suite):
    """A session allocator outlives the tests: each leak lands on the test that made it, and
    blocks of wider fixtures belong to no test."""
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        @pytest.fixture(scope="session")
        def pool():
            pool = LinkedFreeList(16)
            pool.allocate(2)             # the session's own, never freed
            return pool

        @pytest.fixture
        def sequence(pool):
            ids = pool.allocate(1)
            yield ids
            pool.free(ids)               # freed at teardown: no leak

        def test_a(pool, sequence):
            pool.allocate(1)

        def test_b(pool, sequence):
            pool.free(pool.allocate(2))

        def test_c(pool):
            pool.allocate(3)
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail", "-p", "no:randomly",
                             "-rA")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines_random([
        "ERROR test_suite.py::test_a - kvguard: leak of block ? on LinkedFreeList#*",
        "ERROR test_suite.py::test_c - kvguard: leak of blocks *",
        "PASSED test_suite.py::test_b",
    ])


def test_a_dropped_allocator_still_leaks_and_still_dies(suite):
    """Judged the same whether or not the collector took the allocator before teardown, and
    the plugin never keeps it alive."""
    write(suite, """
        import gc
        import weakref
        from kvguard.examples import LinkedFreeList

        def test_collected_before_teardown():
            pool = LinkedFreeList(8)
            pool.allocate(2)
            ref = weakref.ref(pool)
            del pool
            gc.collect()
            assert ref() is None

        def test_alive_at_teardown():
            pool = LinkedFreeList(8)
            pool.allocate(2)
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail")
    result.assert_outcomes(passed=2, errors=2)


def test_a_failed_test_is_not_also_blamed_for_leaks(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_fails_midway():
            pool = LinkedFreeList(8)
            pool.allocate(2)
            assert False, "the real problem"
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail")
    result.assert_outcomes(failed=1)
    assert "leak of" not in result.stdout.str()


def test_refcounted_pools_leak_until_the_last_reference_goes(suite):
    write(suite, """
        from kvguard.examples import RefcountedPool

        def test_shared_then_half_freed():
            pool = RefcountedPool(8)
            ids = pool.allocate(2)
            pool.share(ids[:1])
            pool.free(ids)               # block ids[0] still has one reference
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["kvguard: leak of block 0 on RefcountedPool#*"])


def test_assert_no_leaks_checks_the_test_body_only(suite):
    write(suite, """
        import pytest
        import kvguard as kvg
        from kvguard.examples import LinkedFreeList

        @pytest.fixture
        def pool():
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)        # the fixture's: not the body's business
            yield pool
            pool.free(ids)

        def test_clean_body(pool, kvguard):
            pool.free(pool.allocate(2))
            kvguard.assert_no_leaks()

        def test_leaky_body(pool, kvguard):
            pool.allocate(2)
            kvguard.assert_no_leaks()

        def test_expected_leak(pool, kvguard):
            pool.allocate(2)
            with pytest.raises(kvg.LeakError):
                kvguard.assert_no_leaks()
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=off")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "E       kvguard.errors.LeakError: ==*==ERROR: kvguard: leak of blocks [[]1, 2] on *",
        "E       2 block(s) handed out during test_suite.py::test_leaky_body are still live now*",
    ])


def test_a_full_site_table_is_said_not_hidden(suite, monkeypatch):
    """Past its bound the site table keeps owners but no new stacks: leaks are still told, and
    the summary says that stacks went missing."""
    from kvguard.stacks import SITES

    monkeypatch.setattr(SITES, "capacity", 1)
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail",
                             "--kvguard-report=report.json")
    result.assert_outcomes(passed=2, errors=1)  # test_leaky's teardown still fails on its leak
    result.stdout.fnmatch_lines(["kvguard: the call-site table filled up during the run*"])
    assert '"site_table_full": true' in (suite.path / "report.json").read_text()


# --- the default: --kvguard-leaks=summary ---------------------------------------------------

OUTLIVING = """
    import gc
    import pytest
    from kvguard.examples import LinkedFreeList

    KEPT = LinkedFreeList(8)                   # a module global: outlives every test
    AT_IMPORT = KEPT.allocate(1)               # the session's own, never freed

    @pytest.fixture(scope="module")
    def module_pool():
        return LinkedFreeList(8)               # outlives test_module_leak, dies after the module

    def test_dies_with_its_pool():
        LinkedFreeList(8).allocate(3)          # the pool goes with the test: nothing to say

    def test_kept_leak():
        KEPT.allocate(2)

    def test_kept_but_freed_later():
        TAKEN.extend(KEPT.allocate(1))

    def test_frees_it_again():
        KEPT.free(TAKEN)

    def test_module_leak(module_pool):
        module_pool.allocate(2)

    def test_a_full_collection_while_the_module_pool_lives(module_pool):
        gc.collect()

    TAKEN = []
"""


def test_summary_reports_only_allocators_that_outlive_the_test_once_at_the_end(suite):
    write(suite, OUTLIVING)
    result = suite.runpytest("-p", "kvguard", "-p", "no:randomly", "-rA",
                             "--kvguard-report=report.json")
    result.assert_outcomes(passed=6)
    assert result.ret == pytest.ExitCode.OK and "KVGuardLeakWarning" not in result.stdout.str()
    result.stdout.fnmatch_lines([
        "*= kvguard =*",
        "leaks (summary): 5 block(s) still live at the end of the run, on allocators that "
        "outlived the test that took them (or the session's own)",
    ])
    result.stdout.fnmatch_lines_random([
        "  test_suite.py::test_kept_leak: 2 block(s) of LinkedFreeList#* handed out at "
        "*test_suite.py:16 in test_kept_leak",
        "  test_suite.py::test_module_leak: 2 block(s) of LinkedFreeList#* handed out at "
        "*test_suite.py:25 in test_module_leak",
        "  outside any test: 1 block(s) of LinkedFreeList#* handed out at *test_suite.py:6*",
    ])
    out = result.stdout.str()
    assert "test_dies_with_its_pool:" not in out and "test_kept_but_freed_later:" not in out
    import json
    data = json.loads((suite.path / "report.json").read_text())
    assert {(v["nodeid"], len(v["block_ids"]), v["mode"]) for v in data["leaks"]} == {
        ("test_suite.py::test_kept_leak", 2, "summary"),
        ("test_suite.py::test_module_leak", 2, "summary"),
        ("outside any test", 1, "summary")}
    assert data["summary"]["leaked_blocks"] == 5 and data["summary"]["tests_with_leaks"] == 2


def test_summary_says_nothing_when_every_leaking_pool_died_with_its_test(suite):
    write(suite, LEAKY)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["kvguard: 2 allocators guarded*: no violations, no leaks"])


def test_summary_under_xdist_sums_up_on_the_controller(suite):
    pytest.importorskip("xdist")
    write(suite, OUTLIVING.replace("def test_frees_it_again", "def test_frees_it_again_0")
          .replace("KEPT.free(TAKEN)", "pass"))
    result = suite.runpytest("-p", "kvguard", "-n", "2", "-p", "no:randomly",
                             "--dist=loadfile")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines([
        "leaks (summary): 6 block(s) still live at the end of the run, on allocators*"])


def test_fail_and_the_marker_stay_strict_per_test(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        @pytest.mark.kvguard(leaks="fail")
        def test_strict():
            LinkedFreeList(8).allocate(1)      # dies with the test, and still fails it

        def test_default():
            LinkedFreeList(8).allocate(1)
    """)
    result = suite.runpytest("-p", "kvguard", "-rA")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["ERROR test_suite.py::test_strict - kvguard: leak of block 0*"])
    assert "test_default:" not in result.stdout.str()


THREADED = """
    import threading
    from kvguard.examples import LinkedFreeList

    def run_engine(pool, done):
        pool.allocate(2)             # the engine's own generation thread leaks
        done.set()

    def test_engine_thread_leaks():
        pool = LinkedFreeList(8)
        done = threading.Event()
        threading.Thread(target=run_engine, args=(pool, done), daemon=True).start()
        assert done.wait(10)

    def test_engine_thread_tidy():
        pool = LinkedFreeList(8)
        t = threading.Thread(target=lambda: pool.free(pool.allocate(2)))
        t.start()
        t.join()
"""


def test_a_leak_in_a_thread_the_test_started_fails_that_test(suite):
    # The test's label follows the threads it starts (as an asyncio task's context does):
    # without it, a leak in an engine's own thread belonged to no test and passed.
    write(suite, THREADED)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=fail", "-rA")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_engine_thread_leaks*",
                                 "SUMMARY: kvguard: leak *test_suite.py:5 in run_engine"])
