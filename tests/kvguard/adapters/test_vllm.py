"""vLLM 0.33.0 v1 ``BlockPool``, on the real ``block_pool.py`` and ``kv_cache_utils.py`` from the
wheel in KVGUARD_ENGINE_CACHE (config, hashing, request and event imports are annotation-only
placeholders; prefix hashing and KV events are not exercised).

vllm#1556 was a bug of the v0 block manager (``BlockAllocator.free`` with ``ref_count``, gone from
0.33.0); its test replays the pattern on the v1 API, which kept the same operations: a fork adds
one reference per block (``touch``), finishing a sequence drops them (``free_blocks``).
"""

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.adapters.vllm import BLOCK_POOL, SPECS

from . import engines


@pytest.fixture(scope="module")
def vllm():
    with engines.loaded("vllm") as ns:
        yield ns


def pool_of(vllm, n=8, caching=False):
    return vllm.BlockPool(num_gpu_blocks=n, enable_caching=caching, hash_block_size=16)


def queue(pool):
    """The free queue as the pool links it, and its counter."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], \
        pool.get_num_free_blocks()


def test_the_builtin_spec_is_found_for_the_real_class(vllm):
    assert kvguard.registry.spec_for(vllm.BlockPool) is SPECS[BLOCK_POOL]
    kvguard.instrument()
    pool = pool_of(vllm)
    g = kvguard.guard_of(pool)
    assert g.spec is SPECS[BLOCK_POOL] and g.ledger().learn is False


def test_valid_use_is_invisible(vllm):
    pool = pool_of(vllm, caching=True)
    g = kvguard.guard(pool)
    a = pool.get_new_blocks(3)
    pool.touch(a[:2])                              # a prefix hit by a second request
    pool.free_blocks(reversed(a))                  # one-shot iterator, as the manager passes it
    pool.free_blocks(a[:2])
    pool.free_blocks([pool.null_block, pool.null_block])  # the null block is always skipped
    pool.touch([pool.null_block])
    assert [b.ref_cnt for b in a] == [0, 0, 0] and g.live == {}
    assert g.violations == [] and g.check() == {None: (0, 0)}


def test_touch_revives_a_cached_free_block(vllm):
    pool = pool_of(vllm, caching=True)
    g = kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    pool.touch([b])  # still in the free queue with its prefix: a hit takes it back
    assert b.ref_cnt == 1 and g.live[b.block_id].refcount == 1
    assert g.check() == {None: (-1, -1)}


def test_unguarded_a_block_listed_twice_drives_ref_cnt_below_zero(vllm):
    """vllm#42571's corruption on 0.33.0's single-pass ``free_blocks`` (the control)."""
    pool = pool_of(vllm)
    b, other = pool.get_new_blocks(2)
    pool.free_blocks([b, b])
    assert b.ref_cnt == -1
    with pytest.raises(AssertionError):  # surfaces only when the block is reused
        pool.get_new_blocks(pool.get_num_free_blocks())
    shared = pool_of(vllm)
    (s,) = shared.get_new_blocks(1)
    shared.touch([s])
    shared.free_blocks([s, s])
    assert s.ref_cnt == 0 and s.block_id in queue(shared)[0]  # free while a holder remains


@pytest.mark.parametrize("holders", [1, 2])
def test_regression_vllm_42571_block_twice_in_one_free_blocks_call(vllm, holders):
    """vllm#42571: eager SimpleCPUOffload with sliding-window attention lists a physical block
    again each time it re-enters the window, and frees the list: the same ``KVCacheBlock`` twice
    in one ``free_blocks`` call. Caught at that call, with nothing changed."""
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    b, other = pool.get_new_blocks(2)
    if holders == 2:
        pool.touch([b])  # the connector holds a reference too
    offload_list = [other, b, b]
    before = queue(pool)
    with pytest.raises(kvguard.DuplicateIdError) as info:
        pool.free_blocks(offload_list)
    assert info.value.block_ids == (b.block_id,)
    assert b.ref_cnt == holders and other.ref_cnt == 1 and queue(pool) == before
    assert g.live[b.block_id].refcount == holders


def test_regression_vllm_42571_duplicate_touch_is_caught_too(vllm):
    """The same offload path touched every duplicate (``ref_cnt += N``): caught at the touch."""
    pool = pool_of(vllm)
    kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(kvguard.DuplicateIdError):
        pool.touch([b, b])
    assert b.ref_cnt == 1


def test_release_below_zero_is_a_double_free(vllm):
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    before = queue(pool)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0 and queue(pool) == before and g.check() == {None: (0, 0)}


def test_regression_vllm_1556_fork_of_a_sliding_window_table(vllm):
    """vllm#1556 (v0 "ValueError: Double free!", beam search / n > 1 with a sliding window): a
    sequence's block table reuses physical blocks cyclically, so it lists a block more than once;
    the fork added one reference per entry, and the frees later found a block already free.
    Here the fork's ``touch`` of such a table is stopped, before any count is off."""
    pool = pool_of(vllm)
    kvguard.guard(pool)
    b0, b1 = pool.get_new_blocks(2)
    parent_table = [b0, b1, b0]  # the window wrapped around onto b0
    with pytest.raises(kvguard.DuplicateIdError) as info:
        pool.touch(parent_table)  # fork: one reference per entry
    assert info.value.block_ids == (b0.block_id,) and (b0.ref_cnt, b1.ref_cnt) == (1, 1)
    pool.touch([b0, b1])  # the fix (vllm#3347): each block once
    with pytest.raises(kvguard.DuplicateIdError):
        pool.free_blocks(parent_table)  # _free_block_table on the raw table
    pool.free_blocks([b0, b1])
    pool.free_blocks([b0, b1])
    assert (b0.ref_cnt, b1.ref_cnt) == (0, 0)


def test_a_premature_free_shows_as_a_stale_table(vllm):
    """The other half of vllm#1556: one sequence dropped its reference twice, so the block is
    free while another sequence's table still reads it."""
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])  # parent and child hold it
    pool.free_blocks([b])  # the child drops its reference ...
    pool.free_blocks([b])  # ... and drops it again when its table is freed
    with pytest.raises(kvguard.KVGuardError) as info:
        g.check_tables({"parent": [b]})
    assert info.value.kind == "stale-table"


def test_copy_on_write_reference_taken_behind_the_pool_is_no_double_free(vllm):
    """vLLM's copy-on-write paths take a reference by ``block.ref_cnt += 1`` on the block, not
    through ``touch`` (``SingleTypeKVCacheManager._apply_cow`` holds the CoW target until the
    copy has run; the partial-hit path of the hybrid manager holds the source), and release it
    later through ``free_blocks``. The pool's own ``ref_cnt`` is the truth: two releases of a
    block holding two references are no double free, a third one is."""
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    source, cow = pool.get_new_blocks(2)
    cow.ref_cnt += 1                      # _apply_cow: the pending copy holds the target too
    pool.free_blocks([source, cow])       # the request finishes
    assert cow.ref_cnt == 1 and g.live[cow.block_id].refcount == 1
    pool.free_blocks([cow])               # the copy has run: its reference goes
    assert cow.ref_cnt == 0 and g.violations == [] and g.live == {}
    assert g.check() == {None: (0, 0)}
    before = queue(pool)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.free_blocks([cow])           # a real double free: already queued, ref_cnt 0
    assert info.value.block_ids == (cow.block_id,)
    assert cow.ref_cnt == 0 and queue(pool) == before and g.check() == {None: (0, 0)}


def test_a_reference_added_behind_the_pool_to_a_queued_block_is_still_a_double_free(vllm):
    """The other side: a block already back in the free queue is freed again after someone
    bumped its ``ref_cnt`` behind the pool. vLLM would queue it a second time; the guard says
    double free, whatever the count says."""
    pool = pool_of(vllm)
    kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    b.ref_cnt += 1
    before = queue(pool)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free_blocks([b])
    assert b.ref_cnt == 1 and queue(pool) == before


def test_a_block_whose_own_count_is_already_zero_is_a_double_free(vllm):
    """A reference dropped behind the guard (``ref_cnt -= 1`` on a live block), then a free:
    vLLM would take ``ref_cnt`` to -1. Caught at that free, with nothing changed."""
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    b, other = pool.get_new_blocks(2)
    b.ref_cnt -= 1
    before = queue(pool)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.free_blocks([other, b])
    assert info.value.block_ids == (b.block_id,) and "ref_cnt" in str(info.value)
    assert (b.ref_cnt, other.ref_cnt) == (0, 1) and queue(pool) == before
    assert sorted(g.live) == sorted([b.block_id, other.block_id])


def test_copy_on_write_in_log_mode_keeps_the_ledger_on_the_pools_counts(vllm):
    pool = pool_of(vllm, caching=True)
    g = kvguard.guard(pool, on_violation="log")
    a = pool.get_new_blocks(3)
    pool.touch(a[:1])
    for block in a[1:]:
        block.ref_cnt += 1
    pool.free_blocks(a)
    assert {k: v.refcount for k, v in g.live.items()} == {
        b.block_id: b.ref_cnt for b in a if b.ref_cnt > 0}
    pool.free_blocks(a)
    assert g.violations == [] and g.live == {} and g.check() == {None: (0, 0)}


def test_blocks_of_another_pool_are_that_pools_business(vllm):
    kvguard.instrument()
    host, device = pool_of(vllm, 4), pool_of(vllm, 4)
    (b,) = device.get_new_blocks(1)
    host.free_blocks([b])  # a deferred free routed through block.pool
    assert b.ref_cnt == 0 and device.get_num_free_blocks() == 3
    assert kvguard.guard_of(host).violations == [] and kvguard.guard_of(device).live == {}
    with pytest.raises(kvguard.DoubleFreeError) as info:
        host.free_blocks([b])
    assert info.value.violation.allocator_name == kvguard.guard_of(device).name


def test_unpin_blocks_releases_references_through_the_guard(vllm):
    pool = pool_of(vllm)
    g = kvguard.guard(pool)
    (b,) = pool.get_new_blocks(1)
    pool.unpin_blocks([b], lambda block: None)
    assert g.live == {}
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.unpin_blocks([b], lambda block: None)  # unguarded: an AssertionError, or -1 with -O
    assert info.value.violation.method == "unpin_blocks"


def test_attaching_to_a_busy_pool_adopts_its_references(vllm):
    pool = pool_of(vllm)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    g = kvguard.guard(pool)
    assert {k: v.refcount for k, v in g.live.items()} == {a.block_id: 2, b.block_id: 1}
    pool.free_blocks([a, b])
    pool.free_blocks([a])
    assert g.violations == [] and g.live == {}
    with pytest.raises(kvguard.DoubleFreeError):  # its references were exact, not learned
        pool.free_blocks([a])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ntcf"), st.integers(1, 3), st.integers(0, 99)),
                max_size=40))
def test_ledger_refcounts_follow_ref_cnt(vllm, ops):
    """Random hand-outs, prefix hits, copy-on-write references (``ref_cnt += 1``, behind the
    pool) and releases by a correct caller: no violation, and the ledger's reference counts are
    vLLM's own after every release."""
    pool = pool_of(vllm, 12, caching=True)
    g = kvguard.guard(pool)
    refs = []  # one entry per reference a request holds
    for op, n, pick in ops:
        if op == "n" and n <= pool.get_num_free_blocks():
            refs += pool.get_new_blocks(n)
        elif op == "t" and refs:
            block = refs[pick % len(refs)]
            pool.touch([block])
            refs.append(block)
        elif op == "c" and refs:
            block = refs[pick % len(refs)]
            block.ref_cnt += 1
            refs.append(block)
        elif op == "f" and refs:
            block = refs.pop(pick % len(refs))
            pool.free_blocks([block])
            live = g.live.get(block.block_id)
            assert (live.refcount if live else 0) == block.ref_cnt
    assert g.violations == []
    if not any(op == "c" for op, _, _ in ops):  # a CoW reference is seen at its release only
        assert {k: v.refcount for k, v in g.live.items()} == {
            b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
    assert g.check()[None][0] == g.check()[None][1]
    for block in refs:  # every request finishes
        pool.free_blocks([block])
    assert g.violations == [] and g.live == {} and g.check() == {None: (0, 0)}


def test_guard_cache_verifies_a_block_revived_by_touch(vllm):
    """A prefix-cache hit (``touch``) on a freed block still in the free queue hands its cached
    contents to a new request: they are checked against the checksum taken when the block's
    last reference dropped, so a stale writer that scribbled on it while it sat free is caught
    at the revival (after the call, which has taken the reference), not missed."""
    import torch

    pool = pool_of(vllm, caching=True)
    g = kvguard.guard(pool)
    kv = [torch.randn(2, 8, 4, 2, 8) for _ in range(2)]  # [2, num_blocks, block_size, heads, dim]
    cg = kvguard.guard_cache(kv, g, block_dim=1, name="L")
    with kvguard.owner("req-1"):
        a = pool.get_new_blocks(3)
    ids = [b.block_id for b in a]
    for layer in kv:
        layer[:, ids] = 0.5
    pool.free_blocks(a)
    assert cg.pending() == sorted(ids)
    pool.touch(a[:1])  # a clean revival
    assert g.violations == [] and cg.pending() == sorted(ids[1:])
    kv[1][0, ids[1], 0, 0, 0] = 9.0  # req-1's stale slot mapping writes into a cached block
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        pool.touch(a[1:])
    v = info.value.violation
    assert v.block_ids == (ids[1],) and v.method == "touch" and "L[1]" in v.message
    assert "'req-1'" in v.message and v.extra["check"] == "checksum"
    assert [b.ref_cnt for b in a] == [1, 1, 1] and cg.pending() == []
    assert sorted(g.live) == sorted(ids) and g.check() == {None: (-3, -3)}
    pool.free_blocks(a)  # freed again: fresh checksums, so the old write is reported once
    pool.touch(a)
    assert len(g.violations) == 1 and cg.stats.violations == 1


def test_class_level_calls_reach_the_instance_guard_while_instrumented(vllm):
    """``BlockPool.free_blocks(pool, blocks)`` looks the method up on the class, past the
    instance's guard. Each guard puts a dispatcher on the class for the methods it guards: a class-level call on a guarded pool goes through its guard, one on an
    unguarded pool runs the engine's function, and a guarded pool's own calls never pass the
    dispatcher (the guard forwards to the engine's function itself)."""
    gc.collect()  # earlier tests' guards, and the dispatchers they held, gone
    engine_free = vllm.BlockPool.__dict__["free_blocks"]
    unguarded = pool_of(vllm)  # made before instrument(): never guarded
    kvguard.instrument()
    pool = pool_of(vllm)
    g = kvguard.guard_of(pool)
    assert vllm.BlockPool.__dict__["free_blocks"] is not engine_free
    assert pool.__dict__["free_blocks"].__wrapped__.__func__ is engine_free
    a, b = vllm.BlockPool.get_new_blocks(pool, 2)
    assert sorted(g.live) == sorted([a.block_id, b.block_id])
    vllm.BlockPool.touch(pool, [a])
    vllm.BlockPool.free_blocks(pool, [a, b])
    assert (g.stats.alloc_calls, g.stats.share_calls, g.stats.free_calls) == (1, 1, 1)
    with pytest.raises(kvguard.DoubleFreeError):
        vllm.BlockPool.free_blocks(pool, [b])
    with pytest.raises(kvguard.DuplicateIdError):
        vllm.BlockPool.unpin_blocks(pool, [a, a])  # an adapter's method is dispatched too
    assert (a.ref_cnt, b.ref_cnt) == (1, 0) and queue(pool)[1] == 6

    (c,) = vllm.BlockPool.get_new_blocks(unguarded, 1)  # unguarded: the engine's own code
    vllm.BlockPool.free_blocks(unguarded, [c])
    vllm.BlockPool.free_blocks(unguarded, [c])
    assert c.ref_cnt == -1
    g.unguard()
    vllm.BlockPool.free_blocks(pool, [a])  # unguarded now: straight through
    assert a.ref_cnt == 0 and len(g.violations) == 2
    kvguard.uninstrument()
    assert vllm.BlockPool.__dict__["free_blocks"] is engine_free, "the last guard let go"
