"""One spec language in every place a user writes one: the ini option (its own spelling and the
canonical one, one per line or a TOML list) and ``[tool.kvguard] allocators`` in pyproject.toml
(a list of entries or a table per class) all give the same guard."""

import pytest

from .conftest import write

POOL = """
    class Pool:
        def __init__(self, n):
            self.n = n
            self.free_ids = list(range(n))

        def get_blocks(self, k):
            out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
            return out

        def put_blocks(self, pool_index, ids):
            self.free_ids.extend(ids)
"""

TEST = """
    import kvguard
    from kvg_lang_pool import Pool

    def test_guarded():
        pool = Pool(4)
        g = kvguard.guard_of(pool)
        assert g is not None and g.spec.free == "put_blocks" and g.spec.size == "n"
        ids = pool.get_blocks(2)
        pool.put_blocks(0, ids + ids[:1])
"""

CONFIGS = {
    "ini, its own spelling": ("ini", """
        [pytest]
        kvguard_allocators =
            kvg_lang_pool:Pool alloc=get_blocks free=put_blocks free_arg=1 size=n
    """),
    "ini, the canonical spelling": ("ini", """
        [pytest]
        kvguard_allocators =
            kvg_lang_pool.Pool(alloc=get_blocks, free=put_blocks(ids), size=n)
    """),
    "pytest's TOML list": ("pyproject", """
        [tool.pytest.ini_options]
        kvguard_allocators = ["kvg_lang_pool.Pool(alloc=get_blocks, free=put_blocks, free_arg=1, size=n)"]
    """),
    "[tool.kvguard] list": ("pyproject", """
        [tool.kvguard]
        allocators = ["kvg_lang_pool:Pool alloc=get_blocks free=put_blocks(ids) size=n"]
    """),
    "[tool.kvguard] table": ("pyproject", """
        [tool.kvguard.allocators."kvg_lang_pool.Pool"]
        alloc = "get_blocks"
        free = "put_blocks(ids)"
        size = "n"
    """),
}


@pytest.mark.parametrize("where", list(CONFIGS))
def test_every_spelling_guards_the_class_the_same_way(pytester, where):
    kind, text = CONFIGS[where]
    pytester.makepyfile(kvg_lang_pool=POOL)
    if kind == "ini":
        pytester.makeini(text)
    else:
        pytester.makefile(".toml", pyproject=text)
    write(pytester, TEST)
    result = pytester.runpytest("-p", "kvguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ERROR: kvguard: duplicate-id of block 0 on Pool#*"])


def test_a_mistake_in_tool_kvguard_stops_the_run_with_one_line(pytester):
    pytester.makefile(".toml", pyproject="""
        [tool.kvguard]
        allocators = ["kvg_lang_pool.Pool(sized=n)"]
    """)
    write(pytester, "def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "kvguard")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *tool.kvguard*allocators*unknown keyword 'sized'*"])


FIT_POOL = """
    class Pool:
        def __init__(self, n=4):
            self.free_ids = list(range(n))

        def get_blocks(self, k):
            out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
            return out

        def put_blocks(self, ids):
            self.free_ids.extend(ids)
"""


def test_an_entry_that_fits_nothing_of_its_class_stops_the_run_with_one_line(pytester):
    """No keywords, and the class has no allocate()/free(): a usage error once collection has
    imported the class, not a TypeError in every test under a clean summary."""
    pytester.makepyfile(kvg_fit_pool=FIT_POOL)
    pytester.makeini("""
        [pytest]
        kvguard_allocators =
            kvg_fit_pool:Pool
    """)
    write(pytester, """
        from kvg_fit_pool import Pool

        def test_one():
            Pool().get_blocks(1)

        def test_two():
            Pool().get_blocks(2)
    """)
    result = pytester.runpytest("-p", "kvguard")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: kvguard_allocators: kvg_fit_pool.Pool has no method "
                                 "'allocate' (AllocatorSpec alloc='allocate', the default)*"
                                 "get_blocks, put_blocks*kvguard spec suggest*"])
    assert "TypeError" not in result.stdout.str() + result.stderr.str()


def test_a_class_that_fits_nothing_imported_inside_a_test_fails_the_run_in_the_summary(
        pytester):
    pytester.makepyfile(kvg_fit_pool=FIT_POOL)
    pytester.makeini("""
        [pytest]
        kvguard_allocators =
            kvg_fit_pool.Pool(alloc=get_blocks, free=release)
    """)
    write(pytester, """
        def test_one():
            from kvg_fit_pool import Pool
            pool = Pool()
            pool.put_blocks(pool.get_blocks(1))
    """)
    result = pytester.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["kvguard: configuration error: kvg_fit_pool.Pool has no "
                                 "method 'release' (AllocatorSpec free='release')*unguarded*"])
    assert "no violations" not in result.stdout.str()


SEQ_MANAGER = """
    class Seq:
        def __init__(self, n, prefix=None, shared=0):
            self.n, self.prefix, self.shared, self.block_table = n, prefix, shared, []


    class Manager:
        def __init__(self, n):
            self.n, self.ref_counts, self.free_ids = n, [0] * n, list(range(n))

        def allocate(self, seq):
            if seq.prefix is not None:
                for b in seq.prefix.block_table[:seq.shared]:
                    self.ref_counts[b] += 1
                    seq.block_table.append(b)
            while len(seq.block_table) < seq.n:
                b = self.free_ids.pop(0)
                self.ref_counts[b] = 1
                seq.block_table.append(b)

        def deallocate(self, seq):
            for b in seq.block_table:
                self.ref_counts[b] -= 1
                if self.ref_counts[b] == 0:
                    self.free_ids.append(b)
            seq.block_table = []
"""


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_a_shape_in_the_spec_language_under_the_plugin(pytester, mode):
    """Ids carried in the sequence and an allocation that also shares, from the ini line: the
    correct workload passes, the planted double free fails its test with the report."""
    pytester.makepyfile(kvg_seq_manager=SEQ_MANAGER)
    pytester.makeini("""
        [pytest]
        kvguard_allocators =
            kvg_seq_manager.Manager(alloc=allocate(seq.block_table), free=deallocate(seq.block_table), refcounted=true, alloc_shares=true, refcounts=ref_counts, size=n)
    """)
    write(pytester, """
        from kvg_seq_manager import Manager, Seq

        def test_correct():
            m = Manager(8)
            a = Seq(3)
            m.allocate(a)
            b = Seq(4, prefix=a, shared=2)
            m.allocate(b)
            m.deallocate(a)
            m.deallocate(b)

        def test_double_free():
            m = Manager(8)
            d = Seq(2)
            m.allocate(d)
            table = list(d.block_table)
            m.deallocate(d)
            d.block_table = table
            try:
                m.deallocate(d)
            except Exception:
                pass
    """)
    result = pytester.runpytest("-p", "kvguard", "--kvguard-mode", mode)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*ERROR: kvguard: double-free of blocks [[]0, 1] on Manager#*"])
