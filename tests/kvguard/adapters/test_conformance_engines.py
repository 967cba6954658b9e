"""The conformance fuzzer on the engines' real allocators, loaded from the downloaded packages:
what it finds from scratch (no hint of the bug), and every regression test it writes fails on
the engine's code as shipped."""

from __future__ import annotations

import pytest

from kvguard.conformance.fuzz import target_for
from kvguard.testing import check_allocator

from . import engines

EXAMPLES = 40
BUDGET = 600.0  # the exact sets asserted here must not depend on a loaded machine

# engine -> (class in the loader's namespace, {finding's clause: clauses named as the same bug}
# at EXAMPLES examples, seed 0): one finding per bug
EXPECTED = {
    "deepspeed": ("BlockedAllocator", {"duplicate-id": [], "tensor-id": [], "generator": []}),
    "vllm": ("BlockPool", {"release-past-zero": ["foreign-id"]}),
    "sglang": ("TokenToKVPoolAllocator", {"double-free": ["duplicate-id"],
                                          "foreign-id": ["invalid-id"]}),
    "transformers": ("CachePool", {"double-free": ["duplicate-id"],
                                   "foreign-id": ["bool-id", "bool-mask", "invalid-id"]}),
    "lmcache": ("PagedTensorMemoryAllocator", {"double-free": ["duplicate-id", "foreign-id"]}),
    "lmdeploy": ("LogicalAllocator", {"duplicate-id": [], "invalid-id": [],
                                      "release-past-zero": ["foreign-id"]}),
    "aphrodite": ("BlockPool", {"release-past-zero": ["foreign-id"]}),
}


def _run_test(code: str) -> None:
    namespace: dict = {}
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    test()


@pytest.mark.parametrize("engine", list(EXPECTED))
def test_the_fuzzer_on_the_real_allocator(engine):
    name, expected = EXPECTED[engine]
    with engines.loaded(engine) as ns:
        make, spec, driver, source = target_for(getattr(ns, name))
        report = check_allocator(make, spec, examples=EXAMPLES, budget=BUDGET, driver=driver,
                                 make=source, raise_on_broken=False)
        assert {f.clause: sorted(f.same_bug) for f in report.findings} == expected, \
            report.render()
        for finding in report.findings:
            with pytest.raises((Exception, pytest.fail.Exception)):  # fails on the real class
                _run_test(finding.test)


def test_the_seed_bug_is_found_from_scratch_on_deepspeed():
    """DeepSpeed 0.19.8 ``BlockedAllocator.free([0, 0, 1])``: nothing tells the fuzzer where to
    look; it finds a repeated id accepted, and the emitted test fails on the real class."""
    with engines.loaded("deepspeed") as ds:
        make, spec, driver, source = target_for(ds.BlockedAllocator)
        report = check_allocator(make, spec, examples=EXAMPLES, budget=BUDGET, driver=driver,
                                 make=source, raise_on_broken=False, clauses=["duplicate-id"])
        (finding,) = report.findings
        assert finding.did.startswith("accepted it")
        assert finding.calls[1].startswith("a.free([0, 0]")
        assert "handed to two owners" in finding.harm  # the next allocations hand block 0 out
        assert "a = BlockedAllocator(8)" in finding.test
        with pytest.raises(AssertionError, match="two owners"):
            _run_test(finding.test)
