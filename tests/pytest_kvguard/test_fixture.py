"""The kvguard fixture: guard(), violations, expect(kind), assert_no_leaks()."""

import pytest

from .conftest import write

PLAIN_POOL = """
    class Pool:
        \"\"\"An allocator no registered spec covers.\"\"\"

        def __init__(self, n):
            self.n = n
            self.free_ids = list(range(n))

        def allocate(self, k):
            out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
            return out

        def release(self, ids):
            self.free_ids.extend(ids)
"""


def test_guard_covers_an_unregistered_allocator_for_the_test(suite):
    write(suite, PLAIN_POOL + """
    import pytest
    import kvguard as kvg

    SPEC = kvg.AllocatorSpec(free="release", size="n")
    KEPT = Pool(4)

    def test_guarded(kvguard):
        g = kvguard.guard(KEPT, SPEC)
        assert g.mode == "raise" and g.stacks == "cheap"
        ids = KEPT.allocate(2)
        with pytest.raises(kvg.DuplicateIdError):
            KEPT.release([ids[0], ids[0]])
        KEPT.release(ids)
        assert [v.kind for v in kvguard.violations] == ["duplicate-id"]
        assert kvguard.violations[0].expected

    def test_unguarded_after_the_test():
        assert kvg.guard_of(KEPT) is None
    """)
    result = suite.runpytest("-p", "kvguard", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_guard_uses_the_run_mode(suite):
    write(suite, PLAIN_POOL + """
    import kvguard as kvg

    def test_logged(kvguard):
        pool = Pool(4)
        kvguard.guard(pool, kvg.AllocatorSpec(free="release", size="n"))
        assert kvguard.mode == "log"
        ids = pool.allocate(1)
        pool.release(ids + ids)           # recorded, not raised: still fails the test
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-mode=log")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["kvguard: duplicate-id of block 0 on Pool#*"])


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_expect_as_a_block_reads_the_same_in_both_modes(suite, mode):
    write(suite, """
        import kvguard as kvg
        from kvguard.examples import RefcountedPool

        def test_block(kvguard):
            pool = RefcountedPool(8)      # trusts its caller: raises nothing itself
            ids = pool.allocate(2)
            with kvguard.expect("duplicate-id"):
                pool.free([ids[1], ids[1]])
            with kvguard.expect(kvg.DoubleFreeError):
                pool.free(ids[:1])
                pool.free(ids[:1])
            assert [v.expected for v in kvguard.violations] == [True, True]
    """)
    result = suite.runpytest("-p", "kvguard", f"--kvguard-mode={mode}", "--kvguard-leaks=off")
    result.assert_outcomes(passed=1)


def test_expect_for_the_whole_test(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def misuse():
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)
            pool.free(ids)
            try:
                pool.free(ids)
            except ValueError:
                pass

        def test_met(kvguard):
            kvguard.expect("double-free")
            misuse()

        def test_unmet(kvguard):
            kvguard.expect("double-free")

        def test_other_kind_still_fails(kvguard):
            kvguard.expect("duplicate-id")
            misuse()
    """)
    result = suite.runpytest("-p", "kvguard", "-rA")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines_random([
        "PASSED test_suite.py::test_met",
        "FAILED test_suite.py::test_unmet - kvguard.expect('double-free')*",
        "FAILED test_suite.py::test_other_kind_still_fails - kvguard: double-free*",
        "kvguard.expect('double-free'): no double-free violation happened in this test",
        "kvguard.expect('duplicate-id'): no duplicate-id violation happened in this test",
    ])


def test_expect_block_that_sees_nothing_fails_and_other_errors_pass_through(suite):
    write(suite, """
        import pytest
        from kvguard.examples import LinkedFreeList

        def test_nothing_happened(kvguard):
            with kvguard.expect("double-free"):
                pass

        def test_unrelated_error(kvguard):
            with pytest.raises(KeyError):
                with kvguard.expect("double-free"):
                    raise KeyError("not ours")

        def test_bad_kind(kvguard):
            with pytest.raises(ValueError, match="takes a violation kind"):
                kvguard.expect("use-after-free")
    """)
    result = suite.runpytest("-p", "kvguard", "-rA")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "E       AssertionError: kvguard.expect('double-free'): no double-free violation "
        "happened in this block"])


def test_the_fixture_needs_the_plugin_on(suite):
    write(suite, """
        def test_wants_it(kvguard):
            pass
    """)
    result = suite.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the kvguard fixture needs the plugin switched on: run "
                                 "pytest -p kvguard*"])
