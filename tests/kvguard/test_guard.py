"""The guard on the example allocators: every kind, every mode, and "a rejected call changes
nothing" checked against full snapshots of allocator and ledger."""

import importlib
import json
import logging
import threading

import numpy as np
import pytest
import torch

import kvguard
from kvguard import kinds
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)

from .helpers import allocator_state, snapshot

# Every test here runs on the compiled wrappers (when built) and on the Python closures.
pytestmark = pytest.mark.usefixtures("implementation")


@pytest.fixture
def alloc():
    a = LinkedFreeList(8)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    return a


def test_guard_is_in_place_and_reversible():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    assert isinstance(a, LinkedFreeList)
    assert kvguard.guard_of(a) is g
    assert kvguard.guard(a) is g, "guarding twice returns the same guard"
    assert g in kvguard.guards()
    assert a.allocate(2) == [0, 1]
    g.unguard()
    assert kvguard.guard_of(a) is None
    assert "free" not in vars(a) and "allocate" not in vars(a)
    a.free([0, 0])  # unguarded again: the flaw is back
    assert a.free_blocks == 4


def test_valid_use_is_invisible(alloc):
    g = kvguard.guard_of(alloc)
    ids = alloc.allocate(3)
    alloc.free(ids[1:])
    alloc.free(ids[0])
    more = alloc.allocate(5)
    alloc.free(tuple(more))
    assert g.violations == []
    assert g.live == {}
    assert g.check() == {None: (0, 0)}
    s = g.stats
    assert (s.alloc_calls, s.free_calls, s.blocks_allocated, s.blocks_freed) == (2, 3, 8, 8)


BAD_FREES = [
    ("duplicate-id", lambda ids: [ids[0], ids[0], ids[1]], (0,)),
    ("bool-id", lambda ids: True, ()),
    ("bool-id", lambda ids: [ids[0], False], ()),
    ("tensor-id", lambda ids: torch.tensor(ids), (0, 1, 2)),
    ("tensor-id", lambda ids: list(torch.tensor(ids)), (0, 1, 2)),
    ("consumed-iterable", lambda ids: (b for b in ids), ()),
    ("invalid-id", lambda ids: [ids[0], -1], (-1,)),
    ("invalid-id", lambda ids: [8], (8,)),
    ("invalid-id", lambda ids: [1.0], ()),
    ("invalid-id", lambda ids: "0", ()),
    ("invalid-id", lambda ids: None, ()),
    ("invalid-id", lambda ids: torch.tensor([[0, 1]]), ()),
    ("foreign-id", lambda ids: [5], (5,)),
    ("bool-id", lambda ids: np.array([True]), (0,)),
]


@pytest.mark.parametrize("kind, make, block_ids", BAD_FREES)
def test_raise_mode_rejects_and_changes_nothing(alloc, kind, make, block_ids):
    g = kvguard.guard_of(alloc)
    ids = alloc.allocate(3)
    before = snapshot(alloc, g)
    with pytest.raises(kvguard.KVGuardError) as info:
        alloc.free(make(ids))
    assert info.value.kind == kind
    assert isinstance(info.value, ValueError), "bad input to free() is a ValueError"
    assert info.value.block_ids == block_ids
    assert snapshot(alloc, g) == before
    assert g.violations[-1].kind == kind
    alloc.free(ids)  # and the allocator still works
    assert g.check() == {None: (0, 0)}


def test_double_free_is_caught_however_late(alloc):
    g = kvguard.guard_of(alloc)
    first = alloc.allocate(2)
    alloc.free(first)
    for _ in range(50):
        alloc.free(alloc.allocate(1))  # unrelated traffic
    with pytest.raises(kvguard.DoubleFreeError) as info:
        alloc.free([first[1]])
    assert info.value.block_ids == (first[1],)
    v = info.value.violation
    assert v.blocks[0].freed_at and v.blocks[0].allocated_at
    assert g.stats.violations == {"double-free": 1}


def test_the_first_fault_leads_and_the_rest_are_recorded(alloc):
    g = kvguard.guard_of(alloc)
    ids = alloc.allocate(2)
    with pytest.raises(kvguard.TensorIdError) as info:
        alloc.free(torch.tensor([ids[0], ids[0]]))
    assert [v.kind for v in g.violations] == ["tensor-id", "duplicate-id"]
    assert "duplicate-id" in info.value.violation.extra["also"][0]


def test_allocation_handing_out_a_live_block_is_shared_block():
    a = LinkedFreeList(4)
    a.allocate(3)
    a.free([0, 0, 1])  # corrupt it before the guard comes: the seed scenario
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, learn=False)
    assert a.allocate(2) == [1, 0]
    with pytest.raises(kvguard.KVGuardError) as info:
        a.allocate(2)  # -> [0, -1]
    assert info.value.kind == "invalid-id"  # -1 leads; block 0 handed out twice comes next
    kinds_seen = [v.kind for v in g.violations]
    assert kinds_seen == ["invalid-id", "shared-block"]
    assert g.violations[1].block_ids == (0,)


def test_log_mode_forwards_untouched_and_records(caplog):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    a.allocate(3)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        a.free([0, 0, 1])  # no exception; the allocator corrupts itself as it would unguarded
    assert a.free_blocks == 4
    assert [v.kind for v in g.violations] == ["duplicate-id"]
    assert "duplicate-id" in caplog.text and "SUMMARY: kvguard: duplicate-id" in caplog.text
    assert a.allocate(2) == [1, 0]
    assert a.allocate(2) == [0, -1]  # the corruption happens, but is reported
    assert [v.kind for v in g.violations][1:] == ["invalid-id", "shared-block"]
    with pytest.raises(kvguard.InconsistentError):
        g.check()  # an assertion: raises in every mode


def test_log_mode_survives_the_guards_own_bugs(monkeypatch, caplog):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")

    def broken(*args, **kwargs):
        raise RuntimeError("bug inside kvguard")
    # Where the careful path reads a free's ids, and an allocation's.
    monkeypatch.setattr(importlib.import_module("kvguard.guard.careful"), "normalize", broken)
    monkeypatch.setattr(importlib.import_module("kvguard.guard.bookkeeping"), "result_ids",
                        broken)
    with caplog.at_level(logging.ERROR, logger="kvguard"):
        ids = a.allocate(2)
        a.free({ids[0]})  # a set: slow path -> broken normalize; still forwarded
        a.free({ids[1]})
        with pytest.raises(ValueError, match="already free"):
            a.free({3})  # the allocator's own errors still reach the caller
    assert a.free_blocks == 4
    assert g.stats.internal_errors >= 2
    assert caplog.text.count("internal error") == 1, "logged once per guard"


def test_log_mode_survives_a_broken_subscriber():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    unsubscribe = kvguard.subscribe(lambda guard, v: 1 / 0)
    try:
        a.allocate(2)
        a.free([0, 0])
    finally:
        unsubscribe()
    assert g.stats.internal_errors == 1 and g.violations[0].kind == "duplicate-id"


@pytest.mark.parametrize("bad, forwarded_free", [
    (lambda ids: [ids[0], ids[0], ids[1]], 3),
    (lambda ids: torch.tensor(ids[:2], dtype=torch.int32), 3),
    (lambda ids: [ids[0], 7, True], 2),
    (lambda ids: (b for b in ids[:2]), 3),
    (lambda ids: [ids[0], ids[0] + 100], 2),
])
def test_repair_mode_forwards_a_sanitized_call(bad, forwarded_free):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")
    ids = a.allocate(3)
    a.free(bad(ids))
    assert g.violations, "the misuse is still recorded"
    assert a.free_blocks == forwarded_free
    g.check()
    rest = a.allocate(a.free_blocks)
    assert len(set(rest)) == len(rest) and -1 not in rest
    assert not set(rest) & {b for b in g.live if b not in rest}


def test_repair_mode_skips_the_call_when_nothing_is_left():
    calls = []

    class Spy(LinkedFreeList):
        def free(self, blocks):
            calls.append(blocks)
            return super().free(blocks)
    a = Spy(2)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")
    a.free([1])
    assert calls == []


def test_refcounted_pool_shares_revives_and_catches_underflow():
    p = RefcountedPool(4)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    ids = p.allocate(2)
    p.share([ids[0]])
    p.free(ids)
    assert g.live[ids[0]].refcount == 1 and ids[1] not in g.live
    p.free([ids[0]])
    p.share([ids[1]])  # a cached free block revived (vLLM's touch)
    assert g.live[ids[1]].refcount == 1
    assert g.check() == {None: (-1, -1)}
    before = snapshot(p, g)
    with pytest.raises(kvguard.DuplicateIdError):
        p.free([ids[1], ids[1]])  # one caller never holds two references
    with pytest.raises(kvguard.DoubleFreeError):
        p.free([ids[0]])  # below zero
    with pytest.raises(kvguard.ForeignIdError):
        p.share([3])  # never handed out
    assert snapshot(p, g) == before


def test_check_detects_calls_behind_the_guards_back():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    a.allocate(1)
    # the engine's own function, reached past the guard and the class's dispatcher
    vars(LinkedFreeList)["allocate"].__kvguard_function__(a, 1)
    with pytest.raises(kvguard.InconsistentError) as info:
        g.check()
    extra = info.value.violation.extra
    assert (extra["allocator_free_delta"], extra["ledger_free_delta"]) == (-2, -1)


def test_check_needs_a_free_count():
    a = LinkedFreeList(2)
    g = kvguard.guard(a, kvguard.AllocatorSpec())
    with pytest.raises(ValueError, match="free_count"):
        g.check()


def test_assert_no_leaks_and_owners():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    with kvguard.owner("req-1"):
        mine = a.allocate(2)
        assert kvguard.current_owner() == "req-1"
    with kvguard.owner("req-2"):
        theirs = a.allocate(1)
    assert g.live[mine[0]].owner == "req-1"
    g.assert_no_leaks(owner="req-3")
    with pytest.raises(kvguard.LeakError) as info:
        g.assert_no_leaks(owner="req-1")
    assert info.value.block_ids == tuple(mine)
    a.free(mine)
    g.assert_no_leaks(owner="req-1")
    with pytest.raises(kvguard.LeakError):
        g.assert_no_leaks()
    a.free(theirs)
    g.assert_no_leaks()


def test_check_tables_mapping_form():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    x, y = a.allocate(2), a.allocate(2)
    a.free([y[1]])
    found = g.check_tables({"x": x, "y": y, "z": [x[0]]})
    assert [(v.kind, v.block_ids) for v in found] == [
        ("stale-table", (y[1],)), ("shared-block", (x[0],))]
    assert "'y'" in found[0].message and "'x'" in found[1].message
    g.mode = "raise"
    with pytest.raises(kvguard.StaleTableError):
        g.check_tables({"y": y})


def test_check_tables_respects_refcounts():
    p = RefcountedPool(4)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    ids = p.allocate(1)
    p.share(ids)
    assert g.check_tables({"a": ids, "b": ids}) == []
    with pytest.raises(kvguard.SharedBlockError):
        g.check_tables({"a": ids, "b": ids, "c": ids})


def test_check_tables_tensor_form():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    x, y = a.allocate(3), a.allocate(2)
    a.free([y[0]])
    table = torch.tensor([x + [-1], y + [x[1], -1], [x[2], -1, -1, -1]], dtype=torch.int32)
    found = g.check_tables(table)
    assert [(v.kind, v.block_ids) for v in found] == [
        ("stale-table", (y[0],)), ("shared-block", (x[1], x[2]))]
    assert g.check_tables(torch.tensor([x, [y[1], -1, -1]])) == []
    with pytest.raises(TypeError):
        g.check_tables(torch.zeros(3, dtype=torch.long))


def test_threads_hammering_one_allocator_see_no_false_positives():
    a = LinkedFreeList(4096)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(2000):
                if mine and rng.random() < 0.5:
                    k = int(rng.integers(1, len(mine) + 1))
                    a.free(mine[:k])
                    del mine[:k]
                else:
                    mine += a.allocate(int(rng.integers(1, 4)))
            a.free(mine)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and g.violations == []
    assert a.free_blocks == 4096 and g.live == {}
    g.check()


def _race_two_frees() -> list:
    a = LinkedFreeList(2)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    a.allocate(1)
    barrier = threading.Barrier(2)
    outcomes = []

    def free_block_zero():
        barrier.wait()
        try:
            a.free([0])
            outcomes.append("ok")
        except kvguard.DoubleFreeError:
            outcomes.append("double-free")
    threads = [threading.Thread(target=free_block_zero) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.free_blocks == 2
    g.check()
    return sorted(outcomes)


def test_two_threads_freeing_one_block_cannot_both_pass():
    for _ in range(20):  # on both implementations (pytestmark): the C wrapper's lock too
        assert _race_two_frees() == ["double-free", "ok"]


def test_keyword_and_positional_ids_and_unknown_size():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, kvguard.AllocatorSpec(free_arg="blocks"))
    ids = a.allocate(2)
    with pytest.raises(kvguard.DuplicateIdError):
        a.free(blocks=[ids[0], ids[0]])
    a.free(blocks=ids)
    assert g.ledger().size is None and len(g.ledger()) >= 2
    with pytest.raises(kvguard.ForeignIdError):
        a.free([10**6])  # no size declared: never handed out, not out of range


def test_guard_rejects_bad_arguments():
    a = LinkedFreeList(2)
    with pytest.raises(ValueError, match="on_violation"):
        kvguard.guard(a, on_violation="explode")
    with pytest.raises(ValueError, match="stacks"):
        kvguard.guard(a, stacks="all")
    with pytest.raises(TypeError, match="no method 'release'"):
        kvguard.guard(a, kvguard.AllocatorSpec(free="release"))
    with pytest.raises(TypeError, match="no parameter"):
        kvguard.guard(a, kvguard.AllocatorSpec(free_arg="ids"))
    with pytest.raises(TypeError, match="free_arg"):
        kvguard.AllocatorSpec(free_arg=True)
    with pytest.raises(ValueError, match="needs id_attr and refcounted=True"):
        kvguard.AllocatorSpec(id_attr="block_id", refcount_attr="ref_cnt")
    with pytest.raises(TypeError, match="refcount_attr"):
        kvguard.AllocatorSpec(id_attr="block_id", refcounted=True, refcount_attr="ref.cnt")
    assert kvguard.guard_of(a) is None and "free" not in vars(a)

    class Slotted:
        __slots__ = ()

        def allocate(self, n):
            return []

        def free(self, ids):
            pass
    with pytest.raises(TypeError, match="__slots__"):
        kvguard.guard(Slotted())


def test_reentrant_calls_are_not_double_counted():
    class Nested(LinkedFreeList):
        def free(self, blocks):
            for b in list(blocks):
                super().free([b])  # would be an inner guarded call if it went through self.free

        def release_all(self, blocks):
            self.free(blocks)
    a = Nested(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(2)
    a.release_all(ids)
    assert g.stats.free_calls == 1 and g.live == {}


def test_violation_report_is_json_ready(alloc):
    ids = alloc.allocate(2)
    with pytest.raises(kvguard.KVGuardError) as info:
        alloc.free([ids[0], ids[0]])
    d = info.value.violation.to_dict()
    again = kvguard.Violation.from_dict(json.loads(json.dumps(d)))
    assert again.kind == "duplicate-id" and again.block_ids == (ids[0],)
    assert again.summary() == info.value.violation.summary()
    assert again.render().splitlines()[-1] == info.value.violation.render().splitlines()[-1]


def test_a_call_without_ids_gets_the_allocators_own_type_error():
    a = LinkedFreeList(2)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    with pytest.raises(TypeError):
        a.free()
    assert g.violations == []


def test_sub_pools_have_their_own_ledgers():
    class Grouped:
        """DeepSpeed's BlockedKVCache shape: one free list per cache group."""

        def __init__(self):
            self.groups = [LinkedFreeList(4), LinkedFreeList(4)]

        def reserve(self, n, cache_group=0):
            return self.groups[cache_group].allocate(n)

        def free(self, blocks, cache_group=0):
            self.groups[cache_group].free(blocks)

        def free_blocks(self):
            return [g.free_blocks for g in self.groups]
    c = Grouped()
    g = kvguard.guard(c, kvguard.AllocatorSpec(alloc="reserve", pool_arg="cache_group",
                                               size=lambda c: [4, 4], free_count="free_blocks"))
    a0 = c.reserve(2)
    a1 = c.reserve(2, cache_group=1)
    assert a0 == a1 == [0, 1], "the same ids in two groups are two different blocks"
    c.free(a0)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        c.free(a0, 0)
    assert info.value.violation.pool == 0
    c.free([1], cache_group=1)
    assert set(g.live) == {(1, 0)}
    assert g.check() == {0: (0, 0), 1: (-1, -1)}
    assert None not in g._ledgers


def test_attaching_to_a_busy_allocator_learns_its_blocks_and_says_so():
    a = LinkedFreeList(8)
    early = a.allocate(3)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)  # free_count 5 < size 8: blocks are out
    a.free(early[:2])  # never seen handed out, but no false alarm: learned
    assert g.stats.learned == 2 and g.violations == []
    with pytest.raises(kvguard.DoubleFreeError) as info:
        a.free(early[:1])
    text = info.value.violation.render()
    assert "note: the guard attached while blocks were out; 2 id(s)" in text
    fresh = kvguard.guard(LinkedFreeList(8), LINKED_FREE_LIST_SPEC)
    assert not fresh.ledger().learn


def test_stacks_off_still_names_the_users_call():
    a = LinkedFreeList(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off")
    ids = a.allocate(1)
    with pytest.raises(kvguard.DuplicateIdError) as info:
        a.free(ids + ids)
    summary = info.value.violation.summary()
    assert summary.endswith("in test_stacks_off_still_names_the_users_call")
    assert "test_guard.py:" in summary


def test_messages_name_the_specs_methods():
    class Pool(LinkedFreeList):
        def release_blocks(self, blocks):
            return self.free(blocks)
    p = Pool(4)
    kvguard.guard(p, LINKED_FREE_LIST_SPEC.replace(free="release_blocks"))
    ids = p.allocate(1)
    with pytest.raises(kvguard.DuplicateIdError) as info:
        p.release_blocks(ids + ids)
    assert info.value.violation.message.startswith("release_blocks() got")
