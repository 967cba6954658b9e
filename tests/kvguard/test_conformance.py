"""The conformance fuzzer (kvguard.testing): every clause caught by exactly its own planted bug,
nothing reported on correct allocators, the seed bug found from scratch on DeepSpeed's code."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from kvguard import AllocatorSpec
from kvguard.conformance.clauses import CLAUSES, applicable
from kvguard.conformance.shrink import shrink
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)
from kvguard.testing import ConformanceError, check_allocator

EXAMPLES = 20
BUDGET = 600.0  # the exact sets asserted here must not depend on a loaded machine


class Pool:
    """A correct pool (validates every id of a call before changing anything), and, with
    ``bug``, the same pool with one clause's promise broken and nothing else."""

    def __init__(self, n: int, bug: str | None = None) -> None:
        self.n = n
        self.bug = bug
        self.free_list = list(range(n))
        self.live: dict = {}  # id -> references
        self.ever: set = set()

    def allocate(self, k: int) -> list:
        full = self.bug == "valid-trace" and k == len(self.free_list) and k > 1
        if k > len(self.free_list) or full:  # planted: taking the last blocks at once fails
            raise ValueError(f"cannot allocate {k}")
        out = self.free_list[:k]
        if not (self.bug == "no-live-handout" and k == 1):
            del self.free_list[:k]  # the planted bug: one block is handed out and kept
        for b in out:
            self.live[int(b)] = 1
            self.ever.add(int(b))
        return [int(b) for b in out] if self.bug != "tensor-id" else out

    def num_free(self) -> int:
        extra = 1 if self.bug == "free-count" and len(self.live) >= 2 else 0
        return self.n - len(self.live) + extra

    def _ids(self, value) -> list:
        if self.bug == "bool-mask" and getattr(value, "dtype", None) in (torch.bool, bool):
            return [i for i, v in enumerate(value.tolist()) if v][:1]  # the first one only
        if self.bug == "tensor-id" and isinstance(value, torch.Tensor) \
                and value.dtype is not torch.bool:
            value = list(value.reshape(-1))  # keeps the caller's 0-dim elements
        if self.bug == "generator" and inspect.isgenerator(value):
            for b in value:  # validates by iterating, then frees what is left: nothing
                self._check_one(b)
            return list(value)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"free() takes a list of ids, not {type(value).__name__}")
        ids = list(value)
        for b in ids:
            self._check_one(b)
        if self.bug == "invalid-id":  # planted: read with int(), a negative id wraps around
            ids = [int(b) % self.n for b in ids]
        if len({int(b) for b in ids}) != len(ids) and self.bug != "duplicate-id":
            raise ValueError("an id appears twice")
        return ids

    def _check_one(self, b) -> None:
        plain = type(b) is int or (self.bug == "bool-id" and type(b) is bool) or (
            self.bug == "tensor-id" and isinstance(b, torch.Tensor) and b.dim() == 0) or (
            self.bug == "invalid-id" and isinstance(b, (float, str)))
        if self.bug == "invalid-id" and plain:
            b = int(b) % self.n
        if not plain:
            raise TypeError(f"block ids are ints, not {type(b).__name__}")
        if not 0 <= b < self.n:
            raise ValueError(f"block {b} is out of range")
        if int(b) not in self.live:
            if self.bug == "double-free" and int(b) in self.ever:
                return
            if self.bug == "foreign-id" and int(b) not in self.ever:
                return
            raise ValueError(f"block {b} is not live")

    def free(self, value) -> None:
        if isinstance(value, bool) and self.bug == "bool-id":
            value = [value]
        for b in self._ids(value):
            refs = self.live.get(int(b), 0)
            if refs <= 1:
                self.live.pop(int(b), None)
                if 0 <= b < self.n:
                    self.free_list.append(b)
            else:
                self.live[int(b)] = refs - 1


class RefPool(Pool):
    """The same pool, refcounted: ``share()`` adds a reference, ``free()`` drops one."""

    def share(self, ids) -> None:
        ids = self._ids(ids)
        for b in ids:
            self.live[b] += 1

    def _check_one(self, b) -> None:
        if self.bug == "release-past-zero" and type(b) is int and b in self.ever:
            return  # a block already at 0 is "released" again: queued twice
        super()._check_one(b)


POOL_SPEC = AllocatorSpec(size="n", free_count="num_free")
REF_SPEC = AllocatorSpec(share="share", refcounted=True, size="n", free_count="num_free")


def planted(bug):
    if bug == "release-past-zero":
        return (lambda: RefPool(4, bug)), REF_SPEC
    return (lambda: Pool(4, bug)), POOL_SPEC


@pytest.mark.parametrize("bug", list(CLAUSES))
def test_each_clause_has_a_planted_bug_only_it_catches(bug):
    factory, spec = planted(bug)
    report = check_allocator(factory, spec, examples=EXAMPLES, budget=BUDGET, raise_on_broken=False)
    assert report.broken == {bug}, report.render()
    (finding,) = report.findings
    assert finding.promised and finding.calls and "def test_" in finding.test


@pytest.mark.parametrize("factory,spec", [
    (lambda: Pool(4), POOL_SPEC), (lambda: RefPool(4), REF_SPEC),
], ids=["plain", "refcounted"])
def test_a_correct_pool_keeps_every_clause(factory, spec):
    report = check_allocator(factory, spec, examples=EXAMPLES, budget=BUDGET)
    assert report.findings == [] and set(report.passed) == set(applicable(spec))


class FixedLinkedFreeList(LinkedFreeList):
    """``kvguard.examples.LinkedFreeList`` (DeepSpeed's free list) with the fix: the whole call
    is read and validated, duplicates included, before anything is linked."""

    def free(self, blocks) -> None:
        if isinstance(blocks, bool) or not isinstance(blocks, (int, list, tuple)):
            raise TypeError(f"free() takes an id or a list of ids, not {type(blocks).__name__}")
        ids = [blocks] if isinstance(blocks, int) else list(blocks)
        if any(type(b) is not int for b in ids):
            raise TypeError("block ids are ints")
        if len(set(ids)) != len(ids):
            raise ValueError("an id appears twice in one free()")
        super().free(ids)


class FixedRefcountedPool(RefcountedPool):
    """``kvguard.examples.RefcountedPool`` with every reference checked before one is dropped."""

    def _checked(self, ids) -> list:
        if not isinstance(ids, (list, tuple)) or any(type(b) is not int for b in ids):
            raise TypeError("ids are a list of ints")
        if len(set(ids)) != len(ids):
            raise ValueError("an id appears twice in one call")
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise ValueError("id out of range")
        return list(ids)

    def share(self, ids) -> None:
        super().share(self._checked(ids))

    def free(self, ids) -> None:
        ids = self._checked(ids)
        if any(self.ref_cnt[b] <= 0 for b in ids):
            raise ValueError("a block is already free")
        super().free(ids)


@pytest.mark.parametrize("factory,spec", [
    (lambda: FixedLinkedFreeList(4), LINKED_FREE_LIST_SPEC),
    (lambda: FixedRefcountedPool(4), REFCOUNTED_POOL_SPEC),
], ids=["linked-free-list", "refcounted-pool"])
def test_the_examples_fixed_keep_every_clause(factory, spec):
    check_allocator(factory, spec, examples=EXAMPLES, budget=BUDGET)


def test_the_examples_as_shipped_break_their_promises():
    with pytest.raises(ConformanceError) as info:
        check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC, examples=EXAMPLES,
                        budget=BUDGET)
    report = info.value.report
    assert {"duplicate-id", "bool-id", "generator", "tensor-id"} <= report.broken
    assert "duplicate-id" in str(info.value) and "took" in str(info.value)


def test_a_clause_not_promised_is_reported_apart_and_does_not_fail():
    report = check_allocator(lambda: Pool(4, "duplicate-id"), POOL_SPEC, examples=EXAMPLES,
                             budget=BUDGET, promises=set(CLAUSES) - {"duplicate-id"})
    assert [f.clause for f in report.unprotected] == ["duplicate-id"]
    assert report.broken_promises == []
    assert "does not protect against" in report.render()


def test_the_same_seed_gives_the_same_report_and_another_seed_still_finds_the_bug():
    def text(seed):
        r = check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC, seed=seed,
                            examples=EXAMPLES, budget=BUDGET, raise_on_broken=False)
        return r.render().split("took")[1].split("\n", 1)[1], r.broken
    assert text(3) == text(3)
    assert "duplicate-id" in text(5)[1]


def test_the_budget_stops_the_search_and_says_so():
    report = check_allocator(lambda: Pool(4), POOL_SPEC, examples=EXAMPLES, budget=0.0)
    assert report.passed == [] and report.not_run
    assert all(why.startswith(("budget spent", "does not apply")) for _, why in report.not_run)


def test_unknown_clause_names_are_refused():
    with pytest.raises(ValueError, match="unknown clause"):
        check_allocator(lambda: Pool(4), POOL_SPEC, promises=["no-such-clause"])


def _run_test(code: str) -> None:
    namespace: dict = {}
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    test()


def test_the_emitted_regression_test_fails_before_the_fix_and_passes_after():
    report = check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC,
                             examples=EXAMPLES, budget=BUDGET, raise_on_broken=False,
                             clauses=["duplicate-id"])
    (finding,) = report.findings
    assert "bad = [0, 0]\n" in finding.test and "a.free(bad)" in finding.test
    with pytest.raises(AssertionError, match="two owners"):
        _run_test(finding.test)
    _run_test(finding.test.replace("from kvguard.examples import LinkedFreeList",
                                   f"from {__name__} import FixedLinkedFreeList as "
                                   "LinkedFreeList"))


def test_shrink_drops_every_call_the_failure_does_not_need():
    def fails(ops):  # a stand-in failure: needs one allocate of 2 blocks or more, then a free
        kinds = [op[0] for op in ops]
        return "free" in kinds and any(op[0] == "allocate" and op[1] >= 2 for op in ops)
    ops = [("allocate", 3), ("free", (5, 2)), ("allocate", 4), ("free", (1,))]
    assert shrink(ops, fails) == [("allocate", 2), ("free", (0,))]


def test_import_kvguard_does_not_import_the_fuzzer_or_hypothesis():
    code = ("import sys, kvguard; bad = [m for m in ('kvguard.testing', 'kvguard.conformance', "
            "'hypothesis', 'pytest') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_cli_fuzz_exits_1_with_the_report_when_a_clause_breaks(capsys):
    from kvguard.cli import main
    code = main(["fuzz", "kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec",
                 "kvguard.examples.LINKED_FREE_LIST_SPEC", "--examples", "20", "--budget", "600",
                 "--clause",
                 "duplicate-id", "--clause", "double-free", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "breaks a promise it makes:\n  duplicate-id" in out and "keeps: double-free" in out
    assert "def test_linkedfreelist_duplicate_id():" in out and "took" in out


def test_cli_fuzz_exits_0_when_every_clause_holds(capsys):
    from kvguard.cli import main
    assert main(["fuzz", f"{__name__}.Pool", "--factory", "Pool(4)", "--spec",
                 f"{__name__}.POOL_SPEC", "--examples", "10", "--budget", "600"]) == 0
    assert "0 broken promise(s)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["no.such.Thing"], "cannot import no.such.Thing"),
    (["kvguard.examples.LinkedFreeList"], "no built-in factory"),
    (["kvguard.examples.LinkedFreeList", "--factory", "cls("], "--factory"),
    (["kvguard.examples.LinkedFreeList", "--factory", "cls(0)"], "cannot build"),
    (["kvguard.examples.LinkedFreeList", "--factory", "cls(4)"], "size= or free_count="),
    (["kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec", "kvguard.examples"
      ".LinkedFreeList"], "is not a kvguard.AllocatorSpec"),
    (["kvguard.examples.LinkedFreeList", "--examples", "0"], "--examples"),
    (["kvguard.examples.LINKED_FREE_LIST_SPEC"], "is not a class"),
])
def test_cli_fuzz_mistakes_are_one_line_and_exit_2(capsys, argv, message):
    from kvguard.cli import main
    assert main(["fuzz", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
