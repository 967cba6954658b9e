"""Hugging Face transformers 5.24.0 continuous batching: who holds a block, on the real
``CacheAllocator`` / ``FullAttentionCacheAllocator`` / ``BlockLedger`` / ``CachePool`` from the
wheel (loaded as ``test_huggingface`` loads them). Requests share blocks above the pool (prefix
hits, forks, de-duplication), so correct runs with all of those must report nothing, while a late
free on behalf of a request whose block was handed on is a ``stale-free``."""

import pytest

import kvguard

from .test_huggingface import cache, hf  # noqa: F401 (the module fixture)


@pytest.fixture
def instrumented():
    kvguard.instrument()
    yield
    kvguard.uninstrument()


def test_prefix_sharing_forks_and_finishes_report_nothing(hf, instrumented):  # noqa: F811
    pool, (full, _) = cache(hf, num_sectors=4)
    g = kvguard.guard_of(pool)
    for _ in range(3):
        pool.allocate_sector(full.index)
    full.allocate_cache_to_request("A", 0, 12)            # three blocks
    full.fork_blocks("A", "B", 8)                         # B shares two of them, copies one
    a_blocks = list(full.block_table["A"])
    full.acquire_prefix_blocks("C", 8, a_blocks)          # C: a prefix hit on A's two blocks
    full.free_blocks("A")                                 # A finishes first
    full.free_blocks("C")
    full.allocate_cache_to_request("D", 0, 8)
    full.free_blocks("B")                                 # B releases the shared blocks last
    full.free_blocks("D")
    assert g.violations == [] and g.live == {}


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_a_late_free_of_a_finished_request_after_reuse_is_stale(hf, instrumented, mode,  # noqa: F811
                                                                 quiet_kvguard_log):
    kvguard.uninstrument()
    kvguard.instrument(on_violation=mode)
    pool, (full, _) = cache(hf, num_sectors=1)
    g = kvguard.guard_of(pool)
    pool.allocate_sector(full.index)
    full.allocate_cache_to_request("R", 0, 16)            # every block of the sector
    stale_table = list(full.block_table["R"])
    full.free_blocks("R", no_cache=True)                  # R is cancelled: blocks back
    full.allocate_cache_to_request("Q", 0, 16)            # Q is handed the same blocks
    assert sorted(full.block_table["Q"]) == sorted(stale_table)
    full.block_table["R"] = stale_table                   # a late path with R's old table
    if mode == "raise":
        with pytest.raises(kvguard.StaleFreeError) as info:
            full.free_blocks("R", no_cache=True)
        assert "'Q' holds it" in str(info.value)
    else:
        full.free_blocks("R", no_cache=True)
    assert [v.kind for v in g.violations] == ["stale-free"]
    if mode in ("raise", "repair"):  # nothing of Q's went back to the pool
        assert pool.count_free_blocks(full.index) == 0
        assert {b for (_, b) in g.live} == set(stale_table)


def test_a_late_free_of_a_block_the_fork_still_holds_is_stale(hf, instrumented):  # noqa: F811
    pool, (full, _) = cache(hf, num_sectors=4)
    g = kvguard.guard_of(pool)
    for _ in range(3):
        pool.allocate_sector(full.index)
    full.allocate_cache_to_request("A", 0, 12)
    full.fork_blocks("A", "B", 8)                         # B holds A's first two blocks too
    shared = list(full.block_table["B"][:2])
    old_table = list(full.block_table["A"])
    full.free_blocks("A")                                 # A done: B holds the shared ones
    assert {g.live[(full.index, b)].holder for b in shared} == {"B"}
    full.block_table["A"] = old_table[:2]
    full.ledger.shared_ref_counts.clear()                 # (a late path: A's old view)
    with pytest.raises(kvguard.StaleFreeError):
        full.free_blocks("A")
    full.free_blocks("B")
    assert [v.kind for v in g.violations] == ["stale-free"]
