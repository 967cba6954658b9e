"""The guard checks itself, never the user (kvguard.guard.selfcheck): an incomplete spec is
resynchronized and said once, never a false violation; a wrapper an engine removed is put back.
The four false alarms of an incomplete spec each have a test here that fails without the
self-check (each allocator below is written for these tests, in the shape of an engine's)."""

from __future__ import annotations

import contextlib

import pytest

import kvguard
from kvguard import kinds

from .conftest import three_ways, use_wrappers
from .shape_classes import LAZY_SPEC, LazyFreePool, RequestPagePool, SingleIdPool

WAYS = three_ways()
WAY_IDS = ["compiled" if a else "closures" if f else "careful" for a, f in WAYS]


class PrefixCachePool:
    """``allocate(n, prefix=blocks)`` hands out the cached prefix blocks (a new reference each)
    and ``n`` new ones in one call: a prefix-cache hit."""

    def __init__(self, n):
        self.n = n
        self.refs = [0] * n
        self.free_list = list(range(n))

    def allocate(self, k, prefix=()):
        for b in prefix:
            self.refs[b] += 1
        new = [self.free_list.pop(0) for _ in range(k)]
        for b in new:
            self.refs[b] = 1
        return list(prefix) + new

    def free(self, ids):
        for b in ids:
            self.refs[b] -= 1
            if not self.refs[b]:
                self.free_list.append(b)


class JobPageTable:
    """Jobs' pages in the allocator's own page table; a job may start from another's prompt
    prefix (its pages shared, counted in ``page_refs``); ``finish(job)`` releases them."""

    def __init__(self, n):
        self.n = n
        self.page_refs = [0] * n
        self.free_pages = list(range(n))
        self.table: dict = {}

    def alloc(self, job, k, prefix_of=None, prefix_len=0):
        pages = list(self.table[prefix_of][:prefix_len]) if prefix_of is not None else []
        for p in pages:
            self.page_refs[p] += 1
        for _ in range(k):
            p = self.free_pages.pop(0)
            self.page_refs[p] = 1
            pages.append(p)
        self.table[job] = pages
        return pages

    def release(self, pages):
        for p in pages:
            self.page_refs[p] -= 1
            if not self.page_refs[p]:
                self.free_pages.append(p)

    def finish(self, job):
        self.release(self.table.pop(job))


def guarded(make, spec, mode, way, **options):
    with use_wrappers(way[0]):
        pool = make()
        return pool, kvguard.guard(pool, spec, on_violation=mode, fast_path=way[1], **options)


# --- the four false alarms --------------------------------------------------------------------

@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_an_allocation_that_also_shares_is_no_false_alarm(mode, way):
    spec = kvguard.AllocatorSpec(refcounted=True, size="n",
                                 free_count=lambda p: len(p.free_list))
    pool, g = guarded(lambda: PrefixCachePool(8), spec, mode, way)
    a = pool.allocate(3)
    b = pool.allocate(2, prefix=a[:2])            # a prefix-cache hit
    pool.free(a)
    pool.free(b)
    assert g.violations == [] and g.live == {}
    assert len(g.notes) == 1 and "alloc_shares=True" in g.notes[0]
    g.check()
    with pytest.raises(kvguard.DoubleFreeError) if mode == "raise" else _nothing():
        pool.free(b[:1])                          # still caught afterwards
    assert [v.kind for v in g.violations] == [kinds.DOUBLE_FREE]


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_an_allocation_declared_to_share_is_silent(way):
    spec = kvguard.AllocatorSpec(refcounted=True, alloc_shares=True, refcounts="refs", size="n",
                                 free_count=lambda p: len(p.free_list))
    pool, g = guarded(lambda: PrefixCachePool(8), spec, "raise", way)
    a = pool.allocate(3)
    b = pool.allocate(2, prefix=a[:2])
    assert g.live[a[0]].refcount == 2
    pool.free(a)
    pool.free(b)
    assert g.violations == [] and g.notes == [] and g.live == {}


def test_an_allocation_that_hands_out_a_live_block_it_counts_once_is_still_shared_block():
    class Corrupt(PrefixCachePool):
        def allocate(self, k, prefix=()):
            return [0] if self.refs[0] else super().allocate(k, prefix)

    spec = kvguard.AllocatorSpec(refcounted=True, alloc_shares=True, refcounts="refs", size="n")
    pool = Corrupt(4)
    kvguard.guard(pool, spec)
    pool.allocate(1)
    with pytest.raises(kvguard.SharedBlockError):
        pool.allocate(1)                          # block 0 again, its count still 1


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_a_reset_the_spec_does_not_name_is_resynchronized_and_named(mode, way):
    spec = kvguard.AllocatorSpec(alloc="alloc_pages(req.pages)", free="free_request(req.pages)",
                                 size="num_pages", free_count="available")
    from .shape_classes import Request
    pool, g = guarded(lambda: RequestPagePool(6), spec, mode, way)
    pool.alloc_pages(Request(), 3)
    pool.clear()
    r = Request()
    pool.alloc_pages(r, 4)                        # pages 0..3 again
    assert g.violations == []
    assert g.notes == [f"kvguard: {g.name}: spec incomplete: clear() changed the free count "
                       "from 3 to 6, and no call the spec names explains it; add "
                       'reset="clear" to the AllocatorSpec. The guard resynchronized with the '
                       "allocator"]
    pool.clear()
    assert len(g.notes) == 1, "said once"
    g.check()


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_two_jobs_sharing_a_prefix_through_the_allocators_page_table(way):
    spec = kvguard.AllocatorSpec(alloc="alloc", free="release", refcounted=True,
                                 refcounts="page_refs", size="n",
                                 free_count=lambda p: len(p.free_pages))
    pool, g = guarded(lambda: JobPageTable(8), spec, "raise", way)
    pool.alloc("a", 3)
    pool.alloc("b", 2, prefix_of="a", prefix_len=2)
    pool.finish("a")
    pool.finish("b")
    assert g.violations == [] and g.live == {} and len(g.notes) == 1
    g.check()


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_a_wrapper_an_engine_assigns_then_deletes_is_reinstalled_and_said(way):
    pool, g = guarded(lambda: LazyFreePool(4), LAZY_SPEC, "raise", way)
    a = pool.allocate(2)
    with pool.lazy_free():
        pool.free(a)
    b = pool.allocate(3)                          # a's blocks again: no shared-block
    assert g.violations == []
    assert any("was removed from the instance" in n and "re-installed" in n for n in g.notes)
    pool.free(b)
    with pytest.raises(kvguard.DoubleFreeError):  # the guard is on again
        pool.free(b[:1])


def test_a_wrapper_removed_is_noticed_at_check():
    pool, g = guarded(lambda: LazyFreePool(4), LAZY_SPEC, "raise", (None, True))
    pool.free = print
    del pool.free
    g.check()
    assert "removed" in g.notes[0]
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free(a)


def test_a_wrapper_replaced_by_something_else_is_said_once():
    pool, g = guarded(lambda: LazyFreePool(4), LAZY_SPEC, "raise", (None, True))
    pending = []
    pool.free = pending.extend
    g.check()
    g.check()
    assert len(g.notes) == 1 and "not checked while it stays" in g.notes[0]


def test_a_method_rebound_later_is_wrapped_where_it_now_points():
    class Versioned(LazyFreePool):
        def free_v2(self, ids):
            self.free_list.extend(ids)

    pool, g = guarded(lambda: Versioned(4), LAZY_SPEC, "raise", (None, True))
    a = pool.allocate(2)
    pool.free = pool.free_v2                      # the engine switches implementation
    assert g.live and "rebound" in g.notes[0]    # noticed at the next read of the guard
    pool.free(a)
    assert g.live == {}
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free(a[:1])
    g.unguard()
    assert pool.free == pool.free_v2, "unguard() leaves the engine's own rebinding"


def test_a_double_free_on_a_class_that_looks_refcounted_says_the_spec_may_be_incomplete():
    pool = SingleIdPool(4)
    kvguard.guard(pool, kvguard.AllocatorSpec(alloc="allocate_one", free="release"))
    b = pool.allocate_one()
    pool.retain(b)
    pool.release(b)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.release(b)
    assert 'declare refcounted=True, share="retain"' in str(info.value)


def test_a_share_the_spec_does_not_name_is_taken_from_the_allocators_counts():
    pool = SingleIdPool(4)
    g = kvguard.guard(pool, kvguard.AllocatorSpec(alloc="allocate_one", free="release",
                                                  refcounted=True, refcounts="refs",
                                                  free_count=lambda p: len(p.free_list)))
    b = pool.allocate_one()
    pool.retain(b)
    pool.release(b)
    pool.release(b)
    assert g.violations == [] and "retain() changed the allocator's reference counts" in \
        g.notes[0]


def test_after_a_faulty_call_went_through_in_log_mode_the_counts_excuse_nothing(
        quiet_kvguard_log):
    class Trusting(PrefixCachePool):
        def free(self, ids):  # queues a block each time its count is at or below zero
            for b in ids:
                self.refs[b] -= 1
                if self.refs[b] <= 0:
                    self.free_list.append(b)

    spec = kvguard.AllocatorSpec(refcounted=True, size="n",
                                 free_count=lambda p: len(p.free_list))
    pool = Trusting(4)
    g = kvguard.guard(pool, spec, on_violation="log")
    a = pool.allocate(2)
    pool.free([a[0], a[0]])                       # logged, forwarded: block 0 queued twice
    pool.allocate(3)
    pool.allocate(1)                              # block 0 again, while live
    assert [v.kind for v in g.violations] == [kinds.DUPLICATE_ID, kinds.SHARED_BLOCK]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_under_instrument_the_first_call_after_the_wrapper_was_deleted_is_checked():
    kvguard.register(LazyFreePool, LAZY_SPEC)
    kvguard.instrument()
    try:
        pool = LazyFreePool(4)
        g = kvguard.guard_of(pool)
        a = pool.allocate(2)
        pool.free(a[:1])
        pool.free = print
        del pool.free                             # the class's dispatcher answers now
        with pytest.raises(kvguard.DoubleFreeError):
            pool.free(a[:1])
        assert "re-installed" in g.notes[0]
    finally:
        kvguard.uninstrument()
        kvguard.unregister(LazyFreePool)


class DroppingLazyPool(LazyFreePool):
    """Its lazy region ends with an instance call, after deleting the attribute it shadowed
    ``free`` with: with no dispatcher, that call and every later one reach the class's
    function, past the guard."""

    @contextlib.contextmanager
    def lazy_free(self):
        pending: list = []
        self.free = pending.extend
        try:
            yield
        finally:
            del self.free
            self.free(pending)


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_without_instrument_the_first_call_after_the_wrapper_was_deleted_is_checked(
        way, mode, quiet_kvguard_log):
    """The guard is never silently off: kvguard.guard() alone puts a dispatcher on the class,
    which the first call after ``del pool.free`` meets; the guard puts its wrapper back."""
    pool, g = guarded(lambda: DroppingLazyPool(4), LAZY_SPEC, mode, way)
    a = pool.allocate(2)
    with pool.lazy_free():
        pool.free(a)                              # collected, not freed yet
    assert g.stats.free_calls == 1, "the region's own free was checked"
    assert getattr(vars(pool).get("free"), "__kvguard__", None) is g, "wrapper back on"
    b = pool.allocate(1)
    pool.free(b)
    if mode == "raise":
        with pytest.raises(kvguard.DoubleFreeError):
            pool.free(b)
    else:
        pool.free(b)
        assert [v.kind for v in g.violations] == [kinds.DOUBLE_FREE]
    assert sum("was removed from the instance" in n for n in g.notes) == 1


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_without_instrument_a_class_level_call_reaches_the_guard(way):
    pool, g = guarded(lambda: LazyFreePool(4), LAZY_SPEC, "raise", way)
    a = LazyFreePool.allocate(pool, 2)
    LazyFreePool.free(pool, a)
    with pytest.raises(kvguard.DoubleFreeError):
        LazyFreePool.free(pool, a[:1])
    assert g.stats.alloc_calls == 1 and g.stats.free_calls == 1
    other = LazyFreePool(4)                       # unguarded: straight to the function
    LazyFreePool.free(other, other.allocate(1) * 2)


def test_the_dispatchers_go_when_the_last_guard_goes():
    import gc
    gc.collect()                                  # earlier tests' guards, gone
    functions = {k: vars(LazyFreePool)[k] for k in ("allocate", "free")}
    assert not any(hasattr(f, "__kvguard_function__") for f in functions.values())
    pools = [LazyFreePool(4) for _ in range(2)]
    guards = [kvguard.guard(p, LAZY_SPEC) for p in pools]
    assert vars(LazyFreePool)["free"] is not functions["free"]
    guards[0].unguard()
    assert vars(LazyFreePool)["free"] is not functions["free"], "the other guard holds it"
    del guards, pools
    gc.collect()
    assert {k: vars(LazyFreePool)[k] for k in ("allocate", "free")} == functions


def test_an_engines_own_class_level_rebinding_stays_when_the_guard_goes():
    class Rebinding(LazyFreePool):
        def free(self, ids):
            self.free_list.extend(ids)

    def faster(self, ids):
        self.free_list.extend(ids)

    pool = Rebinding(4)
    g = kvguard.guard(pool, LAZY_SPEC)
    Rebinding.free = faster
    g.unguard()
    assert vars(Rebinding)["free"] is faster


def test_making_many_guards_reads_each_methods_source_once(monkeypatch):
    """Attaching a guard reads the allocator's public methods (observers) from their source:
    once per function and per source text, not at every kvguard.guard()."""
    import ast
    import inspect

    class Fresh(LazyFreePool):
        def drain(self):
            self.free_list.clear()

    parsed, read = [], []
    real_parse, real_source = ast.parse, inspect.getsource
    monkeypatch.setattr(ast, "parse", lambda *a, **k: parsed.append(1) or real_parse(*a, **k))
    monkeypatch.setattr(inspect, "getsource",
                        lambda *a, **k: read.append(1) or real_source(*a, **k))
    kvguard.guard(Fresh(4), LAZY_SPEC).unguard()
    first = len(parsed), len(read)
    for _ in range(4):
        kvguard.guard(Fresh(4), LAZY_SPEC).unguard()
    assert first[0] > 0 and (len(parsed), len(read)) == first
