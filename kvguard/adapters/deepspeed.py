"""DeepSpeed inference v2 (FastGen), checked against 0.19.8.

``BlockedAllocator.allocate(n)`` returns an int32 CPU tensor. ``free(blocks)`` takes an int or an
iterable, validates each id in a first loop and links them into the free list in a second, so:
duplicates inside one call are never checked (``free([0, 0, 1])`` links block 0 twice, the free
count exceeds the pool, and the next allocations hand block 0 out twice and then ``-1``); a
generator is drained by the first loop and nothing is freed; a tensor is iterated as 0-dim
elements, so ``_head`` becomes a view into the caller's tensor; ``free(True)`` passes
``isinstance(True, int)``. Size ``_num_blocks``, free count the ``free_blocks`` property, and a
used block is ``-1`` in ``_blocks``.

``BlockedKVCache`` routes ``reserve``/``free`` to one ``BlockedAllocator`` per ``cache_group``,
and ``DSStateManager`` tracks sequences with another one (``_tracking_allocator``): each of those
is an instance of this class and is guarded itself, so neither container needs a spec.
``DSStateManager.flush_sequence()`` frees ``seq.all_block_ids()``, a tensor: ``tensor-id``.
"""

from __future__ import annotations

from ..spec import AllocatorSpec

BLOCKED_ALLOCATOR = "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator"


def _used_blocks(allocator) -> list:
    """Blocks handed out before the guard came: ``-1`` marks them in the linked free list."""
    return (allocator._blocks == -1).nonzero().flatten().tolist()


SPECS = {
    BLOCKED_ALLOCATOR: AllocatorSpec(
        alloc="allocate", free="free", free_arg="blocks", size="_num_blocks",
        free_count="free_blocks", live_ids=_used_blocks,
    ),
}
