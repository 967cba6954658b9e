"""Stepping aside: inside a context that expects an exception kvguard's error is not, in code
that does not know kvguard (an engine's own suite), the misuse is recorded as expected and the
call reaches the allocator, so the engine's own defence is what the test sees.

The suites here mirror SGLang's ``test/registered/unit/mem_cache/test_allocator_cpu.py``
(``TestPagedAllocatorDebugModeCPU``, newer than the 0.5.23 wheel), on the real paged allocator
of the wheel loaded as ``tests/kvguard/adapters`` loads it; they import nothing of kvguard.
"""

import pytest
import torch  # noqa: F401  (loaded once here: a pytester run drops what it imported, and torch
#                          cannot be imported twice in one process)

from tests.kvguard.adapters import engines

from .conftest import write

LOADER = """
    import os
    import unittest
    from unittest.mock import MagicMock, patch

    import pytest
    import torch

    from tests.kvguard.adapters import engines

    def setUpModule():
        global loaded, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        loaded = engines.loaded("sglang")
        sg = loaded.__enter__()
        PagedTokenToKVPoolAllocator = sg.PagedTokenToKVPoolAllocator
        TokenToKVPoolAllocator = sg.TokenToKVPoolAllocator

    def tearDownModule():
        loaded.__exit__(None, None, None)
"""

DEBUG_MODE_SUITE = LOADER + """
    class TestPagedAllocatorDebugModeCPU(unittest.TestCase):
        def _debug_alloc(self, size=64, page_size=4, device="cpu"):
            return PagedTokenToKVPoolAllocator(size=size, page_size=page_size,
                                               dtype=torch.int64, device=device,
                                               kvcache=MagicMock(), need_sort=False)

        @patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
        def test_free_duplicate_pages_raises(self):
            a = self._debug_alloc()
            out = a.alloc(4)
            a.free(out)
            with self.assertRaises(AssertionError):
                a.free(out)

        @patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
        def test_callable_form(self):
            a = self._debug_alloc()
            out = a.alloc(4)
            a.free(out)
            self.assertRaises(AssertionError, a.free, out)

        @patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
        def test_regex_form(self):
            a = self._debug_alloc()
            out = a.alloc(4)
            a.free(out)
            with self.assertRaisesRegex(AssertionError, ""):
                a.free(out)

    @patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
    def test_pytest_raises_forms():
        for form in ("with", "callable"):
            a = PagedTokenToKVPoolAllocator(size=64, page_size=4, dtype=torch.int64,
                                            device="cpu", kvcache=MagicMock(), need_sort=False)
            out = a.alloc(4)
            a.free(out)
            if form == "with":
                with pytest.raises(AssertionError):
                    a.free(out)
            else:
                pytest.raises(AssertionError, a.free, out)
"""


@pytest.fixture(autouse=True)
def _sglang_downloaded():
    engines.archive("sglang")  # skips, saying what to run, without the download


def test_the_engines_own_debug_check_is_what_the_test_sees(suite):
    write(suite, DEBUG_MODE_SUITE)
    result = suite.runpytest("-p", "kvguard", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([
        "kvguard: * no violations, no leaks (5 expected violations)"])


def test_unguarded_the_suite_passes_too(suite):
    write(suite, DEBUG_MODE_SUITE)
    suite.runpytest().assert_outcomes(passed=4)


def test_a_misuse_the_engine_does_not_catch_still_fails_the_test(suite):
    """The token allocator has no defence: the double free goes through, the test's
    ``assertRaises`` finds nothing raised, and kvguard's report says what happened."""
    write(suite, LOADER + """
    class TestTokenAllocator(unittest.TestCase):
        def test_double_free_raises(self):
            a = TokenToKVPoolAllocator(size=16, dtype=torch.int64, device="cpu",
                                       kvcache=MagicMock(), need_sort=False)
            out = a.alloc(4)
            a.free(out)
            with self.assertRaises(AssertionError):
                a.free(out)
    """)
    result = suite.runpytest("-p", "kvguard", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*AssertionError: AssertionError not raised*",
        "*kvguard: double-free of blocks * on TokenToKVPoolAllocator#*",
    ])


def test_a_misuse_outside_the_expecting_block_still_fails(suite):
    write(suite, LOADER + """
    @patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
    def test_outside():
        a = PagedTokenToKVPoolAllocator(size=64, page_size=4, dtype=torch.int64, device="cpu",
                                        kvcache=MagicMock(), need_sort=False)
        out = a.alloc(4)
        a.free(out)
        with pytest.raises(AssertionError):
            assert False, "something else"
        try:
            a.free(out)
        except Exception:
            pass
    """)
    result = suite.runpytest("-p", "kvguard", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*kvguard: double-free of block 1 on PagedTokenToKVPoolAllocator#*"])
