"""vLLM v1 ``BlockPool``, checked against 0.33.0.

Blocks travel as ``KVCacheBlock`` objects (``block_id``, ``ref_cnt``). ``get_new_blocks(n)``
hands out fresh ones, ``touch(blocks)`` adds a reference (and takes a free block whose prefix is
still cached back out of the free queue), ``free_blocks(blocks)`` drops one reference per entry
and queues a block when it reaches 0, ``unpin_blocks(blocks, on_reuse)`` drops one too. None of
them validates: the same block twice in one ``free_blocks`` call (vllm#42571) or a release below
zero drives ``ref_cnt`` to -1, or to 0 while another request still holds the block, and the
failure surfaces later as an assertion at reuse, or never under ``python -O``.

Block 0 is the null block: popped at start, its ``ref_cnt`` never maintained, skipped by
``free_blocks`` and ``touch``. ``free_blocks`` also hands blocks of another pool (``block.pool``)
on to that pool, whose own guard checks them. ``free_blocks`` iterates its argument once
(``SingleTypeKVCacheManager.free`` passes ``reversed(list)``), so a one-shot iterator is legal.
Copy-on-write takes a reference without ``touch``: ``SingleTypeKVCacheManager._apply_cow`` (and
the partial-hit path of the hybrid manager) does ``block.ref_cnt += 1`` and releases it later
through ``free_blocks``. So each block's own ``ref_cnt`` is the spec's ``refcount_attr``: the
guard takes it as the truth at every release, and a release is a double free only when the
block is already back in the free queue or its ``ref_cnt`` is already 0.

Size ``num_gpu_blocks`` (the null block included), free count ``get_num_free_blocks()``
(blocks in the free queue, evictable cached blocks included).
"""

from __future__ import annotations

from ..boundaries import request_arg, request_id_arg
from ..marks import THE_ALLOCATOR, guard_of
from ..spec import AllocatorSpec
from .methods import adapter, freeing

BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"


def _not_this_pools(block) -> bool:
    """The null block, and a block of another pool: ``free_blocks`` skips the first and hands the
    second to its own pool. The pool being checked is the one whose guard this thread is inside
    right now (a skip sees only the block). Called per block: kept lean."""
    try:
        if block.is_null:
            return True
        pool = block.pool
        if pool is None:
            return False
        other = guard_of(pool)
    except AttributeError:  # not a KVCacheBlock: the guard reports it as an invalid id
        return False
    return other is None or not other.inside()


def _all_this_pools(pool, blocks) -> bool:
    """``_not_this_pools`` answered for a whole call on the guard's fast path: True only when
    no block is the null block and every one belongs to ``pool`` itself (then the skip is False
    for each). Anything else, the careful path asks the skip block by block."""
    for block in blocks:
        if block.is_null or block.pool is not pool:
            return False
    return True


# The same test as identities, for the compiled wrapper to check without calling Python.
_all_this_pools.identities = (("is_null", False), ("pool", THE_ALLOCATOR))
_not_this_pools.keeps_all = _all_this_pools


class _Held:
    """A block referenced before the guard came, as the spec reads blocks (``block_id``), and
    not yet tied to its pool (whose guard is being attached)."""

    __slots__ = ("block_id",)
    pool = None
    is_null = False

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def _live_blocks(pool) -> list:
    return [_Held(b.block_id) for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]


def _sync_refcounts(guard) -> None:
    """A guard attached to a busy pool adopts each live block once; shared ones hold more."""
    pool = guard.allocator
    ledger = guard.ledger(None)
    for block in pool.blocks:
        if block.ref_cnt > 0 and not block.is_null and ledger.is_live(block.block_id):
            ledger.ref[block.block_id] = block.ref_cnt
            # The pool says exactly how many references are out: no longer uncertain, so a
            # drop below zero is a double free again, not something to learn.
            ledger.uncertain.discard(block.block_id)


SPECS = {
    BLOCK_POOL: AllocatorSpec(
        alloc="get_new_blocks", free="free_blocks", share="touch", id_attr="block_id",
        refcounted=True, refcount_attr="ref_cnt", skip=_not_this_pools, iterator_ok=True,
        size="num_gpu_blocks", free_count="get_num_free_blocks", live_ids=_live_blocks,
        adapter=adapter(_sync_refcounts, freeing("unpin_blocks")),
    ),
}


# --- the request lifecycle around the pool (kvguard.boundaries) -----------------------------
#
# ``KVCacheManager`` acts for one request in each of these: while it runs, that request is the
# holder of what the pool hands out and the one whose releases are checked (``stale-free``).
# The ``Scheduler``'s steps are leased: ``schedule()`` returns what a step will use (the blocks
# of every scheduled request), ``update_from_output(output, ...)`` ends it. A preemption drops
# the request's part of the steps in flight (its stale output is never written back into its
# blocks as its own), and so does a finish or an abort (``_free_request``): with no KV
# connector, every writer of a block is ordered after the steps in flight, so the blocks may be
# reused at once, as vLLM does. With a connector its loads race the steps in flight (the hazard
# vLLM's deferred block free closes), and the lease holds until the steps are processed.

KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"


def _pool_guard(scheduler):
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    return guard_of(pool) if pool is not None else None


def _in_flight(scheduler) -> dict:
    """The outputs of the steps in flight, by id (held, so an id is not reused meanwhile)."""
    return scheduler.__dict__.setdefault("_kvguard_in_flight", {})


def _scheduled(scheduler, output) -> None:
    guard = _pool_guard(scheduler)
    if guard is None or output is None:
        return
    manager = scheduler.kv_cache_manager
    step = ("vllm step", id(output))
    _in_flight(scheduler)[id(output)] = output
    for request_id in getattr(output, "num_scheduled_tokens", {}) or {}:
        blocks = [block for group in manager.get_blocks(request_id).blocks for block in group
                  if not block.is_null]
        guard.begin_step(step, blocks, request=request_id)


def _processed(scheduler, args, kwargs) -> None:
    output = args[0] if args else kwargs.get("scheduler_output")
    guard = _pool_guard(scheduler)
    _in_flight(scheduler).pop(id(output), None)
    if guard is not None:
        guard.end_step(("vllm step", id(output)))


def _in_stream_only(scheduler) -> bool:
    """Whether everything that writes a block is ordered after the steps in flight. The model
    runner's steps run one after another, so a block a step in flight still writes may go to a
    request of a later step. A consumer KV connector fills blocks by loads that are not ordered
    against a step in flight when batches overlap (async scheduling or pipeline parallelism on
    a GPU): then a finished or preempted request's blocks must stay out of the pool until the
    steps using them are processed, which is the lease. (vLLM's own reading of this is its
    ``defer_block_free``; it is worked out here from the configuration, not read from it.)"""
    if getattr(scheduler, "connector", None) is None:
        return True
    config = getattr(scheduler, "vllm_config", None)
    transfer = getattr(config, "kv_transfer_config", None)
    overlapping = getattr(config, "max_concurrent_batches", 1) > 1
    return not (overlapping and getattr(transfer, "is_kv_consumer", False))


def _dropped(scheduler, args, kwargs) -> None:
    """A preemption, a finish or an abort: the request's part of the steps in flight will not
    be used (its stale output is dropped or overwritten in order), so on an engine whose writers
    are all ordered by the step stream its blocks may be reused at once, as vLLM 0.33.0 reuses
    them within the same ``schedule()``."""
    request = args[0] if args else kwargs.get("request")
    guard = _pool_guard(scheduler)
    if guard is not None and request is not None and _in_stream_only(scheduler):
        guard.void_in_flight(request.request_id)


BOUNDARIES = {
    KV_CACHE_MANAGER: {
        "allocate_slots": request_arg(0), "free": request_arg(0),
        "remove_skipped_blocks": request_id_arg(0),
    },
    SCHEDULER: {
        "schedule": ("begin", _scheduled),
        "update_from_output": ("end", _processed),
        "_preempt_request": ("end", _dropped),
        "_free_request": ("end", _dropped),
    },
}
