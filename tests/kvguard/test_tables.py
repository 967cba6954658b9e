"""Guard.check_tables: block tables (a mapping owner -> ids, or a padded 2-D tensor) against the
ledger. Both forms are checked against one reference model written here in plain Python, on
random pool states and tables (hypothesis), and the tensor form on CUDA where a GPU is present
(the tests whose id holds "cuda")."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]


def model(ledger, rows):
    """What check_tables must find: block -> rows holding it, for stale and shared blocks."""
    stale, holders = {}, {}
    for r, ids in enumerate(rows):
        for b in dict.fromkeys(b for b in ids if b >= 0):
            target = holders if ledger.is_live(b) else stale
            target.setdefault(b, []).append(r)
    shared = {b: rs for b, rs in holders.items() if len(rs) > ledger.refcount(b)}
    return stale, shared


def findings(violations):
    return {v.kind: v.block_ids for v in violations}


def expected(ledger, rows):
    stale, shared = model(ledger, rows)
    out = {}
    if stale:
        out["stale-table"] = tuple(sorted(stale))
    if shared:
        out["shared-block"] = tuple(sorted(shared))
    return out


def padded(rows, width=None, pad=-1, dtype=torch.int64, device="cpu"):
    width = width or max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=dtype,
                        device=device).reshape(len(rows), width)


@st.composite
def pool_and_tables(draw):
    refcounted = draw(st.booleans())
    n = draw(st.integers(1, 12))
    if refcounted:
        allocator = RefcountedPool(n)
        g = kvguard.guard(allocator, REFCOUNTED_POOL_SPEC, on_violation="log")
    else:
        allocator = LinkedFreeList(n)
        g = kvguard.guard(allocator, LINKED_FREE_LIST_SPEC, on_violation="log")
    live = []
    for _ in range(draw(st.integers(0, 12))):
        op = draw(st.sampled_from(["alloc", "free", "share"]))
        if op == "alloc":
            free = allocator.num_free() if refcounted else allocator.free_blocks
            if free:
                live += allocator.allocate(draw(st.integers(1, free)))
        elif op == "free" and live:
            b = draw(st.sampled_from(live))
            live.remove(b)
            allocator.free([b])
        elif op == "share" and live and refcounted:
            b = draw(st.sampled_from(live))
            allocator.share([b])
            live.append(b)
    ids = st.integers(-3, n + 2)
    rows = draw(st.lists(st.lists(ids, max_size=6), max_size=6))
    return g, rows


@settings(max_examples=150, deadline=None)
@given(pool_and_tables())
def test_both_forms_agree_with_the_model(case):
    g, rows = case
    ledger = g.ledger()
    want = expected(ledger, rows)
    assert findings(g.check_tables({("seq", r): ids for r, ids in enumerate(rows)})) == want
    if rows:
        assert findings(g.check_tables(padded(rows))) == want
        assert findings(g.check_tables(padded(rows, dtype=torch.int32, pad=-7))) == want


def test_owners_are_named_rows_for_a_tensor_and_keys_for_a_mapping():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    x, y = a.allocate(3), a.allocate(2)
    a.free([y[0]])
    table = padded([x, y + [x[1]], [x[2]]])
    stale, shared = g.check_tables(table)
    assert stale.block_ids == (y[0],) and shared.block_ids == (x[1], x[2])
    assert f"block {y[0]} in 1 (free since call #4)" in stale.message
    assert f"block {x[1]} in 0, 1, 1 reference(s)" in shared.message
    stale, shared = g.check_tables({"x": x, "y": y + [x[1]], "z": [x[2]]})
    assert f"block {y[0]} in 'y'" in stale.message
    assert f"block {x[2]} in 'x', 'z'" in shared.message
    assert g.stats.violations == {"stale-table": 2, "shared-block": 2}


def test_refcounts_are_respected():
    p = RefcountedPool(4)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    ids = p.allocate(2)
    p.share(ids[:1])
    ok = [ids, ids[:1], [ids[1], ids[1], -1]]  # a block twice in one row counts once
    assert g.check_tables(padded(ok[:2])) == []
    assert g.check_tables({"a": ok[0], "b": ok[1]}) == []
    with pytest.raises(kvguard.SharedBlockError) as info:
        g.check_tables(padded([ids, ids[:1], ids[:1]]))
    assert info.value.block_ids == (ids[0],)
    with pytest.raises(kvguard.SharedBlockError) as info:
        g.check_tables({"a": ids, "b": ids})
    assert info.value.block_ids == (ids[1],)
    assert g.check_tables(padded([[ids[1], ids[1]]])) == []


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.uint8], ids=str)
def test_padding_and_integer_dtypes(dtype):
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    x = a.allocate(3)
    if dtype == torch.uint8:  # no negative entries: no padding either, every entry is an id
        assert g.check_tables(torch.tensor([x], dtype=dtype)) == []
        with pytest.raises(kvguard.StaleTableError) as info:
            g.check_tables(padded([x], width=4, pad=255, dtype=dtype))
        assert info.value.block_ids == (255,)
        return
    rows = [x, []]
    assert g.check_tables(padded(rows, width=5, dtype=dtype)) == []
    assert g.check_tables(padded(rows, width=5, pad=-100, dtype=dtype)) == []


def test_ids_outside_the_ledger_are_stale():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    x = a.allocate(2)
    (v,) = g.check_tables(padded([x + [5, 8, 1000]]))
    assert v.kind == "stale-table" and v.block_ids == (5, 8, 1000)
    assert "block 5 in 0 (never handed out)" in v.message
    assert "block 8 in 0 (outside the pool [0, 8))" in v.message
    (w,) = g.check_tables({"s": x + [5, 8, 1000]})
    assert w.block_ids == v.block_ids


def test_empty_tables():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    assert g.check_tables({}) == []
    assert g.check_tables({"a": []}) == []
    assert g.check_tables(torch.zeros((0, 5), dtype=torch.long)) == []
    assert g.check_tables(torch.zeros((3, 0), dtype=torch.long)) == []
    assert g.check_tables(torch.full((3, 4), -1)) == []


def test_an_empty_ledger():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, kvguard.AllocatorSpec(), on_violation="log")  # no size: no columns yet
    assert len(g.ledger().stamp) == 0
    (v,) = g.check_tables(torch.tensor([[0, -1]]))
    assert v.block_ids == (0,)


BAD_TABLES = [
    (TypeError, torch.zeros(3, dtype=torch.long)),
    (TypeError, torch.zeros((2, 2, 2), dtype=torch.long)),
    (TypeError, torch.zeros((2, 2))),
    (TypeError, torch.zeros((2, 2), dtype=torch.bool)),
    (TypeError, torch.zeros((2, 2), dtype=torch.complex64)),
    (TypeError, [[0, 1]]),
    (ValueError, {"a": [True]}),
    (ValueError, {"a": [0.5]}),
    (ValueError, {"a": ["0"]}),
    (ValueError, {"a": torch.zeros((2, 2), dtype=torch.long)}),
    (ValueError, {"a": torch.tensor([1.0])}),
    (ValueError, {"a": torch.tensor([True])}),
]


@pytest.mark.parametrize("error, tables", BAD_TABLES, ids=lambda x: repr(x)[:40])
def test_bad_tables_are_refused_and_nothing_is_recorded(error, tables):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    a.allocate(2)
    with pytest.raises(error):
        g.check_tables(tables)
    assert g.violations == []


def test_every_kind_of_id_container_in_a_mapping():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    x = a.allocate(6)
    tables = {"list": [x[0], -1], "tuple": (x[1],), "array": np.array([x[2], -1]),
              "tensor": torch.tensor([x[3], -1], dtype=torch.int32), "int": x[4],
              "range": range(x[5], x[5] + 1), "0-dim": torch.tensor(x[5])}
    (v,) = g.check_tables(tables)
    assert v.kind == "shared-block" and v.block_ids == (x[5],)
    assert "'range', '0-dim'" in v.message


def test_objects_carrying_their_id():
    class Block:
        def __init__(self, block_id):
            self.block_id = block_id

    class Pool:
        def __init__(self):
            self.inner = LinkedFreeList(8)

        def get_new_blocks(self, n):
            return [Block(b) for b in self.inner.allocate(n)]

        def free_blocks(self, blocks):
            self.inner.free([b.block_id for b in blocks])

    p = Pool()
    g = kvguard.guard(p, kvguard.AllocatorSpec(alloc="get_new_blocks", free="free_blocks",
                                               id_attr="block_id"), on_violation="log")
    mine = p.get_new_blocks(2)
    p.free_blocks(mine[1:])
    (v,) = g.check_tables({"req": mine})
    assert v.kind == "stale-table" and v.block_ids == (mine[1].block_id,)


def test_a_block_in_the_wrong_owners_table_when_owners_are_labelled():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    with kvguard.owner("req-a"):
        x = a.allocate(2)
    with kvguard.owner("req-b"):
        y = a.allocate(2)
    (v,) = g.check_tables({"req-a": x + [y[0]], "req-b": y})
    assert v.kind == "stale-table" and v.block_ids == (y[0],)
    assert "owned by 'req-b'" in v.message
    # keys the engine never labelled allocations with are not compared with owners
    assert findings(g.check_tables({"seq-1": x + [y[0]], "seq-2": y[1:]})) == {}
    assert findings(g.check_tables({"seq-1": x + [y[0]], "seq-2": y})) == {
        "shared-block": (y[0],)}


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_form_on_device(device):
    p = RefcountedPool(64)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC, on_violation="log")
    rows = [p.allocate(4) for _ in range(8)]
    p.share(rows[0][:2])
    rows.append(rows[0][:2])  # a prefix shared through the allocator
    p.free(rows[3])
    want = expected(g.ledger(), rows)
    assert findings(g.check_tables(padded(rows, device=device))) == want
    assert set(want) == {"stale-table"}


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_tensor_form_syncs_once_on_a_clean_table():
    a = LinkedFreeList(4096)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    rows = [a.allocate(16) for _ in range(64)]
    table = padded(rows, width=20, device="cuda")
    g.check_tables(table)  # warm up: the first call may load kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert g.check_tables(table) == []
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 1


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_mapping_of_tensors_syncs_once():
    a = LinkedFreeList(256)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    tables = {f"s{i}": torch.tensor(a.allocate(4), device="cuda") for i in range(16)}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert g.check_tables(tables) == []
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 1


def test_blocks_adopted_from_a_busy_refcounted_pool_are_never_called_shared():
    """Attached late, the guard cannot know how many references a live block holds."""
    from kvguard.examples import REFCOUNTED_POOL_SPEC, RefcountedPool

    pool = RefcountedPool(4)
    ids = pool.allocate(1)
    pool.share(ids)
    spec = REFCOUNTED_POOL_SPEC.replace(live_ids=lambda p: [b for b in range(4) if p.ref_cnt[b]])
    g = kvguard.guard(pool, spec)
    three = {"a": ids, "b": ids, "c": ids}
    assert g.check_tables(three) == []
    assert g.check_tables(torch.tensor([ids, ids, ids])) == []
    fresh = pool.allocate(1)
    with pytest.raises(kvguard.SharedBlockError):
        g.check_tables({"a": fresh, "b": fresh})
