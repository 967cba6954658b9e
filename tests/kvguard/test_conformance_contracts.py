"""The fuzzer's contracts per pool kind, its findings grouped by root cause with the harm shown,
and the tests it emits standing alone: each on a small allocator written here with one flaw
(or none), the kind of allocator the engines' pools are but none of them."""

from __future__ import annotations

import ast

import pytest

from kvguard import AllocatorSpec
from kvguard.testing import check_allocator

EXAMPLES = 30
BUDGET = 600.0  # the exact sets asserted here must not depend on a loaded machine


class TopDownPool:
    """A plain pool that hands out its highest free id first and validates a call before
    changing anything. ``flaw``: ``"bool"`` reads ids with ``operator.index`` (a bool is id 1),
    ``"wrap"`` checks only the upper bound (a negative id wraps to the last block through list
    indexing), ``"float"`` reads ids with ``int()`` (1.0 and "1" are block 1),
    ``"free-check"`` never checks that a block is live (a repeat, a double free and a
    never-allocated id all put a block on the free list twice)."""

    def __init__(self, n: int, flaw: str | None = None) -> None:
        self.n = n
        self.flaw = flaw
        self.state = ["free"] * n
        self.free_list = list(range(n))  # popped from the end: n - 1 first

    def allocate(self, k: int) -> list:
        if k > len(self.free_list):
            raise ValueError(f"cannot allocate {k} blocks, {len(self.free_list)} free")
        out = [self.free_list.pop() for _ in range(k)]
        for b in out:
            self.state[b] = "live"
        return out

    def num_free(self) -> int:
        return len(self.free_list)

    def _read(self, b) -> int:
        if self.flaw == "bool":
            import operator
            return operator.index(b)
        if self.flaw == "float":
            return int(b)
        if type(b) is not int:
            raise TypeError(f"block ids are ints, not {type(b).__name__}")
        return b

    def free(self, ids) -> None:
        if not isinstance(ids, list):
            raise TypeError(f"free() takes a list of ids, not {type(ids).__name__}")
        read = [self._read(b) for b in ids]
        for b in read:
            if b >= self.n or (b < 0 and self.flaw != "wrap"):
                raise ValueError(f"block {b} is out of range")
            if self.flaw != "free-check" and self.state[b] != "live":
                raise ValueError(f"block {b} is not live")
        if self.flaw != "free-check" and len(set(read)) != len(read):
            raise ValueError("a block appears twice")
        for b in read:
            self.state[b] = "free"
            self.free_list.append(self.n + b if b < 0 else b)


TOP_DOWN_SPEC = AllocatorSpec(size="n", free_count="num_free")


class CountingPool:
    """A refcounted pool (vLLM's rule: a block named twice in one free is two releases).
    ``flaw="zero"``: a release is never checked against the count, so it goes past zero."""

    def __init__(self, n: int, flaw: str | None = None) -> None:
        self.n = n
        self.flaw = flaw
        self.refs = [0] * n
        self.free_list = list(range(n))

    def allocate(self, k: int) -> list:
        if k > len(self.free_list):
            raise ValueError(f"cannot allocate {k} blocks")
        out = [self.free_list.pop(0) for _ in range(k)]
        for b in out:
            assert self.refs[b] == 0, f"block {b} handed out with {self.refs[b]} references"
            self.refs[b] = 1
        return out

    def _checked(self, ids) -> list:
        if not isinstance(ids, list) or any(type(b) is not int for b in ids):
            raise TypeError("ids are a list of ints")
        if any(not 0 <= b < self.n for b in ids):
            raise ValueError("block id out of range")
        return ids

    def share(self, ids) -> None:
        for b in self._checked(ids):
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} is not live")
        for b in ids:
            self.refs[b] += 1

    def free(self, ids) -> None:
        ids = self._checked(ids)
        if self.flaw != "zero":
            drops: dict = {}
            for b in ids:
                drops[b] = drops.get(b, 0) + 1
            for b, k in drops.items():
                if self.refs[b] < k:
                    raise ValueError(f"block {b} released {k} times with {self.refs[b]} "
                                     "references")
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_list.append(b)

    def num_free(self) -> int:
        return len(self.free_list)


COUNTING_SPEC = AllocatorSpec(share="share", refcounted=True, size="n", free_count="num_free")


def check(factory, spec, **kwargs):
    return check_allocator(factory, spec, examples=EXAMPLES, budget=BUDGET,
                           raise_on_broken=False, **kwargs)


def run_emitted(code: str, namespace: dict) -> None:
    """Run one emitted test with ``namespace`` in place of its import of this module."""
    code = "\n".join(line for line in code.splitlines()
                     if not line.startswith(f"from {__name__} import"))
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    test()


def imports_of(code: str) -> set:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


def test_a_bool_is_found_when_the_pool_hands_out_high_ids_first():
    report = check(lambda: TopDownPool(6, "bool"), TOP_DOWN_SPEC)
    assert "bool-id" in report.broken, report.render()


def test_a_negative_id_that_wraps_to_the_last_block_is_an_invalid_id():
    report = check(lambda: TopDownPool(6, "wrap"), TOP_DOWN_SPEC, clauses=["invalid-id"])
    (finding,) = report.findings
    assert finding.clause == "invalid-id" and "-1" in "\n".join(finding.calls), report.render()
    assert finding.harm, report.render()


def test_a_float_id_read_with_int_is_an_invalid_id():
    report = check(lambda: TopDownPool(6, "float"), TOP_DOWN_SPEC, clauses=["invalid-id"])
    (finding,) = report.findings
    assert any(x in "\n".join(finding.calls) for x in ("1.0", "'", ".0")), report.render()


def test_a_correct_top_down_pool_keeps_every_clause_invalid_id_included():
    report = check(lambda: TopDownPool(6), TOP_DOWN_SPEC)
    assert report.findings == [] and "invalid-id" in report.passed, report.render()


def test_refcounted_repeats_within_the_count_are_releases_not_findings():
    report = check(lambda: CountingPool(6), COUNTING_SPEC)
    assert report.findings == [], report.render()
    assert "duplicate-id" in report.passed, report.render()


def test_refcounted_release_past_zero_is_one_finding_with_its_harm():
    """The missing count check is reached by a release of a free block (named again, or
    named once more than its references) and by a never-allocated block: one bug, one
    finding, the other clause named as the same bug. A repeat within the count is legal."""
    report = check(lambda: CountingPool(6, "zero"), COUNTING_SPEC)
    assert len(report.findings) == 1, report.render()
    (finding,) = report.findings
    assert finding.clause == "release-past-zero" and finding.same_bug == ["foreign-id"]
    assert "same bug" in report.render() and "duplicate-id" in report.passed
    assert finding.harm and "AssertionError" in finding.harm, report.render()


def test_a_missing_free_check_is_one_finding_that_ends_on_two_owners():
    report = check(lambda: TopDownPool(6, "free-check"), TOP_DOWN_SPEC)
    assert len(report.findings) == 1, report.render()
    (finding,) = report.findings
    assert {"duplicate-id", "double-free"} <= {finding.clause, *finding.same_bug}
    assert "two owners" in finding.harm, report.render()


@pytest.mark.parametrize("flaw", ["bool", "wrap", "float", "free-check"])
def test_every_emitted_test_stands_alone_and_fails_on_the_flawed_pool(flaw):
    report = check(lambda: TopDownPool(6, flaw), TOP_DOWN_SPEC)
    assert report.findings, report.render()
    for finding in report.findings:
        assert imports_of(finding.test) <= {"pytest", __name__.split(".")[0]}, finding.test
        assert "kvguard" not in imports_of(finding.test)
        assert "pytest.raises(Exception)" not in finding.test, finding.test
        with pytest.raises((Exception, pytest.fail.Exception)):
            run_emitted(finding.test, {"TopDownPool": TopDownPool})


def test_the_emitted_test_asserts_the_class_the_pool_rejects_with():
    report = check(lambda: TopDownPool(6, "free-check"), TOP_DOWN_SPEC)
    (finding,) = report.findings
    assert "ValueError" in finding.test, finding.test


def test_the_emitted_test_passes_once_the_pool_is_fixed():
    report = check(lambda: TopDownPool(6, "free-check"), TOP_DOWN_SPEC)
    (finding,) = report.findings
    run_emitted(finding.test, {"TopDownPool": lambda n, flaw=None: TopDownPool(n)})
