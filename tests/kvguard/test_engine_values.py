"""Values the engine hands the guard that the ledger cannot take: settled, never raised.

The engine's code is trusted, but its numbers need not fit: a block's own reference count
(``refcount_attr``) past the ledger's int32 column, negative, or not an int at all; an
``allocate()`` that returns an endless lazy iterator. A count past int32 once raised
``OverflowError`` into the caller after the allocator had run (in log and repair mode too),
leaving another block of the same call live in the ledger; a non-int count made the careful
path contain its own ``TypeError`` and forward the call unchecked. An endless iterator was
drained whole (``MemoryError`` in the caller).
"""

import itertools

import pytest

import kvguard

from .conftest import three_ways, use_wrappers

ODD_COUNTS = [2 ** 31, 2 ** 40, 2 ** 70, -5, 2.0, "3", None, True]


class _Block:
    def __init__(self, block_id):
        self.block_id, self.ref_cnt = block_id, 0


class _RefPool:
    """A vLLM-style pool of block objects with their own ``ref_cnt``; ``free`` takes each
    block back whatever its count says (the guard, not this pool, is under test)."""

    num_blocks = 16

    def __init__(self):
        self.blocks = [_Block(b) for b in range(self.num_blocks)]
        self.free_ids = list(range(self.num_blocks))[::-1]

    def allocate(self, n):
        out = [self.blocks[self.free_ids.pop()] for _ in range(n)]
        for block in out:
            block.ref_cnt = 1
        return out

    def free(self, blocks):
        for block in blocks:
            self.free_ids.append(block.block_id)


SPEC = kvguard.AllocatorSpec(id_attr="block_id", refcounted=True, refcount_attr="ref_cnt",
                             size="num_blocks")


@pytest.mark.parametrize("count", ODD_COUNTS, ids=repr)
@pytest.mark.parametrize("mode", ["log", "repair", "raise"])
def test_an_odd_engine_refcount_is_settled_for_its_block_alone(count, mode,
                                                               quiet_kvguard_log):
    for accel, fast in three_ways():
        pool = _RefPool()
        with use_wrappers(accel):
            guard = kvguard.guard(pool, SPEC, stacks="off", on_violation=mode, fast_path=fast)
        odd, plain = pool.allocate(2)
        odd.ref_cnt = count
        where = (accel is not None, fast)
        try:
            pool.free([plain, odd])
        except kvguard.KVGuardError:
            assert mode == "raise", where
        # anything else (OverflowError, TypeError) fails the test here
        assert guard.stats.internal_errors == 0, where
        if mode != "raise":
            assert plain.block_id not in guard.live, (where, "the plain block stayed live")


@pytest.mark.parametrize("mode", ["log", "repair", "raise"])
def test_an_endless_allocation_is_read_up_to_the_pools_size_and_reported(mode,
                                                                         quiet_kvguard_log):
    """``allocate()`` returns ``itertools.count()``: the guard reads one id more than the pool
    has blocks (so the result must repeat an id or leave the pool, and says which), the
    caller's iterator goes on from there, and nothing is drained without bound."""
    class Endless:
        num_blocks = 8

        def allocate(self):
            return itertools.count()

        def free(self, ids):
            pass

    for accel, fast in three_ways():
        pool = Endless()
        with use_wrappers(accel):
            guard = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks"),
                                  stacks="off", on_violation=mode, fast_path=fast)
        try:
            got = pool.allocate()
        except kvguard.KVGuardError as err:
            assert mode == "raise" and err.kind == "invalid-id"
        else:
            assert mode != "raise"
            assert list(itertools.islice(got, 12)) == list(range(12))
            assert [v.kind for v in guard.violations] == ["invalid-id"]
            assert sorted(guard.live) == list(range(8))


def test_an_endless_allocation_from_a_pool_of_unknown_size_is_bounded(quiet_kvguard_log):
    class Endless:
        def allocate(self):
            return itertools.count()

        def free(self, ids):
            pass

    pool = Endless()
    guard = kvguard.guard(pool, stacks="off", on_violation="log")
    got = pool.allocate()
    assert next(got) == 0
    from kvguard.guard.readers import UNSIZED_READ
    assert len(guard.live) <= UNSIZED_READ
