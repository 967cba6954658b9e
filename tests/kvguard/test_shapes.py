"""The allocator shapes the spec says beyond one method each (kvguard.guard.shapes), on small
allocators of each shape written for these tests (tests/kvguard/shape_classes.py): a correct
workload gives no violation, and a planted double free, duplicate id and stale id are caught,
in raise, log and repair mode, on the compiled wrappers, the closures and the careful path."""

from __future__ import annotations

import pytest

import kvguard
from kvguard import kinds

from .conftest import three_ways, use_wrappers
from .shape_classes import (
    GROUPED_SPEC, PAGE_SPEC, SEQ_SPEC, SINGLE_SPEC, GroupedPool, Request, RequestPagePool, Seq,
    SeqBlockManager, SingleIdPool,
)

MODES = ("raise", "log", "repair")


def healthy_seq(pool: SeqBlockManager) -> bool:
    free = pool.free_ids
    return (len(free) == len(set(free)) and min(pool.ref_counts) >= 0
            and all(pool.ref_counts[b] == 0 for b in free))


def healthy_pages(pool: RequestPagePool) -> bool:
    return len(pool.free_pages) == len(set(pool.free_pages))


def healthy_single(pool: SingleIdPool) -> bool:
    return len(pool.free_list) == len(set(pool.free_list)) and min(pool.refs) >= 0


class SeqShape:
    """ids carried in the sequence, an allocation that also shares, a fork that shares."""

    spec = SEQ_SPEC
    healthy = staticmethod(healthy_seq)

    def make(self):
        return SeqBlockManager(16)

    def workload(self, pool):
        for round_ in range(3):
            a = Seq(3)
            pool.allocate(a)
            b = Seq(5, prefix=a, shared=2)       # a prefix-cache hit: 2 shared, 3 new
            pool.allocate(b)
            c = Seq(0)
            pool.fork(c, b)                        # copy-on-write fork: shares all of b
            for seq in (a, c, b):
                pool.deallocate(seq)

    def double_free(self, pool):
        a = Seq(2)
        pool.allocate(a)
        stale = list(a.block_table)
        pool.deallocate(a)
        a.block_table = stale
        return lambda: pool.deallocate(a)

    def duplicate(self, pool):
        a = Seq(2)
        pool.allocate(a)
        a.block_table.append(a.block_table[0])
        return lambda: pool.deallocate(a)

    def stale(self, pool):
        a = Seq(1)
        pool.allocate(a)
        a.block_table.append(15)                   # never handed out
        return lambda: pool.deallocate(a)


class PageShape:
    """ids carried in the request, a single-id free, a reset."""

    spec = PAGE_SPEC
    healthy = staticmethod(healthy_pages)

    def make(self):
        return RequestPagePool(12)

    def workload(self, pool):
        for _ in range(3):
            r, s = Request(), Request()
            pool.alloc_pages(r, 3)
            pool.alloc_pages(s, 4)
            pool.free_page(r.pages.pop())
            pool.free_request(r)
            pool.clear()                           # returns s's pages too

    def double_free(self, pool):
        r = Request()
        pool.alloc_pages(r, 2)
        page = r.pages[0]
        pool.free_request(r)
        return lambda: pool.free_page(page)

    def duplicate(self, pool):
        r = Request()
        pool.alloc_pages(r, 2)
        r.pages.append(r.pages[0])
        return lambda: pool.free_request(r)

    def stale(self, pool):
        r = Request()
        pool.alloc_pages(r, 1)
        r.pages.append(11)
        return lambda: pool.free_request(r)


class SingleShape:
    """one id per call, reference counted."""

    spec = SINGLE_SPEC
    healthy = staticmethod(healthy_single)

    def make(self):
        return SingleIdPool(8)

    def workload(self, pool):
        for _ in range(3):
            a, b = pool.allocate_one(), pool.allocate_one()
            pool.retain(a)
            pool.release(a)
            pool.release_many([b, a])

    def double_free(self, pool):
        a = pool.allocate_one()
        pool.release(a)
        return lambda: pool.release(a)

    def duplicate(self, pool):
        a = pool.allocate_one()
        return lambda: pool.release_many([a, a])    # one call, one id twice

    def stale(self, pool):
        pool.allocate_one()
        return lambda: pool.release(0)              # handed out last of 8: never yet


class GroupedShape:
    """sub-pools: ids numbered per group."""

    spec = GROUPED_SPEC

    @staticmethod
    def healthy(pool):
        return all(len(f) == len(set(f)) for f in pool.free_lists)

    def make(self):
        return GroupedPool(2, 6)

    def workload(self, pool):
        for _ in range(3):
            a = pool.allocate(2, group=0)
            b = pool.allocate(2, group=1)           # the same ids, another sub-pool
            pool.free(a, group=0)
            pool.free(b, group=1)

    def double_free(self, pool):
        a = pool.allocate(2, group=1)
        pool.free(a, group=1)
        return lambda: pool.free(a[:1], group=1)

    def duplicate(self, pool):
        a = pool.allocate(2, group=0)
        return lambda: pool.free([a[0], a[0]], group=0)

    def stale(self, pool):
        pool.allocate(1, group=0)
        return lambda: pool.free([5], group=0)


def state(pool) -> dict:
    """The pool's own data (its lists and counts), without the guard's wrappers."""
    return {k: repr(v) for k, v in vars(pool).items() if not callable(v) and "kvguard" not in k}


SHAPES = [SeqShape(), PageShape(), SingleShape(), GroupedShape()]
WAYS = three_ways()


def guarded(shape, mode, accel, fast):
    with use_wrappers(accel):
        pool = shape.make()
        g = kvguard.guard(pool, shape.spec, on_violation=mode, fast_path=fast)
    return pool, g


@pytest.mark.parametrize("way", WAYS, ids=lambda w: "compiled" if w[0] else
                         "closures" if w[1] else "careful")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: type(s).__name__)
def test_a_correct_workload_of_each_shape_gives_no_violation(shape, mode, way):
    pool, g = guarded(shape, mode, *way)
    shape.workload(pool)
    assert g.violations == [] and g.notes == []
    assert g.live == {}
    g.check()
    assert shape.healthy(pool)


PLANTS = {"double_free": kinds.DOUBLE_FREE, "duplicate": kinds.DUPLICATE_ID,
          "stale": kinds.FOREIGN_ID}


@pytest.mark.usefixtures("quiet_kvguard_log")
@pytest.mark.parametrize("way", WAYS, ids=lambda w: "compiled" if w[0] else
                         "closures" if w[1] else "careful")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: type(s).__name__)
def test_a_planted_fault_of_each_shape_is_caught(shape, plant, mode, way):
    pool, g = guarded(shape, mode, *way)
    call = getattr(shape, plant)(pool)
    before = state(pool)
    if mode == "raise":
        with pytest.raises(kvguard.KVGuardError) as info:
            call()
        assert info.value.kind == PLANTS[plant]
        assert state(pool) == before, "raise mode: the bad call never reached the pool"
    else:
        call()
    assert [v.kind for v in g.violations][:1] == [PLANTS[plant]]
    if mode != "log":  # raise and repair: the allocator is never corrupted
        assert shape.healthy(pool)
        g.check()


def test_a_pattern_is_the_keywords_it_stands_for():
    spec = kvguard.AllocatorSpec(free="deallocate(seq.block_table)",
                                 alloc="allocate(seq.block_table)", share="fork(parent)")
    assert spec == kvguard.AllocatorSpec(
        free="deallocate", free_arg="seq", free_ids="block_table", alloc="allocate",
        alloc_arg="seq", alloc_ids="block_table", share="fork", share_arg="parent")
    assert spec.pattern("free") == "deallocate(seq.block_table)"
    assert spec.pattern("share") == "fork(parent)"


@pytest.mark.parametrize("bad, message", [
    ({"free": "deallocate(seq.block_table", }, "not a method pattern"),
    ({"free": "deallocate(seq.block_table)", "free_arg": "req"}, "was given too"),
    ({"alloc_ids": "block_table"}, "needs alloc_arg"),
    ({"alloc_shares": True}, "refcounted=True"),
    ({"reset": "clear", "free": "clear"}, "named twice"),
    ({"free_ids": "not a path"}, "attribute path"),
])
def test_a_bad_shape_keyword_is_a_clear_error(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        kvguard.AllocatorSpec(**bad)


def test_ids_read_by_a_callable_are_checked_and_repair_drops_a_call_it_cannot_sanitize(
        quiet_kvguard_log):
    pool = RequestPagePool(6)
    spec = PAGE_SPEC.replace(free="free_request", free_arg="req",
                             free_ids=lambda req: tuple(req.pages))
    g = kvguard.guard(pool, spec, on_violation="repair")
    r = Request()
    pool.alloc_pages(r, 2)
    r.pages.append(r.pages[0])
    pool.free_request(r)
    assert [v.kind for v in g.violations] == [kinds.DUPLICATE_ID]
    assert len(pool.free_pages) == 4 and healthy_pages(pool), "the call was dropped"


def test_an_allocation_into_an_argument_that_rebuilds_the_list_hands_out_the_difference():
    class Rebuilding(RequestPagePool):
        def alloc_pages(self, req, n):
            taken, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            req.pages = sorted(taken + req.pages, reverse=True)

    pool = Rebuilding(8)
    g = kvguard.guard(pool, PAGE_SPEC)
    r = Request()
    pool.alloc_pages(r, 2)
    pool.alloc_pages(r, 3)
    assert sorted(g.live) == [0, 1, 2, 3, 4]
    pool.free_request(r)
    assert g.live == {} and g.violations == []


def test_quarantine_refuses_a_free_that_takes_ids_inside_its_argument():
    g = kvguard.guard(RequestPagePool(4), PAGE_SPEC)
    with pytest.raises(ValueError, match="inside its argument"):
        g.set_quarantine(2)
