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

import functools

from ..marks import guard_of
from ..owners import holding
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


# --- the request lifecycle around the pool (kvguard.boundaries) -----------------------------
#
# Each ``CacheAllocator`` keeps a request's blocks in ``block_table[request_id]`` and shares
# blocks between requests in its own ``BlockLedger`` (prefix hits, forks, de-duplication of
# identical blocks), above the pool: the pool sees a block handed out once and freed once, by
# whichever request released it last. So each method that acts for a request runs as its holder,
# and afterwards the guard is told which blocks the request holds now (its block table) and, on
# ``free_blocks``, that its reference to blocks the allocator kept (cached, or held by others)
# ended. A late free on behalf of a request then shows as the ``stale-free`` it is.

CACHE_ALLOCATOR = ("transformers.generation.continuous_batching.cache_allocators."
                   "cache_allocator.CacheAllocator")
FULL_ATTENTION = ("transformers.generation.continuous_batching.cache_allocators."
                  "full_attention.FullAttentionCacheAllocator")


def _pool_guard(allocator):
    pool = getattr(allocator, "pool", None)
    return guard_of(pool) if pool is not None else None


def _holds_its_table(request_position: int):
    """The method acts for the request at ``request_position`` (the destination of a fork);
    afterwards the request holds every block of its table."""
    def make(original):
        @functools.wraps(original)
        def as_request(self, *args, **kwargs):
            request = args[request_position] if len(args) > request_position else None
            if request is None:
                return original(self, *args, **kwargs)
            with holding(request):
                result = original(self, *args, **kwargs)
            guard = _pool_guard(self)
            if guard is not None:
                guard.add_holder(list(self.block_table.get(request, ())), request,
                                 pool=self.index)
            return result
        return as_request
    return make


def _frees_its_table(original):
    """``free_blocks(request_id)`` releases the request's references in the ``BlockLedger``
    first: a complete block goes to the allocator's prefix cache, not to the pool, so a late
    free on behalf of a request whose blocks were handed on is checked against their holders
    before the ledger changes (``Guard.release_by``): raise mode raises with the allocator
    untouched, repair mode leaves the stale blocks out of the request's table (their holder
    keeps them), log mode lets it through (reported once: the pool's own check is not run
    again)."""
    @functools.wraps(original)
    def free_blocks(self, request_id, *args, **kwargs):
        table = list(self.block_table.get(request_id, ()))
        guard = _pool_guard(self)
        stale = guard.release_by(table, request_id, pool=self.index, method="free_blocks") if (
            guard is not None and table) else []
        if stale and guard.mode == "repair":
            table = [b for b in table if b not in set(stale)]
            self.block_table[request_id] = list(table)
        with holding(None if stale else request_id):
            result = original(self, request_id, *args, **kwargs)
        if guard is not None and table:  # what stayed out of the pool is no longer its
            guard.drop_holder(table, request_id, pool=self.index)
        return result
    return free_blocks


BOUNDARIES = {
    CACHE_ALLOCATOR: {
        "free_blocks": ("around", _frees_its_table),
        "acquire_prefix_blocks": ("around", _holds_its_table(0)),
        "fork_blocks": ("around", _holds_its_table(1)),
        "mark_complete_blocks": ("around", _holds_its_table(0)),
    },
    FULL_ATTENTION: {"allocate_cache_to_request": ("around", _holds_its_table(0))},
}
