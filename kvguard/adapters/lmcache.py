"""LMCache's ``PagedTensorMemoryAllocator``, checked against 0.5.6.

The allocator pre-creates one ``TensorMemoryObj`` per page and recycles it forever: the object
is the page, and its index is ``obj.meta.address``. ``allocate()``/``batched_allocate()`` pop
objects off a deque (``None`` when short), ``free(obj)``/``batched_free(objs)`` push them back
after one check, ``is_valid()`` (``invalidate()`` is commented out, so objects stay valid). The
usual path is ``obj.ref_count_down()``, which frees at 0, and when the count goes negative clamps
it to 0 and frees again. Either way a second free queues the page twice and the next two
allocations hand the same object to two owners (LMCache#5005), while ``memcheck()`` still
passes. Size ``len(paged_buffers)``, free count ``len(free_blocks)``; an invalidated object is
ignored by ``free()``, and so by the guard, as are the frees of a dying allocator's objects.
"""

from __future__ import annotations

import functools

from ..marks import guard_of
from ..owners import holding
from ..spec import AllocatorSpec
from .methods import adapter, allocating, freeing

PAGED_ALLOCATOR = (
    "lmcache.v1.memory_allocators.paged_tensor_memory_allocator.PagedTensorMemoryAllocator"
)


def _not_a_release(obj) -> bool:
    """``free()`` returns early for an invalidated object: not a release at all. And when an
    allocator is garbage-collected, the ``__del__`` safety net of every object still in its free
    deque frees that object once more: the allocator is gone (its guard's weak reference is
    already cleared), and nothing is released to anyone."""
    is_valid = getattr(obj, "is_valid", None)
    if callable(is_valid) and not is_valid():
        return True
    parent = getattr(obj, "parent_allocator", None)
    guard = guard_of(parent) if parent is not None else None
    return guard is not None and guard.allocator is None


class _Page:
    """A page handed out before the guard came, in the form the spec reads: ``.meta.address``
    (the live objects themselves are held by their owners, out of the allocator's reach)."""

    __slots__ = ("meta", "address")

    def __init__(self, address: int) -> None:
        self.meta = self
        self.address = address


def _live_pages(allocator) -> list:
    free = {obj.meta.address for obj in allocator.free_blocks}
    return [_Page(page) for page in range(len(allocator.paged_buffers)) if page not in free]


SPECS = {
    PAGED_ALLOCATOR: AllocatorSpec(
        alloc="allocate", free="free", id_attr="meta.address", skip=_not_a_release,
        size=lambda a: len(a.paged_buffers), free_count=lambda a: len(a.free_blocks),
        live_ids=_live_pages,
        adapter=adapter(allocating("batched_allocate"), freeing("batched_free")),
    ),
}


# --- who holds a page: the cache key (kvguard.boundaries) -----------------------------------
#
# The allocator hands a page out for no one in particular; ``LocalCPUBackend`` files it under a
# key: ``submit_put_task(key, obj)`` keeps a reference for the key in ``hot_cache``,
# ``remove(key)`` drops it (``ref_count_down``: the page goes back to the allocator when no
# reader holds it either). So after a put the key holds the page, and ``remove`` runs as the
# key; whatever reference stays (a reader's) is no longer the key's. A remove of a key whose
# page was freed by an over-release elsewhere (a reader's ``ref_count_down`` too many,
# LMCache#5005's clamp) and handed to another key since is then a ``stale-free``, where before
# it silently put the other key's page on the free list.

LOCAL_CPU_BACKEND = "lmcache.v1.storage_backend.local_cpu_backend.LocalCPUBackend"


def _page_guard(obj):
    parent = getattr(obj, "parent_allocator", None)
    return guard_of(parent) if parent is not None else None


def _key_holds_what_it_stored(original):
    @functools.wraps(original)
    def submit_put_task(self, key, memory_obj, *args, **kwargs):
        result = original(self, key, memory_obj, *args, **kwargs)
        guard = _page_guard(memory_obj)
        if guard is not None and getattr(self, "hot_cache", {}).get(key) is memory_obj:
            guard.add_holder([memory_obj], key)
        return result
    return submit_put_task


def _removes_as_key(original):
    @functools.wraps(original)
    def remove(self, key, *args, **kwargs):
        obj = getattr(self, "hot_cache", {}).get(key)
        guard = _page_guard(obj) if obj is not None else None
        if guard is None:
            return original(self, key, *args, **kwargs)
        with holding(key):
            result = original(self, key, *args, **kwargs)
        guard.drop_holder([obj], key)  # a reader's reference may keep the page: not the key's
        return result
    return remove


BOUNDARIES = {
    LOCAL_CPU_BACKEND: {"submit_put_task": ("around", _key_holds_what_it_stored),
                        "remove": ("around", _removes_as_key)},
}
"""LMCache's key boundaries (``kvguard.boundaries``)."""
