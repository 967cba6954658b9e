"""DeepSpeed inference v2 (checked against 0.19.8).

``BlockedAllocator.allocate(n)`` returns an int32 CPU tensor; ``free(blocks)`` takes an int or an
iterable, validates each id in a first loop and links them into the free list in a second, so:
duplicates inside one call are never checked, a generator is drained by the first loop, a tensor
is iterated as 0-dim elements (and ``_head`` becomes a view into the caller's tensor), and
``free(True)`` passes ``isinstance(True, int)``. Its size is ``_num_blocks`` and its free count the
``free_blocks`` property. ``BlockedKVCache`` routes ``reserve``/``free`` to one such allocator per
``cache_group``; those inner allocators are guarded themselves, so the cache needs no spec.
``DSStateManager`` tracks sequences with another ``BlockedAllocator``: guarded the same way.
"""

from __future__ import annotations

from ..spec import AllocatorSpec

BLOCKED_ALLOCATOR = "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator"

SPECS = {
    BLOCKED_ALLOCATOR: AllocatorSpec(
        alloc="allocate", free="free", free_arg="blocks", size="_num_blocks",
        free_count="free_blocks",
    ),
}
