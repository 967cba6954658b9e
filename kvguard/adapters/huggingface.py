"""Hugging Face transformers continuous batching, checked against 5.24.0.

``PagedAttentionCache`` keeps its free blocks in a ``CachePool``, shared by one ``CacheAllocator``
per attention type; each allocator is an ``index`` into the pool, and block ids are namespaced
per index (``sector * blocks_per_sector[index] + k``), so the guard keeps one ledger per index.
``get_free_blocks(index, n)`` returns a list of ids, ``free_blocks(index, block_ids)`` appends
them to the index's free trees with no check at all: a duplicate, a block already free, a tensor
or a list of bools is accepted and handed out again later. Sectors 0 and 1 are reserved trash
sectors, so their blocks are never handed out (``foreign-id`` if freed).

Sharing is counted above the pool: ``BlockLedger`` holds the references of blocks that two or
more requests share, and a ``CacheAllocator`` returns a block to the pool only when its last
reference is released, so the pool itself sees each block handed out and freed once.
``reset()`` (and ``set_blocks_per_sector(index, n)``, for one index) empties the pool's books:
the guard's ledgers follow.
"""

from __future__ import annotations

from ..spec import AllocatorSpec
from .methods import adapter, resetting, resizing

CACHE_POOL = "transformers.generation.continuous_batching.cache_allocators.cache_pool.CachePool"


def _sizes(pool) -> list:
    """Ids per index: every sector, trash sectors included, times that index's blocks/sector."""
    sectors = pool.num_sectors + pool.num_reserved_sectors
    return [sectors * per_sector for per_sector in pool.blocks_per_sector]


def _index(args, kwargs):
    """The sub-pool ``set_blocks_per_sector(index, n)`` starts afresh with another id space."""
    return args[0] if args else kwargs.get("index")


SPECS = {
    CACHE_POOL: AllocatorSpec(
        alloc="get_free_blocks", free="free_blocks", free_arg="block_ids", pool_arg="index",
        size=_sizes,
        adapter=adapter(resetting("reset"), resizing("set_blocks_per_sector", _index)),
    ),
}
