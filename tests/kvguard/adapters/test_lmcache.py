"""LMCache 0.5.6, on the real ``memory_management.py`` and
``memory_allocators/paged_tensor_memory_allocator.py`` from the wheel in KVGUARD_ENGINE_CACHE (the
package import needs numba and a metrics stack: logger, stats and pin monitors are no-ops, NVTX
is the identity, ``get_size_bytes`` is copied in the loader).
"""

import gc

import pytest

import kvguard
from kvguard.adapters.lmcache import PAGED_ALLOCATOR, SPECS

from . import engines


@pytest.fixture(scope="module")
def lm():
    with engines.loaded("lmcache") as ns:
        yield ns


def allocator(lm, pages=4):
    torch = lm.torch
    shape, dtype = torch.Size([2, 1, 4, 8]), torch.float16  # one page: 128 bytes
    a = lm.PagedTensorMemoryAllocator(torch.zeros(pages * 128, dtype=torch.uint8), [shape],
                                      [dtype], lm.MemoryFormat.KV_2LTD)
    return a, (shape, dtype)


def free_pages(a):
    return [obj.meta.address for obj in a.free_blocks]


def test_the_builtin_spec_is_found_for_the_real_class(lm):
    assert kvguard.registry.spec_for(lm.PagedTensorMemoryAllocator) is SPECS[PAGED_ALLOCATOR]
    kvguard.instrument()
    a, _ = allocator(lm)
    g = kvguard.guard_of(a)
    assert g.spec is SPECS[PAGED_ALLOCATOR] and g.live == {} and g.ledger().size == 4


def test_unguarded_a_double_free_gives_one_page_to_two_owners(lm):
    """The control for LMCache#5005: ``memcheck()`` still passes."""
    a, (shape, dtype) = allocator(lm)
    obj = a.allocate(shape, dtype)
    a.free(obj)
    a.free(obj)
    assert a.memcheck()
    got = [a.allocate(shape, dtype) for _ in range(5)]
    assert any(x is not None and x is y for i, x in enumerate(got) for y in got[i + 1:])


def test_regression_lmcache_5005_double_free(lm):
    """LMCache#5005: the same ``TensorMemoryObj`` freed twice. Caught at the second free."""
    a, (shape, dtype) = allocator(lm)
    g = kvguard.guard(a)
    obj = a.allocate(shape, dtype)
    a.free(obj)
    before = free_pages(a)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        a.free(obj)
    assert info.value.block_ids == (obj.meta.address,) and free_pages(a) == before
    owners = [a.allocate(shape, dtype) for _ in range(4)]
    assert len({id(x) for x in owners}) == 4 and g.check() == {None: (-4, -4)}


def test_regression_lmcache_5005_ref_count_down_clamped_and_freed_again(lm):
    """The other path of LMCache#5005: ``ref_count_down()`` below zero clamps to 0 and frees."""
    a, (shape, dtype) = allocator(lm)
    kvguard.guard(a)
    obj = a.allocate(shape, dtype)
    obj.ref_count_down()
    with pytest.raises(kvguard.DoubleFreeError) as info:
        obj.ref_count_down()
    frames = [f["function"] for f in info.value.violation.to_dict()["call_stack"]]
    assert frames[0] == "TensorMemoryObj.ref_count_down"
    assert free_pages(a).count(obj.meta.address) == 1


def test_batched_calls_are_guarded_too(lm):
    a, (shape, dtype) = allocator(lm)
    g = kvguard.guard(a)
    objs = a.batched_allocate(shape, dtype, 3)
    assert sorted(g.live) == sorted(o.meta.address for o in objs)
    with pytest.raises(kvguard.DuplicateIdError):
        a.batched_free([objs[0], objs[0]])
    assert a.batched_allocate(shape, dtype, 2) is None  # short: it rolls back by itself
    a.batched_free(objs)
    assert g.violations[1:] == [] and g.live == {} and g.check() == {None: (0, 0)}


def test_invalidated_objects_and_a_dying_allocator_release_nothing(lm):
    seen = []
    unsubscribe = kvguard.subscribe(lambda guard, v: seen.append(v.kind))
    try:
        kvguard.instrument()
        a, (shape, dtype) = allocator(lm)
        obj = a.allocate(shape, dtype)
        obj.invalidate()
        a.free(obj)  # ignored by LMCache, so by the guard
        assert len(kvguard.guard_of(a).live) == 1
        a.free(a.allocate(shape, dtype))
        del a, obj
        gc.collect()  # each object's __del__ frees it into the dead allocator once more
    finally:
        unsubscribe()
    assert seen == []


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_pages_of_a_cuda_buffer(lm):
    torch = lm.torch
    shape, dtype = torch.Size([2, 1, 4, 8]), torch.float16
    a = lm.PagedTensorMemoryAllocator(torch.zeros(8 * 128, dtype=torch.uint8, device="cuda"),
                                      [shape], [dtype], lm.MemoryFormat.KV_2LTD)
    g = kvguard.guard(a)
    obj = a.allocate(shape, dtype)
    assert obj.tensor.is_cuda
    a.free(obj)
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(obj)
    a.batched_free(a.batched_allocate(shape, dtype, 3))
    assert g.live == {} and g.check() == {None: (0, 0)}
