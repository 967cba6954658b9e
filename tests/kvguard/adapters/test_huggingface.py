"""Hugging Face transformers 5.24.0 continuous batching, on the real ``cache_pool.py``,
``cache_allocator.py`` (``BlockLedger``, ``CacheAllocator``) and ``full_attention.py`` from the
wheel in KVGUARD_ENGINE_CACHE. Two helpers of ``continuous_batching/utils.py`` (``exact_div``,
``find_head_dim``) are copied in the loader, whose imports pull in the whole library; the model
config is a namespace with ``head_dim``. ``PagedAttentionCache`` itself is not built: the tests
do what it does with the pool (``allocate_sector``, then the allocators' block calls).
"""

import types

import pytest
import torch

import kvguard
from kvguard.adapters.huggingface import CACHE_POOL, SPECS

from . import engines


@pytest.fixture(scope="module")
def hf():
    with engines.loaded("transformers") as ns:
        yield ns


def cache(hf, num_sectors=4, layers=((0, 1), (2,))):
    """A pool shared by one full-attention allocator per layer group, as PagedAttentionCache
    sets it up (two trash sectors in front of the cache tensor)."""
    pool = hf.CachePool(num_sectors=num_sectors, num_allocators=len(layers))
    allocators = [hf.FullAttentionCacheAllocator(i, types.SimpleNamespace(head_dim=4), 1,
                                                 torch.float16, 4, list(group), True)
                  for i, group in enumerate(layers)]
    per_sector = 4 * max(a.bytes_per_block for a in allocators)
    non_trash = num_sectors * per_sector
    tensor = torch.zeros(non_trash + 2 * per_sector, dtype=torch.uint8)
    for a in allocators:
        a.register_cache_tensor(per_sector, non_trash, tensor, pool)
    return pool, allocators


def test_the_builtin_spec_is_found_for_the_real_class(hf):
    assert kvguard.registry.spec_for(hf.CachePool) is SPECS[CACHE_POOL]
    kvguard.instrument()
    pool, _ = cache(hf)
    assert kvguard.guard_of(pool).spec is SPECS[CACHE_POOL]


def test_ids_are_namespaced_per_allocator_index(hf):
    kvguard.instrument()
    pool, (pair, single) = cache(hf)  # blocks of two layers (4 per sector) and of one (8)
    g = kvguard.guard_of(pool)
    pool.allocate_sector(0)
    for _ in range(3):
        pool.allocate_sector(1)
    (a,) = pool.get_free_blocks(0, 1)
    b = pool.get_free_blocks(1, 24)
    assert a in b  # one id in two indexes: two different blocks, both live
    assert (0, a) in g.live and (1, a) in g.live
    pool.free_blocks(0, [a])
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.free_blocks(0, [a])
    assert info.value.violation.pool == 0
    pool.free_blocks(1, b)
    assert g.live == {} and g.violations[1:] == []
    assert (g.ledger(0).size, g.ledger(1).size) == (6 * 4, 6 * 8)


def test_block_ledger_sharing_frees_each_block_once(hf):
    """A fork shares the source's full blocks (``BlockLedger`` counts them); the pool sees each
    block go back once, when its last reference is released."""
    kvguard.instrument()
    pool, (full, _) = cache(hf)
    g = kvguard.guard_of(pool)
    pool.allocate_sector(full.index)
    full.allocate_cache_to_request("parent", 0, 12)  # three blocks
    full.fork_blocks("parent", "child", 8)           # two shared, one copied
    assert len(full.ledger.shared_ref_counts) == 2
    full.free_blocks("parent")
    assert len(g.live) == 3                          # two shared + the child's own
    full.free_blocks("child")
    assert g.live == {} and g.violations == []


def test_unguarded_a_double_free_hands_one_block_out_twice(hf):
    """The control: ``free_blocks`` appends whatever it gets."""
    pool, (full, _) = cache(hf)
    pool.allocate_sector(0)
    b = pool.get_free_blocks(0, 1)
    pool.free_blocks(0, b)
    pool.free_blocks(0, b)
    again = pool.get_free_blocks(0, pool.count_free_blocks(0))
    assert again.count(b[0]) == 2


def test_regression_hf_cache_pool_double_free(hf):
    """A block returned to ``CachePool`` twice: caught at the second call, pool unchanged."""
    pool, (full, _) = cache(hf)
    g = kvguard.guard(pool)
    pool.allocate_sector(0)
    b = pool.get_free_blocks(0, 1)
    pool.free_blocks(0, b)
    before = pool.count_free_blocks(0)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free_blocks(0, b)
    assert pool.count_free_blocks(0) == before and g.live == {}
    assert pool.get_free_blocks(0, before).count(b[0]) == 1


@pytest.mark.parametrize("kind, bad", [
    ("tensor-id", lambda ids: torch.tensor(ids)),
    ("bool-id", lambda ids: [True]),
    ("duplicate-id", lambda ids: ids + ids),
    ("foreign-id", lambda ids: [0]),  # block 0 sits in trash sector 0
])
def test_what_cache_pool_accepts_silently_is_rejected(hf, kind, bad):
    pool, _ = cache(hf)
    g = kvguard.guard(pool)
    pool.allocate_sector(0)
    ids = pool.get_free_blocks(0, 1)
    before = pool.count_free_blocks(0)
    with pytest.raises(kvguard.KVGuardError) as info:
        pool.free_blocks(0, bad(ids))
    assert info.value.kind == kind and pool.count_free_blocks(0) == before
    assert list(g.live) == [(0, ids[0])]


def test_a_block_twice_in_a_request_table_is_caught_when_the_request_is_freed(hf):
    """Like vLLM's sliding-window tables: ``CacheAllocator.free_blocks`` releases every table
    entry, and an unshared block is released (and returned) once per entry."""
    kvguard.instrument()
    pool, (full, _) = cache(hf)
    pool.allocate_sector(0)
    full.allocate_cache_to_request("r", 0, 4)
    full.block_table["r"] *= 2
    with pytest.raises(kvguard.DuplicateIdError):
        full.free_blocks("r")


def test_reset_and_new_blocks_per_sector_start_afresh(hf):
    kvguard.instrument()
    pool, (full, _) = cache(hf)
    g = kvguard.guard_of(pool)
    pool.allocate_sector(0)
    pool.get_free_blocks(0, 3)
    pool.reset()
    assert g.live == {}
    pool.set_blocks_per_sector(0, full.blocks_per_sector * 2)
    pool.allocate_sector(0)
    pool.free_blocks(0, pool.get_free_blocks(0, 8))
    assert g.violations == [] and g.ledger(0).size == 6 * full.blocks_per_sector * 2


def test_check_tables_counts_block_ledger_references(hf):
    """A fork shares the parent's full blocks above the pool: ``BlockLedger.shared_ref_counts``
    holds their references, the pool handed each out once. Given those counts (``refs=``),
    ``check_tables`` lets both tables hold a shared block and still catches a block that two
    tables hold without a second reference."""
    kvguard.instrument()
    pool, (full, _) = cache(hf)
    g = kvguard.guard_of(pool)
    pool.allocate_sector(full.index)
    full.allocate_cache_to_request("parent", 0, 12)
    full.fork_blocks("parent", "child", 8)  # blocks 0-1 of the parent shared, one copied
    shared = full.block_table["parent"][:2]
    refs = full.ledger.shared_ref_counts
    assert sorted(refs) == sorted(shared) and full.block_table["child"][:2] == shared
    assert g.check_tables(full.block_table, pool=full.index, refs=refs) == []
    rows = torch.tensor(list(full.block_table.values()))
    assert g.check_tables(rows, pool=full.index, refs=refs) == []
    with pytest.raises(kvguard.SharedBlockError) as info:  # without the counts: misjudged
        g.check_tables(full.block_table, pool=full.index)
    assert info.value.block_ids == tuple(sorted(shared))

    own = full.block_table["child"][2]  # the child's copy: one reference
    stray = {**full.block_table, "stray": [own, -1, -1]}
    third = {**full.block_table, "third": [shared[1], -1, -1]}  # two references, three tables
    for tables, block in ((stray, own), (third, shared[1])):
        for form in (tables, torch.tensor(list(tables.values()))):
            with pytest.raises(kvguard.SharedBlockError) as info:
                g.check_tables(form, pool=full.index, refs=refs)
            assert info.value.block_ids == (block,)

    full.free_blocks("parent")  # the shared blocks stay live (the child holds them)
    assert g.check_tables(full.block_table, pool=full.index, refs=refs) == []
    full.free_blocks("child")
    with pytest.raises(kvguard.StaleTableError):  # counts never revive a freed block
        g.check_tables({"late": shared}, pool=full.index, refs={shared[0]: 2})


@pytest.mark.parametrize("refs, error", [
    ([1, 2], TypeError), ({1: True}, TypeError), ({"1": 2}, TypeError), ({1: 0}, ValueError),
])
def test_check_tables_rejects_bad_reference_counts(hf, refs, error):
    pool, (full, _) = cache(hf)
    g = kvguard.guard(pool)
    pool.allocate_sector(0)
    pool.get_free_blocks(0, 2)
    with pytest.raises(error, match="refs"):
        g.check_tables({"r": [1]}, pool=0, refs=refs)
    assert g.violations == []
