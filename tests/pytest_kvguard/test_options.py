"""Options, their ini twins, and ini kvguard_allocators."""

import pytest

from kvguard import registry
from pytest_kvguard.options import parse_allocator_line

from .conftest import SWALLOWED, write


def test_ini_twins_set_the_defaults_and_options_override_them(suite):
    suite.makeini("""
        [pytest]
        kvguard = true
        kvguard_mode = log
        kvguard_stacks = off
        kvguard_leaks = fail
    """)
    write(suite, SWALLOWED)
    result = suite.runpytest()
    result.stdout.fnmatch_lines(["kvguard: on (mode=log, stacks=off, leaks=fail)*"])
    result = suite.runpytest("--kvguard-mode=raise", "--kvguard-stacks=full",
                             "--kvguard-leaks=off")
    result.stdout.fnmatch_lines(["kvguard: on (mode=raise, stacks=full, leaks=off)*"])
    result.assert_outcomes(failed=1)


def test_stacks_off_keeps_no_allocation_stacks(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList

        def test_double():
            pool = LinkedFreeList(8)
            ids = pool.allocate(1)
            pool.free(ids)
            pool.free(ids)
    """)
    result = suite.runpytest("-p", "kvguard", "--kvguard-stacks=off")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "ERROR: kvguard: double-free of block 0" in out
    assert "was last allocated here" not in out and "was freed here" not in out


@pytest.mark.parametrize("ini, message", [
    ("kvguard_mode = loud", "ini kvguard_mode = 'loud': choose one of raise, log"),
    ("kvguard_stacks = deep", "ini kvguard_stacks = 'deep': choose one of off, cheap, full"),
    ("kvguard_leaks = maybe", "ini kvguard_leaks = 'maybe': choose one of off, summary, warn, fail"),
    ("kvguard_allocators = Pool size=n", "'Pool' is not a dotted class name"),
    ("kvguard_allocators = pool:Pool sized=n", "unknown keyword 'sized'"),
    ("kvguard_allocators = pool:Pool refcounted=maybe", "refcounted takes true or false"),
    ("kvguard_allocators = pool:Pool skip=f", "skip takes a callable"),
    ("kvguard_allocators = pool:Pool size", "cannot read 'size': expected keyword=value"),
    ("kvguard_allocators = pool:Pool refcount_attr=ref_cnt", "needs id_attr and refcounted"),
])
def test_a_bad_ini_setting_stops_the_run_with_one_line(suite, ini, message):
    suite.makeini(f"[pytest]\nkvguard = true\n{ini}\n")
    write(suite, SWALLOWED)
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{message}*"])


def test_a_bad_choice_on_the_command_line_is_a_usage_error(suite):
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*argument --kvguard-leaks: invalid choice: 'sometimes'*"])


def test_report_folder_must_exist(suite):
    result = suite.runpytest("-p", "kvguard", "--kvguard-report=nowhere/r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvguard-report *nowhere/r.json: folder *nowhere does not "
                                 "exist*"])


def test_ini_allocators_guard_classes_from_construction(pytester):
    pytester.makepyfile(kvg_ini_pool="""
        class Pool:
            def __init__(self, n):
                self.n = n
                self.free_ids = list(range(n))

            def get_blocks(self, k):
                out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
                return out

            def put_blocks(self, pool_index, ids):
                self.free_ids.extend(ids)
    """)
    pytester.makeini("""
        [pytest]
        kvguard_allocators =
            # a comment line
            kvg_ini_pool:Pool alloc=get_blocks free=put_blocks free_arg=1 size=n
    """)
    write(pytester, """
        import kvguard
        from kvg_ini_pool import Pool

        def test_guarded():
            pool = Pool(4)
            g = kvguard.guard_of(pool)
            assert g is not None and g.spec.free_arg == 1 and g.spec.size == "n"
            ids = pool.get_blocks(2)
            pool.put_blocks(0, ids + ids[:1])
    """)
    result = pytester.runpytest("-p", "kvguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ERROR: kvguard: duplicate-id of block 0 on Pool#*"])
    assert "kvg_ini_pool.Pool" not in registry.registered(), "unregistered at the end"


def test_parse_allocator_line_builds_the_spec_without_importing():
    name, spec = parse_allocator_line(
        "engine.never_imported:Outer.Pool alloc=get free=put free_arg=blocks pool_arg=0 "
        "share=touch id_attr=block_id refcounted=yes tensor_ok=false iterator_ok=1 "
        "size=num_blocks free_count=none live_ids=live refcount_attr=ref_cnt")
    assert name == "engine.never_imported.Outer.Pool"
    assert (spec.alloc, spec.free, spec.free_arg, spec.pool_arg, spec.share) == (
        "get", "put", "blocks", 0, "touch")
    assert (spec.id_attr, spec.refcounted, spec.tensor_ok, spec.iterator_ok) == (
        "block_id", True, False, True)
    assert (spec.size, spec.free_count, spec.live_ids) == ("num_blocks", None, "live")
    assert spec.refcount_attr == "ref_cnt"
    import sys
    assert "engine" not in sys.modules


def test_builtin_engine_specs_are_registered_when_on(suite):
    write(suite, """
        import kvguard

        def test_builtins():
            names = kvguard.registered()
            assert "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator" in names
            assert kvguard.instrumented()
    """)
    suite.runpytest("-p", "kvguard").assert_outcomes(passed=1)
