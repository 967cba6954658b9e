"""The fuzzer's reports on the engines' real allocators read as a maintainer reads them: one
finding per bug (the other clauses that reach it named as the same bug), each ending on the
harm it does, and every emitted test standing alone (the engine's module and pytest) and
failing on the engine's class as shipped."""

from __future__ import annotations

import ast

import pytest

from kvguard.conformance.fuzz import target_for
from kvguard.testing import check_allocator

from . import engines

EXAMPLES = 40
BUDGET = 600.0  # the sets asserted here must not depend on a loaded machine
NAMES = {"deepspeed": "BlockedAllocator", "vllm": "BlockPool", "sglang": "TokenToKVPoolAllocator",
         "transformers": "CachePool", "lmcache": "PagedTensorMemoryAllocator",
         "lmdeploy": "LogicalAllocator", "aphrodite": "BlockPool"}


def _imports(code: str) -> set:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


def _fails(code: str) -> bool:
    namespace: dict = {}
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    try:
        test()
    except BaseException:  # noqa: B036 - pytest.fail's exception is a BaseException
        return True
    return False


@pytest.mark.parametrize("engine", list(NAMES))
def test_each_finding_is_one_bug_with_its_harm_and_a_standalone_failing_test(engine):
    with engines.loaded(engine) as ns:
        cls = getattr(ns, NAMES[engine])
        make, spec, driver, source = target_for(cls)
        report = check_allocator(make, spec, examples=EXAMPLES, budget=BUDGET, driver=driver,
                                 make=source, raise_on_broken=False)
        text = report.render()
        harms = [f.harm for f in report.findings]
        assert all(harms), text
        assert len(set(harms)) == len(harms), text  # two findings, one corruption: one bug
        for finding in report.findings + report.robustness:
            imports = _imports(finding.test)
            assert "kvguard" not in imports, finding.test
            assert imports <= {"pytest", "torch", "numpy", cls.__module__.split(".")[0]}
            assert "pytest.raises(Exception)" not in finding.test, finding.test
            assert _fails(finding.test), finding.test


def test_vllm_is_one_bug_the_missing_ref_cnt_check():
    with engines.loaded("vllm") as ns:
        make, spec, driver, source = target_for(ns.BlockPool)
        report = check_allocator(make, spec, examples=EXAMPLES, budget=BUDGET, driver=driver,
                                 make=source, raise_on_broken=False)
    (finding,) = report.findings
    assert finding.clause == "release-past-zero", report.render()
    assert finding.same_bug == ["foreign-id"], report.render()  # a free block of pool.blocks
    assert "duplicate-id" in report.passed  # a repeat within the count is two releases
    assert "reference count is -1" in finding.harm and "AssertionError" in finding.harm
    assert "KVCacheBlock(" not in report.render()  # no block forged


def test_lmcache_is_one_bug_the_unchecked_free_list():
    with engines.loaded("lmcache") as ns:
        make, spec, driver, source = target_for(ns.PagedTensorMemoryAllocator)
        report = check_allocator(make, spec, examples=EXAMPLES, budget=BUDGET, driver=driver,
                                 make=source, raise_on_broken=False)
    (finding,) = report.findings
    assert {finding.clause, *finding.same_bug} >= {"double-free", "duplicate-id"}
    assert "two owners" in finding.harm, report.render()
    # reached through the page's own reference count too: batched_free, then ref_count_down()
    assert any(".ref_count_down() -> returned None  <- the double-free call" in c
               for c in finding.calls), report.render()
