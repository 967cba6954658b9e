"""Snapshots that tell whether a rejected call changed anything."""

from kvguard.examples import LinkedFreeList, RefcountedPool


def allocator_state(allocator):
    if isinstance(allocator, LinkedFreeList):
        return (list(allocator._blocks), allocator._head, allocator._free_blocks)
    if isinstance(allocator, RefcountedPool):
        return (list(allocator.ref_cnt), list(allocator._free), set(allocator._cached))
    raise TypeError(type(allocator))


def ledger_state(guard):
    return {
        pool: (tuple(bytes(c) for c in ledger.columns()), ledger.adopted)
        for pool, ledger in guard._ledgers.items()
    }


def snapshot(allocator, guard):
    return allocator_state(allocator), ledger_state(guard)
