"""Every reader of the guard under collector pressure, with finalizers that change the ids.

An allocation anywhere (the guard's own, the allocator's) may run the cyclic collector, and a
finalizer may then clear, grow or rewrite the very list a reader is walking. The compiled
reader once read a list's length, allocated its output, and kept reading at the old length:
after a ``clear()`` that is a read through a NULL item array (a segfault); after an append, a
ledger out of step with what the allocator freed. Here the collector is made to run at the
1st, 2nd, ... Nth collector-tracked allocation of a guarded call (``gc.set_threshold``), with
one pending finalizer that clears, grows or rewrites the caller's ids, on every reader: plain
ints, numpy scalars, a mix, block objects read by ``id_attr`` (with a per-item ``skip``, with
declared ``identities``), engine reference counts (``refcount_attr``), a drained iterator, and
an allocation's result. On the compiled wrappers, the closures and the careful path alike:

- nothing crashes and nothing is raised into the caller (log mode);
- what the guard records for the call is the list before or after the change, never a part;
- on the fast paths (compiled and closures), the ledger's live blocks are the allocator's
  own after every call: a list changed since the guard read it is read again before it is
  forwarded. The careful path reads once and forwards what the caller holds then; a finalizer
  that changes the list in between leaves the ledger on what was read (a known window,
  docs/reliability.md).
"""

import gc
import operator
import os

import numpy as np
import pytest

import kvguard
from kvguard.marks import THE_ALLOCATOR

from .conftest import three_ways, use_wrappers

POOL = 64
FIRST = list(range(8))
THRESHOLDS = range(1, int(os.environ.get("KVGUARD_TEST_GC_SWEEP", "15")) + 1)
"""The collector run at the 1st, 2nd, ... allocation of each call. The compiled readers'
allocations come within the first few (a revert of the read_scalars fix crashes at 1 to 3);
the sanitizer runs sweep 8 (each case pays a full collection)."""


class _Block:
    __slots__ = ("block_id", "ref_cnt", "pool")

    def __init__(self, block_id, pool=None):
        self.block_id, self.ref_cnt, self.pool = block_id, 1, pool


class _Pool:
    """Hands out the ids it is asked for, in the shape ``wrap`` makes (the result also kept as
    ``last``, as an allocator keeping its own list would); its free records what it received
    without making a collector-tracked object (``received`` is extended in place, ids read
    with ``operator.index``), so the collector cannot run inside it and change what it saw."""

    num_blocks = POOL

    def __init__(self, wrap):
        self.wrap = wrap
        self.live = set()
        self.received = []
        self.last = None

    def allocate(self, ids):
        self.live.update(ids)
        self.last = self.wrap(self, ids)
        return self.last

    def free(self, blocks):
        received = self.received
        received.clear()
        received.extend(blocks)
        for b in received:
            self.live.discard(operator.index(getattr(b, "block_id", b)))


def _skip_negative(block):
    return block.block_id < 0


def _keeps_all(allocator, items):
    return all(b.pool is allocator for b in items)


_keeps_all.identities = (("pool", THE_ALLOCATOR),)  # C checks each item's pool is the pool
_skip_negative.keeps_all = _keeps_all


def _blocks(pool, ids):
    return [_Block(b, pool) for b in ids]


READERS = {
    # name: (spec keywords, how ids travel, what a finalizer appends)
    "ints": ({}, lambda pool, ids: list(ids), lambda: 9),
    "numpy-scalars": ({}, lambda pool, ids: [np.int64(b) for b in ids], lambda: np.int64(9)),
    "mixed": ({}, lambda pool, ids: [np.int32(b) if b % 2 else b for b in ids],
              lambda: np.int16(9)),
    "objects": ({"id_attr": "block_id"}, _blocks, lambda: _Block(9)),
    "objects-skip": ({"id_attr": "block_id", "skip": lambda b: b.block_id < 0}, _blocks,
                     lambda: _Block(9)),  # no keeps_all: each item asked
    "objects-identities": ({"id_attr": "block_id", "skip": _skip_negative}, _blocks,
                           lambda: _Block(9)),
    "refcounts": ({"id_attr": "block_id", "refcounted": True, "refcount_attr": "ref_cnt"},
                  _blocks, lambda: _Block(9)),
}


def _guarded(reader, accel, fast):
    spec_kw, wrap, extra = READERS[reader]
    pool = _Pool(wrap)
    with use_wrappers(accel):
        guard = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks", **spec_kw),
                              stacks="off", on_violation="log", fast_path=fast)
    return pool, guard, extra


def _under_pressure(threshold, call, mutate):
    """``call()`` with the collector run at its ``threshold``-th tracked allocation, one
    unreachable cycle waiting whose finalizer runs ``mutate`` (once)."""

    armed = [True]

    class Finalizer:
        def __init__(self):
            self.me = self

        def __del__(self):
            if armed.pop():  # a finalizer the call did not run is disarmed after it
                mutate()

    gc.collect()  # a full one: it also empties the free lists, whose reuse never collects
    Finalizer()
    old = gc.get_threshold()
    gc.set_threshold(threshold)
    try:
        return call()
    finally:
        gc.set_threshold(*old)
        armed[:] = [False]


def _ids(items):
    return [operator.index(getattr(b, "block_id", b)) for b in items]


MUTATIONS = {
    "clear": lambda ids, extra: ids.clear(),
    "append": lambda ids, extra: ids.append(extra()),
    "rewrite": lambda ids, extra: ids.__setitem__(slice(None), ids[:3]),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_finalizer_changing_the_ids_of_a_free_never_crashes_or_desynchronizes(reader,
                                                                                mutation):
    change = MUTATIONS[mutation]
    for accel, fast in three_ways():
        for threshold in THRESHOLDS:
            pool, guard, extra = _guarded(reader, accel, fast)
            pool.allocate(FIRST + [9])
            pool.free(pool.wrap(pool, [9]))  # 9 is known and free: an append frees it twice
            given = pool.wrap(pool, FIRST)
            before = _ids(given)
            after = []

            def mutate():
                change(given, extra)
                after.append(_ids(given))

            _under_pressure(threshold, lambda: pool.free(given), mutate)
            where = (reader, mutation, accel is not None, fast, threshold)
            assert guard.stats.internal_errors == 0, where
            recorded = [list(op[1]) for op in guard.history if op[4] == "free"][-1:]
            seen = recorded[0] if recorded and len(guard.history) > 3 else None
            faults = {b for v in guard.violations for b in v.block_ids}
            assert _ids(pool.received) in [before] + after, repr((where, pool.received))
            if not fast:  # the careful path's window: see the module's docstring
                continue
            # the ledger follows what the allocator was given
            assert set(guard.live) == pool.live or faults, (where, sorted(guard.live),
                                                            sorted(pool.live))
            if seen is not None and not faults:
                assert seen == _ids(pool.received), where


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("reader", ["ints", "numpy-scalars", "mixed", "objects"])
def test_a_finalizer_changing_an_allocations_result_never_crashes(reader, mutation):
    """The allocator keeps the list it returned; a finalizer changes it while the guard
    reads it: the guard records the list as it was before or after, never a part, and the
    ledger holds exactly those ids."""
    change = MUTATIONS[mutation]
    for accel, fast in three_ways():
        for threshold in THRESHOLDS:
            pool, guard, extra = _guarded(reader, accel, fast)
            states = []

            def mutate():
                if pool.last is None:  # collected before the allocator made its list
                    return
                states.append(_ids(pool.last))
                change(pool.last, extra)
                states.append(_ids(pool.last))

            got = _under_pressure(threshold, lambda: pool.allocate(FIRST), mutate)
            where = (reader, mutation, accel is not None, fast, threshold)
            assert guard.stats.internal_errors == 0, where
            assert got is pool.last, where
            if not guard.violations:
                assert sorted(guard.live) in ([sorted(s) for s in states] or [FIRST]) + [
                    FIRST], where


def test_a_drained_iterator_over_a_list_a_finalizer_empties():
    """``iterator_ok``: an iterator over a list is drained to be read; a finalizer that
    empties the list under it leaves the guard and the allocator in step."""
    for accel, fast in three_ways():
        for threshold in THRESHOLDS:
            pool = _Pool(lambda pool, ids: list(ids))
            with use_wrappers(accel):
                guard = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks",
                                                                  iterator_ok=True),
                                      stacks="off", on_violation="log", fast_path=fast)
            pool.allocate(FIRST)
            given = list(FIRST)
            _under_pressure(threshold, lambda: pool.free(iter(given)), given.clear)
            assert guard.stats.internal_errors == 0
            assert set(guard.live) == pool.live, (accel is not None, fast, threshold)
