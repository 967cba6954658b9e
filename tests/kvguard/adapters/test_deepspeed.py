"""DeepSpeed 0.19.8 inference v2, on its real source from the sdist in KVGUARD_ENGINE_CACHE.

``blocked_allocator.py``, ``kv_cache.py``, ``sequence_descriptor.py``, ``inference_utils.py`` and
``ragged_manager.py`` run as shipped. The constructor's ``torch.arange(..., pin_memory=True)``
needs an accelerator, so ``BlockedAllocator`` sees a ``torch`` whose ``arange`` drops that flag on
CPU (tests/kvguard/adapters/engines.py); the communication, accelerator, config and C++ op-builder
imports of the other files are stand-ins with the members they use.
"""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.adapters.deepspeed import BLOCKED_ALLOCATOR, SPECS

from . import engines


@pytest.fixture(scope="module")
def ds():
    with engines.loaded("deepspeed") as ns:
        yield ns


def state(a):
    """Everything the allocator knows: its linked free list, head and free count."""
    return a._blocks.tolist(), int(a._head), a._free_blocks


def test_the_builtin_spec_is_found_for_the_real_class(ds):
    assert kvguard.registry.spec_for(ds.BlockedAllocator) is SPECS[BLOCKED_ALLOCATOR]
    kvguard.instrument()
    a = ds.BlockedAllocator(4)
    assert kvguard.guard_of(a).spec is SPECS[BLOCKED_ALLOCATOR]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator to pin memory")
def test_with_an_accelerator_the_constructor_pins_its_free_list_as_shipped(ds):
    a = ds.BlockedAllocator(8)
    assert a._blocks.is_pinned()
    g = kvguard.guard(a)
    ids = a.allocate(3)
    with pytest.raises(kvguard.TensorIdError):
        a.free(ids.cuda())
    a.free(ids.tolist())
    assert g.check() == {None: (0, 0)}


def test_unguarded_the_seed_bug_hands_block_0_out_twice(ds):
    """The bug that started the project, on the real code: the control for the next test."""
    a = ds.BlockedAllocator(4)
    assert a.allocate(3).tolist() == [0, 1, 2]
    a.free([0, 0, 1])
    assert a.free_blocks == 4  # three are free
    assert a.allocate(2).tolist() == [1, 0]
    assert a.allocate(2).tolist() == [0, -1]


@pytest.mark.parametrize("kind, bad", [
    ("duplicate-id", lambda ids: [0, 0, 1]),
    ("tensor-id", lambda ids: ids),                       # allocate()'s own int32 tensor
    ("bool-id", lambda ids: True),
    ("consumed-iterable", lambda ids: (int(b) for b in ids)),
])
def test_the_seed_scenarios_are_caught_with_the_allocator_unchanged(ds, kind, bad):
    a = ds.BlockedAllocator(4)
    g = kvguard.guard(a)
    ids = a.allocate(3)
    before, live = state(a), sorted(g.live)
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free(bad(ids))
    assert info.value.kind == kind
    assert state(a) == before and sorted(g.live) == live
    a.free(ids.tolist())  # and the allocator still works
    assert a.free_blocks == 4 and g.check() == {None: (0, 0)}


def test_a_tensor_would_leave_head_aliasing_the_callers_tensor(ds):
    """Why tensor-id is an error here: unguarded, ``_head`` is a view into the freed tensor."""
    a = ds.BlockedAllocator(4)
    ids = a.allocate(2)
    a.free(ids)
    assert isinstance(a._head, torch.Tensor) and a._head.data_ptr() == ids[1].data_ptr()
    ids[1] = 3  # the caller reuses its buffer ...
    assert a.allocate(1).tolist() == [3]  # ... and the allocator hands out what it now says


def test_double_free_across_calls_and_out_of_range(ds):
    a = ds.BlockedAllocator(4)
    g = kvguard.guard(a)
    ids = a.allocate(2).tolist()
    a.free(ids)
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(ids[:1])
    with pytest.raises(kvguard.InvalidIdError):
        a.free([4])
    with pytest.raises(kvguard.ForeignIdError):
        a.free([3])  # in range, never handed out
    assert g.stats.violations == {"double-free": 1, "invalid-id": 1, "foreign-id": 1}


def test_log_mode_forwards_the_duplicate_and_check_sees_the_corruption(ds):
    a = ds.BlockedAllocator(4)
    g = kvguard.guard(a, on_violation="log")
    a.allocate(3)
    a.free([0, 0, 1])
    assert g.violations[0].kind == "duplicate-id" and a.free_blocks == 4
    with pytest.raises(kvguard.KVGuardError) as info:
        g.check()
    assert info.value.kind == "inconsistent"


def test_repair_mode_frees_each_block_once(ds):
    a = ds.BlockedAllocator(4)
    g = kvguard.guard(a, on_violation="repair")
    a.allocate(3)
    a.free([0, 0, 1])
    assert a.free_blocks == 3 and g.check() == {None: (-1, -1)}
    assert sorted(a.allocate(3).tolist()) == [0, 1, 3]


def test_attaching_to_a_busy_allocator_reads_its_used_blocks(ds):
    a = ds.BlockedAllocator(4)
    ids = a.allocate(2).tolist()
    g = kvguard.guard(a)
    assert sorted(g.live) == ids and g.stats.learned == 0
    with pytest.raises(kvguard.ForeignIdError):
        a.free([2])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5), st.integers(0, 10)), max_size=40))
def test_valid_use_is_invisible_and_the_ledger_agrees_with_the_allocator(ds, ops):
    """DeepSpeed's own long-running test shape: random allocations and frees of whole
    allocations, passed back as lists the way a correct caller does."""
    a = ds.BlockedAllocator(16)
    g = kvguard.guard(a)
    held = []
    for alloc, n, pick in ops:
        if alloc and n <= a.free_blocks:
            held.append(a.allocate(n).tolist())
        elif held:
            a.free(held.pop(pick % len(held)))
    assert g.violations == []
    assert sorted(g.live) == (a._blocks == -1).nonzero().flatten().tolist()
    assert g.check() == {None: (-(16 - a.free_blocks),) * 2}


def cache_config(**kw):
    return types.SimpleNamespace(cache_shape=(1, 1, 4), block_size=4, cache_dtype=torch.float16,
                                 num_allocation_groups=1, max_blocks_per_allocation_group=4, **kw)


def test_blocked_kv_cache_guards_each_cache_group(ds):
    kvguard.instrument()
    cache = ds.BlockedKVCache((cache_config(), cache_config()),
                              types.SimpleNamespace(mode="allocate", size=4))
    guards = [kvguard.guard_of(a) for a in cache._allocators]
    assert all(guards) and guards[0] is not guards[1]
    g0 = cache.reserve(2).tolist()
    g1 = cache.reserve(2, cache_group=1).tolist()
    assert g0 == g1 == [0, 1]  # the same ids, two different blocks
    cache.free(g1, cache_group=1)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        cache.free(g1, cache_group=1)
    assert info.value.violation.allocator_name == guards[1].name
    cache.free(g0)
    assert cache.free_blocks == [4, 4]


def state_manager(ds):
    config = types.SimpleNamespace(max_tracked_sequences=4, offload=False, max_context=64,
                                   memory_config=types.SimpleNamespace(mode="allocate", size=8))
    return ds.DSStateManager(config, (cache_config(),))


def test_state_manager_flush_passes_a_tensor_to_free(ds):
    """``flush_sequence`` frees ``seq.all_block_ids()``, a tensor: what DeepSpeed's own code trips
    under kvguard (a fresh ``torch.cat``, so ``_head`` aliases a temporary: harmless today)."""
    kvguard.instrument()
    manager = state_manager(ds)
    assert kvguard.guard_of(manager._tracking_allocator) is not None
    seq = manager.get_or_create_sequence(7)
    seq.extend_kv_cache(manager.allocate_blocks(2))
    with pytest.raises(kvguard.TensorIdError) as info:
        manager.flush_sequence(7)
    assert info.value.block_ids == (0, 1)
    frames = [f["function"] for f in info.value.violation.to_dict()["call_stack"]][:2]
    assert frames == ["BlockedKVCache.free", "DSStateManager.flush_sequence"]
    assert manager.free_blocks == [6]


def test_state_manager_runs_clean_in_log_mode_apart_from_that_tensor(ds):
    kvguard.instrument(on_violation="log")
    manager = state_manager(ds)
    for uid in (1, 2):
        seq = manager.get_or_create_sequence(uid)
        seq.extend_kv_cache(manager.allocate_blocks(3))
    manager.flush_sequence(1)
    manager.flush_sequence(2)
    kv_guard = kvguard.guard_of(manager._kv_cache._allocators[0])
    assert [v.kind for v in kv_guard.violations] == ["tensor-id", "tensor-id"]
    assert kvguard.guard_of(manager._tracking_allocator).violations == []
    assert manager.free_blocks == [8] and kv_guard.check() == {None: (0, 0)}


# --- who holds a block: the sequence's uid (kvguard.boundaries) ------------------------------


def run_sequences(manager, uids, blocks=2):
    """What ``InferenceEngineV2.put`` does per sequence: ``get_or_create_sequence(uid)``, then the
    model's ``maybe_allocate_kv`` reserves blocks and hands them to ``extend_kv_cache``."""
    for uid in uids:
        seq = manager.get_or_create_sequence(uid)
        seq.extend_kv_cache(manager.allocate_blocks(blocks))


def kv_guard(manager):
    return kvguard.guard_of(manager._kv_cache._allocators[0])


def test_blocks_are_held_by_the_uid_of_the_sequence_they_extend(ds):
    kvguard.instrument(on_violation="log")
    manager = state_manager(ds)
    run_sequences(manager, [11, 12])
    g = kv_guard(manager)
    held = {b: r.holder for b, r in g.live.items()}
    assert held == {b: 11 for b in manager.get_sequence(11).all_block_ids().tolist()} | {
        b: 12 for b in manager.get_sequence(12).all_block_ids().tolist()}
    tracking = kvguard.guard_of(manager._tracking_allocator)
    assert {r.holder for r in tracking.live.values()} == {11, 12}


def test_a_correct_workload_with_reused_blocks_and_uids_reports_only_the_flush_tensor(ds):
    """Sequences come and go, blocks and uids are reused: no ownership report. (The one report
    is ``flush_sequence``'s own ``tensor-id``, shown above, on every flush.)"""
    kvguard.instrument(on_violation="log")
    manager = state_manager(ds)
    for wave in range(5):
        uids = [wave % 2 * 10 + k for k in range(3)]   # 0, 1, 2 then 10, 11, 12, ...
        run_sequences(manager, uids, blocks=1 + wave % 2)
        for uid in reversed(uids):
            manager.flush_sequence(uid)
    kinds = {v.kind for g in (kv_guard(manager), kvguard.guard_of(manager._tracking_allocator))
             for v in g.violations}
    assert kinds == {"tensor-id"}
    assert manager.free_blocks == [8] and kv_guard(manager).live == {}


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_a_flush_of_a_uid_whose_blocks_went_to_another_is_stale(ds, mode, quiet_kvguard_log):
    """A path frees uid 1's blocks and keeps its descriptor (an engine's own preemption, say);
    uid 2 is handed the same blocks; then ``flush_sequence(1)`` frees them again on uid 1's
    behalf: the allocator takes it (they are live), uid 2's KV goes back on the free list."""
    kvguard.instrument(on_violation=mode)
    manager = state_manager(ds)
    run_sequences(manager, [1])
    stale = manager.get_sequence(1).all_block_ids().tolist()
    manager._kv_cache.free(stale)
    run_sequences(manager, [2])
    assert sorted(manager.get_sequence(2).all_block_ids().tolist()) == sorted(stale)
    g = kv_guard(manager)
    if mode == "raise":
        with pytest.raises(kvguard.KVGuardError):  # flush's tensor-id is the first fault
            manager.flush_sequence(1)
    else:
        manager.flush_sequence(1)
    stale_reports = [v for v in g.violations if v.kind == "stale-free"]
    assert len(stale_reports) == 1 and sorted(stale_reports[0].block_ids) == sorted(stale)
    assert "2 holds it" in stale_reports[0].message
    if mode != "log":  # uid 2 keeps its blocks
        assert manager.free_blocks == [6] and {r.holder for r in g.live.values()} == {2}
