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

import functools
import weakref

from ..marks import guard_of
from ..owners import holding
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


# --- the request lifecycle around the allocators (kvguard.boundaries) -----------------------
#
# DeepSpeed names a sequence by its ``uid`` only in ``DSStateManager``: ``_create_sequence(uid)``
# (reached through ``get_or_create_sequence``) makes its ``DSSequenceDescriptor`` and takes its
# tracking slot, ``flush_sequence(uid)`` frees its blocks and slot. The model's
# ``maybe_allocate_kv(sequence, n)`` reserves blocks through ``state_manager.allocate_blocks(n)``,
# which is told no sequence, and hands them to ``sequence.extend_kv_cache(ids, cache_group)``;
# the descriptor carries no uid. So ``_create_sequence`` runs as the uid and remembers which
# manager and uid each descriptor is for; ``extend_kv_cache`` then makes the uid the holder of
# the blocks it is given (whatever model implementation reserved them), and ``flush_sequence``
# runs as the uid, so a flush of a uid whose blocks went to another sequence is a
# ``stale-free``. A descriptor made before instrumentation has no holder: its blocks are not
# checked for ownership.

STATE_MANAGER = "deepspeed.inference.v2.ragged.ragged_manager.DSStateManager"
SEQUENCE = "deepspeed.inference.v2.ragged.sequence_descriptor.DSSequenceDescriptor"

_SEQUENCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""descriptor -> (uid, its DSStateManager): what ``extend_kv_cache`` needs to name the holder."""


def _creates_sequence(original):
    @functools.wraps(original)
    def _create_sequence(self, uid, *args, **kwargs):
        with holding(uid):
            sequence = original(self, uid, *args, **kwargs)
        try:
            _SEQUENCES[sequence] = (uid, weakref.ref(self))
        except TypeError:  # a descriptor that takes no weak reference: not followed
            pass
        return sequence
    return _create_sequence


def _block_guard(manager, cache_group):
    allocators = getattr(getattr(manager, "_kv_cache", None), "_allocators", ())
    if not 0 <= cache_group < len(allocators):
        return None
    return guard_of(allocators[cache_group])


def _extends_holder(original):
    @functools.wraps(original)
    def extend_kv_cache(self, new_ids, cache_group=0, *args, **kwargs):
        result = original(self, new_ids, cache_group, *args, **kwargs)
        known = _SEQUENCES.get(self)
        manager = known[1]() if known is not None else None
        guard = _block_guard(manager, cache_group) if manager is not None else None
        if guard is not None:
            groups = new_ids if isinstance(new_ids, (list, tuple)) else [new_ids]
            ids = [int(b) for group in groups for b in group.reshape(-1).tolist()]
            guard.add_holder(ids, known[0])
        return result
    return extend_kv_cache


def _uid(args, kwargs):
    return args[0] if args else kwargs.get("uid")


BOUNDARIES = {
    STATE_MANAGER: {"_create_sequence": ("around", _creates_sequence), "flush_sequence": _uid},
    SEQUENCE: {"extend_kv_cache": ("around", _extends_holder)},
}
